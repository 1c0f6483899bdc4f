// Causal attention on the CPU read straight from the paged KV cache, for bfloat16 and float32.
//
// Each query row of each head is one fixed computation over its sequence's positions 0..p in
// order: scores as float32 dot products (lane sums in a fixed order, see Chunks, then the same
// reduction tree every time), a float32 softmax, the values summed into float32 in position order.
// No step of it depends on the other rows, the batch, how a prompt was chunked or the thread
// count, so a position's output has the same bits in a prefill, in a chunk after cached tokens and
// in any decode batch: what the engine's exactness needs, and what CPU SDPA (blocked by query rows
// and padded keys) does not give.
// Reading the pages in place also means no second copy of the K/V, and no per-layer matmul calls
// (about 50 us each at one row in oneDNN). The query heads that share a KV head run together,
// each key and value loaded once for all of them, and with enough rows a task takes a row's every
// KV head: the SmolLM2 shape's 30 layers at 32 rows of 256 positions took 19 ms against 29-31 ms
// head by head, the heads then interleaved in the pages (bench/attention_decode.py). The pages
// may have any strides but head_dim's: the CPU cache holds each KV head's rows together
// (attention.new_pages), which a task reads one after another.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using tailrace::exp16;
using tailrace::kLanes;
using tailrace::lanes;
using tailrace::load16;
using tailrace::PagedAttention;
using tailrace::store16;

// The 16 lane sums of v[0..15], lane j holding v[j]'s: a fixed tree of shuffles and adds, so each
// sum's rounding depends on its own vector alone, never on the others or on how many are live.
inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int j = 0; j < 8; ++j)
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
    for (int j = 0; j < 4; ++j)
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[j], w[j + 4], 0x88), _mm512_shuffle_f32x4(w[j], w[j + 4], 0xDD));
    for (int j = 0; j < 2; ++j)
        y[j] = _mm512_add_ps(_mm512_unpacklo_ps(x[j], x[j + 2]), _mm512_unpackhi_ps(x[j], x[j + 2]));
    const __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(y[0]), _mm512_castps_pd(y[1]))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(y[0]), _mm512_castps_pd(y[1]))));
    // The tree leaves v[j]'s sum in lane order 0,2,1,3,8,10,9,11,4,6,5,7,12,14,13,15.
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), z);
}

template <typename T>
struct Rows {
    // Page rows of positions [base, base + count), count <= 16: one table look-up when a block
    // holds whole groups of 16, else one per position.
    const PagedAttention<T>& p;
    const int32_t* table;

    int64_t page_row(int64_t pos) const {
        return static_cast<int64_t>(table[(pos / p.block_size) * p.table_block_stride]) * p.block_size + pos % p.block_size;
    }

    void fill(int64_t base, int64_t count, int64_t out[16]) const {
        const bool one_block = p.block_size % kLanes == 0;  // base is a multiple of 16
        const int64_t first = page_row(base);
        for (int64_t t = 0; t < count; ++t)
            out[t] = one_block ? first + t : page_row(base + t);
    }
};

// How a head's row of T is read, a chunk at a time, as float32 lanes. float32: 16 elements a chunk.
// bfloat16: 32 a chunk as vdpbf16ps takes them, in pairs: 32-bit lane l holds elements 2l and
// 2l + 1, the odd one widened by a mask and the even one by a shift, one instruction each for 16
// elements where widening 16 takes two. Which lane sums which elements only orders each head's
// sums, the same for every row, batch and thread count. q . k: per chunk, each lane adds its odd
// product, then its even one (vdpbf16ps's order; two FMAs give the same sums where it is absent,
// as in bf16_linear.cpp), then the 16 lanes are summed by sum_lanes16.
template <typename T, bool Native>
struct Chunks;

template <bool Native>
struct Chunks<float, Native> {
    static constexpr int64_t kWidth = 16, kParts = 1;
    using Query = __m512;
    using Key = __m512;

    // head_dim is a multiple of 16: every chunk is whole
    static __mmask16 mask(int64_t, int64_t) { return 0xFFFF; }
    static Query query(const float* q, __mmask16) { return _mm512_loadu_ps(q); }
    static Key key(const float* k, __mmask16) { return _mm512_loadu_ps(k); }
    static __m512 dot(__m512 acc, Query q, Key k) { return _mm512_fmadd_ps(q, k, acc); }
    static void values(const float* v, __mmask16, __m512 out[kParts]) { out[0] = _mm512_loadu_ps(v); }
    static void store(float* out, __m512 acc, __m512, __m512 scale, __mmask16) {
        _mm512_storeu_ps(out, _mm512_mul_ps(acc, scale));
    }
};

template <bool Native>
struct Chunks<c10::BFloat16, Native> {
    static constexpr int64_t kWidth = 32, kParts = 2;  // parts: the even elements, the odd ones
    struct Widened { __m512 odd, even; };
    using Query = std::conditional_t<Native, __m512i, Widened>;
    using Key = Query;

    static __m512i load(const c10::BFloat16* p, __mmask16 m) { return _mm512_maskz_loadu_epi32(m, p); }
    static __m512 odd(__m512i pairs) { return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536))); }
    static __m512 even(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

    static __mmask16 mask(int64_t dim, int64_t c) { return lanes((dim - c * kWidth) / 2); }
    static Query query(const c10::BFloat16* q, __mmask16 m) {
        const __m512i pairs = load(q, m);
        if constexpr (Native)
            return pairs;
        else
            return Widened{odd(pairs), even(pairs)};
    }
    static Key key(const c10::BFloat16* k, __mmask16 m) { return query(k, m); }
    static __m512 dot(__m512 acc, const Query& q, const Key& k) {
        if constexpr (Native)
            return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k);
        else
            return _mm512_fmadd_ps(q.even, k.even, _mm512_fmadd_ps(q.odd, k.odd, acc));
    }
    static void values(const c10::BFloat16* v, __mmask16 m, __m512 out[kParts]) {
        const __m512i pairs = load(v, m);
        out[0] = even(pairs);
        out[1] = odd(pairs);
    }
    // each part rounded as store16 rounds, put back in pairs
    static void store(c10::BFloat16* out, __m512 even, __m512 odd, __m512 scale, __mmask16 m) {
        const __m512i low = tailrace::bf16_lanes(_mm512_mul_ps(even, scale));
        const __m512i high = _mm512_slli_epi32(tailrace::bf16_lanes(_mm512_mul_ps(odd, scale)), 16);
        _mm512_mask_storeu_epi32(out, m, _mm512_or_si512(low, high));
    }
};

// G query heads from `head` on, all reading KV head `kv_head`, of one query row that sees
// positions 0..last of sequence `seq` (the last p.window of them where set). Each key and value is read once for the G heads; each
// head's arithmetic is its own, in the same order whatever G or the batch.
// D: the head's chunks when known at compile time (the loops over them unroll and the
// accumulators stay in registers), 0 to work it out from p.dim.
template <typename T, bool Native, int G, int D>
void attend_group(const PagedAttention<T>& p, int64_t row, int64_t head, int64_t kv_head, int64_t seq, int64_t last,
                  std::vector<float>& scores) {
    using C = Chunks<T, Native>;
    const int64_t n = last + 1, dim = D > 0 ? D * C::kWidth : p.dim;
    const int64_t chunks = D > 0 ? D : (dim + C::kWidth - 1) / C::kWidth;
    // Positions first..last are seen; the loops run over whole groups of 16 from `start`, the
    // positions before `first` in its group masked out (`skip`).
    const int64_t first = p.window > 0 ? std::max<int64_t>(0, n - p.window) : 0, start = first / kLanes * kLanes;
    const int64_t padded = ((n - start + kLanes - 1) / kLanes) * kLanes;
    const Rows<T> rows{p, p.tables + seq * p.table_seq_stride};
    scores.resize(G * padded);
    float* const scored = scores.data();  // once: `scores` is thread_local, its address a call to find
    // The arrays over heads and chunks are no larger than used, and every loop over them unrolls
    // (the pragmas): one left rolled kept its array in memory, every accumulator update a store,
    // and the kernel 1.5-2x slower.
    constexpr int kMost = D > 0 ? D : 256 / C::kWidth;
    __mmask16 mask[kMost];
#pragma GCC unroll 16
    for (int64_t c = 0; c < chunks; ++c)
        mask[c] = C::mask(dim, c);
    typename C::Query q[G][kMost];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
        const T* q_row = p.q + row * p.q_stride + (head + g) * dim;
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c)
            q[g][c] = C::query(q_row + c * C::kWidth, mask[c]);
    }
    const __m512 scale = _mm512_set1_ps(p.scale);
    const bool capped = p.softcap > 0.0f;
    const __m512 cap = _mm512_set1_ps(p.softcap), inverse_cap = _mm512_set1_ps(1.0f / p.softcap);
    int64_t page_rows[16];
    __m512 best[G];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
        best[g] = _mm512_set1_ps(-INFINITY);
    __m512 dots[G][16];
    for (int64_t base = start; base < n; base += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - base), skip = std::max<int64_t>(0, first - base);
        rows.fill(base, count, page_rows);
        for (int64_t t = 0; t < kLanes; ++t) {
            if (t < skip || t >= count) {
#pragma GCC unroll 16
                for (int g = 0; g < G; ++g)
                    dots[g][t] = _mm512_setzero_ps();
                continue;
            }
            const T* key = p.k + page_rows[t] * p.slot_stride + kv_head * p.head_stride;
            typename C::Key k[kMost];
#pragma GCC unroll 16
            for (int64_t c = 0; c < chunks; ++c)
                k[c] = C::key(key + c * C::kWidth, mask[c]);
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) {
                __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 16
                for (int64_t c = 0; c < chunks; ++c)
                    acc = C::dot(acc, q[g][c], k[c]);
                dots[g][t] = acc;
            }
        }
        const __mmask16 live = lanes(count) & ~lanes(skip);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) {
            __m512 s = _mm512_mul_ps(sum_lanes16(dots[g]), scale);
            if (capped)
                s = _mm512_mul_ps(cap, tailrace::tanh16(_mm512_mul_ps(s, inverse_cap)));
            _mm512_storeu_ps(scored + g * padded + base - start, s);
            best[g] = _mm512_mask_max_ps(best[g], live, best[g], s);
        }
    }
    __m512 inverse[G];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
        float* head_scores = scored + g * padded;
        // a sink is one more logit in the softmax's max and sum, with no value to weigh
        const float sink = p.sinks != nullptr ? static_cast<float>(p.sinks[head + g]) : -INFINITY;
        const float top = std::max(_mm512_reduce_max_ps(best[g]), sink);
        const __m512 max = _mm512_set1_ps(top);
        __m512 total = _mm512_setzero_ps();
        for (int64_t base = start; base < n; base += kLanes) {
            const __mmask16 live = lanes(n - base) & ~lanes(std::max<int64_t>(0, first - base));
            float* at = head_scores + base - start;
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(at), max)));
            _mm512_storeu_ps(at, e);
            total = _mm512_add_ps(total, e);
        }
        const float sum = _mm512_reduce_add_ps(total);
        inverse[g] = _mm512_set1_ps(1.0f / (p.sinks != nullptr ? sum + std::exp(sink - top) : sum));
    }
    __m512 acc[G][kMost][C::kParts];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c)
#pragma GCC unroll 16
            for (int64_t part = 0; part < C::kParts; ++part)
                acc[g][c][part] = _mm512_setzero_ps();
    for (int64_t base = start; base < n; base += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - base);
        rows.fill(base, count, page_rows);
        for (int64_t t = std::max<int64_t>(0, first - base); t < count; ++t) {
            const T* value = p.v + page_rows[t] * p.slot_stride + kv_head * p.head_stride;
            __m512 weight[G];
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g)
                weight[g] = _mm512_set1_ps(scored[g * padded + base - start + t]);
#pragma GCC unroll 16
            for (int64_t c = 0; c < chunks; ++c) {
                __m512 v[C::kParts];
                C::values(value + c * C::kWidth, mask[c], v);
#pragma GCC unroll 8
                for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
                    for (int64_t part = 0; part < C::kParts; ++part)
                        acc[g][c][part] = _mm512_fmadd_ps(weight[g], v[part], acc[g][c][part]);
            }
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
        T* out = p.out + (row * p.heads + head + g) * dim;
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c)
            C::store(out + c * C::kWidth, acc[g][c][0], acc[g][c][C::kParts - 1], inverse[g], mask[c]);
    }
}

constexpr int64_t kMaxGroup = 8;  // query heads done together: their queries stay in registers
constexpr int64_t kRowsPerThread = 4;  // rows a thread needs before a task takes a whole row

template <typename T, bool Native, int D>
void attend_some(const PagedAttention<T>& p, int64_t count, int64_t row, int64_t head, int64_t kv_head, int64_t seq,
                 int64_t last, std::vector<float>& scores) {
    switch (count) {
        case 1: return attend_group<T, Native, 1, D>(p, row, head, kv_head, seq, last, scores);
        case 2: return attend_group<T, Native, 2, D>(p, row, head, kv_head, seq, last, scores);
        case 3: return attend_group<T, Native, 3, D>(p, row, head, kv_head, seq, last, scores);
        case 4: return attend_group<T, Native, 4, D>(p, row, head, kv_head, seq, last, scores);
        case 5: return attend_group<T, Native, 5, D>(p, row, head, kv_head, seq, last, scores);
        case 6: return attend_group<T, Native, 6, D>(p, row, head, kv_head, seq, last, scores);
        case 7: return attend_group<T, Native, 7, D>(p, row, head, kv_head, seq, last, scores);
        default: return attend_group<T, Native, 8, D>(p, row, head, kv_head, seq, last, scores);
    }
}

// Every query head of KV head `kv_head` for one row, up to kMaxGroup at a time; head_dim 32, 64
// and 128 (the embedded model's and the common ones) and 512 (Gemma 4's global layers, past what
// the worked-out path's arrays hold) compiled for their size.
template <typename T, bool Native>
void attend_heads(const PagedAttention<T>& p, int64_t row, int64_t kv_head, int64_t seq, int64_t last,
                  std::vector<float>& scores) {
    constexpr int64_t width = Chunks<T, Native>::kWidth;
    const int64_t group = p.heads / p.kv_heads;
    for (int64_t done = 0; done < group; done += kMaxGroup) {
        const int64_t head = kv_head * group + done, count = std::min(kMaxGroup, group - done);
        if (p.dim == 32)
            attend_some<T, Native, 32 / width>(p, count, row, head, kv_head, seq, last, scores);
        else if (p.dim == 64)
            attend_some<T, Native, 64 / width>(p, count, row, head, kv_head, seq, last, scores);
        else if (p.dim == 128)
            attend_some<T, Native, 128 / width>(p, count, row, head, kv_head, seq, last, scores);
        else if (p.dim == 512)
            attend_some<T, Native, 512 / width>(p, count, row, head, kv_head, seq, last, scores);
        else
            attend_some<T, Native, 0>(p, count, row, head, kv_head, seq, last, scores);
    }
}

// q [T, H, D]; k_pages, v_pages [P, kvH, D], any strides but D's, the same for both;
// query_start_loc [>= B + 1], seq_lens [>= B] (int32); block_tables [B', max_blocks] int32, any
// strides. Rows outside every sequence are zero.
torch::Tensor paged_attention(const torch::Tensor& q_any, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                              const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                              const torch::Tensor& block_tables, int64_t block_size, int64_t num_seqs, double scale,
                              int64_t window, double softcap, const c10::optional<torch::Tensor>& sinks) {
    // q may be a view of rows of the fused q/k/v projection: each row's heads contiguous is enough
    const bool rows_packed = q_any.dim() == 3 && q_any.stride(2) == 1 && q_any.stride(1) == q_any.size(2);
    const torch::Tensor q = rows_packed ? q_any : q_any.contiguous();
    TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 3 && k_pages.stride(2) == 1 && v_pages.sizes() == k_pages.sizes() &&
                v_pages.strides() == k_pages.strides(),
                "q [T, H, D] and pages [P, kvH, D], head_dim contiguous, K and V alike");
    TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() && q.scalar_type() == v_pages.scalar_type(),
                "q and the pages must share a dtype");
    const int64_t dim = q.size(2);
    TORCH_CHECK(dim % kLanes == 0 && (dim <= 256 || dim == 512), "head_dim must be a multiple of 16 up to 256, or 512");
    TORCH_CHECK(q.size(1) % k_pages.size(1) == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                block_tables.scalar_type() == torch::kInt32, "metadata must be int32");
    TORCH_CHECK(!sinks || (sinks->scalar_type() == q.scalar_type() && sinks->is_contiguous() &&
                           sinks->numel() == q.size(1)), "sinks must be [H] in q's dtype");
    const tailrace::QueryRows rows = tailrace::query_rows(query_start_loc.data_ptr<int32_t>(),
                                                          seq_lens.data_ptr<int32_t>(), num_seqs, q.size(0));
    torch::Tensor out = torch::empty(q.sizes(), q.options());
    tailrace::with_element_type(q.scalar_type(), "paged_attention", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        PagedAttention<T> p{q.data_ptr<T>(), q.stride(0), k_pages.data_ptr<T>(), v_pages.data_ptr<T>(), out.data_ptr<T>(),
                     block_tables.data_ptr<int32_t>(), block_tables.stride(0), block_tables.stride(1), block_size,
                     q.size(1), k_pages.size(1), dim, static_cast<float>(scale), k_pages.stride(0), k_pages.stride(1),
                     window, static_cast<float>(softcap), sinks ? sinks->data_ptr<T>() : nullptr};
        tailrace::paged_attention(p, rows);
    });
    return out;
}

}  // namespace

tailrace::QueryRows tailrace::query_rows(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
                                         int64_t rows) {
    QueryRows out{std::vector<int64_t>(rows, -1), std::vector<int64_t>(rows, 0)};
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t start = query_start_loc[s], end = query_start_loc[s + 1], len = seq_lens[s];
        TORCH_CHECK(0 <= start && start <= end && end <= rows && end - start <= len, "bad query_start_loc/seq_lens");
        for (int64_t r = start; r < end; ++r) {
            out.seq[r] = s;
            out.last[r] = len - (end - r);
        }
    }
    return out;
}

template <typename T>
void tailrace::paged_attention(const PagedAttention<T>& p, const QueryRows& rows) {
    // An item is a row's KV heads, all of them where there are rows enough (fewer, longer tasks;
    // with the CPU pages' heads apart, one head a task measured the same at 8 and 32 rows), one
    // otherwise, so a lone decode row still uses every thread; a head's arithmetic is the same
    // either way. A prefill's later rows see more keys, so the threads take items one at
    // a time (parallel.h), the last rows first: the longest go out while there are others left to
    // even the threads out (contiguous halves measured 1:3 apart at 128 rows).
    const int64_t threads = at::get_num_threads(), num_rows = static_cast<int64_t>(rows.seq.size());
    const int64_t heads_per_item = num_rows >= kRowsPerThread * threads ? p.kv_heads : 1;
    const int64_t items_per_row = p.kv_heads / heads_per_item, items = num_rows * items_per_row;
    const int64_t group = p.heads / p.kv_heads;
    tailrace::with_native_bf16<T>([&](auto native) {
        tailrace::parallel_chunks(items, 1, [&](int64_t taken, int64_t) {
            thread_local std::vector<float> scores;
            const int64_t item = items - 1 - taken;
            const int64_t row = item / items_per_row, kv_first = item % items_per_row * heads_per_item;
            for (int64_t kv_head = kv_first; kv_head < kv_first + heads_per_item; ++kv_head) {
                if (rows.seq[row] < 0)
                    std::fill_n(p.out + (row * p.heads + kv_head * group) * p.dim, group * p.dim, T(0));
                else
                    attend_heads<T, decltype(native)::value>(p, row, kv_head, rows.seq[row], rows.last[row], scores);
            }
        });
    });
}

template void tailrace::paged_attention(const PagedAttention<float>&, const QueryRows&);
template void tailrace::paged_attention(const PagedAttention<c10::BFloat16>&, const QueryRows&);

void register_paged_attention(pybind11::module& m) {
    namespace py = pybind11;
    m.def("paged_attention", &paged_attention,
          "causal attention of q [T, H, D] over paged K/V through block tables (bfloat16 or float32); window: "
          "the positions a row sees back from itself (0: all); softcap: scores through softcap * tanh(s / softcap); "
          "sinks [H]: a logit each head's softmax takes in",
          py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("query_start_loc"), py::arg("seq_lens"),
          py::arg("block_tables"), py::arg("block_size"), py::arg("num_seqs"), py::arg("scale"), py::arg("window") = 0,
          py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
}
