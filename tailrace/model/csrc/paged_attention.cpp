// Causal attention on the CPU read straight from the paged KV cache, for bfloat16 and float32.
//
// Each query row of each head is one fixed computation over its sequence's positions 0..p in
// order: scores as float32 dot products (16 lanes, then the same reduction tree every time), a
// float32 softmax, the values summed into float32 in position order. No step of it depends on the
// other rows, the batch, how a prompt was chunked or the thread count, so a position's output has
// the same bits in a prefill, in a chunk after cached tokens and in any decode batch: what the
// engine's exactness needs, and what CPU SDPA (blocked by query rows and padded keys) does not give.
// Reading the pages in place also means no second copy of the K/V, and no per-layer matmul calls
// (about 50 us each at one row in oneDNN). The query heads that share a KV head run together,
// each key and value loaded once for all of them, and with enough rows a task takes a row's every
// KV head, so the cache lines of a position are used by the task that loads them: the SmolLM2
// shape's 30 layers at 32 rows of 256 positions took 19 ms against 29-31 ms head by head
// (bench/attention_decode.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

#include <cmath>
#include <cstdint>
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

// G query heads from `head` on, all reading KV head `kv_head`, of one query row that sees
// positions 0..last of sequence `seq`. Each key and value is read once for the G heads; each
// head's arithmetic is its own, in the same order whatever G or the batch.
// D: the head's vectors of 16 when known at compile time (the loops over them unroll and the
// accumulators stay in registers), 0 to read it from p.dim.
template <typename T, int G, int D>
void attend_group(const PagedAttention<T>& p, int64_t row, int64_t head, int64_t kv_head, int64_t seq, int64_t last,
                  std::vector<float>& scores) {
    const int64_t n = last + 1, dim = D > 0 ? D * kLanes : p.dim, vecs = D > 0 ? D : dim / kLanes;
    const int64_t padded = ((n + kLanes - 1) / kLanes) * kLanes;
    const Rows<T> rows{p, p.tables + seq * p.table_seq_stride};
    scores.resize(G * padded);
    __m512 q[G][16];  // dim <= 256
    for (int g = 0; g < G; ++g) {
        const T* q_row = p.q + row * p.q_stride + (head + g) * dim;
        for (int64_t i = 0; i < vecs; ++i)
            q[g][i] = load16(q_row + i * kLanes);
    }
    const __m512 scale = _mm512_set1_ps(p.scale);
    int64_t page_rows[16];
    __m512 best[G];
    for (int g = 0; g < G; ++g)
        best[g] = _mm512_set1_ps(-INFINITY);
    __m512 dots[G][16];
    for (int64_t base = 0; base < n; base += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - base);
        rows.fill(base, count, page_rows);
        for (int64_t t = 0; t < kLanes; ++t) {
            if (t >= count) {
                for (int g = 0; g < G; ++g)
                    dots[g][t] = _mm512_setzero_ps();
                continue;
            }
            const T* key = p.k + (page_rows[t] * p.kv_heads + kv_head) * dim;
            __m512 k[16];
            for (int64_t i = 0; i < vecs; ++i)
                k[i] = load16(key + i * kLanes);
            for (int g = 0; g < G; ++g) {
                __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
                for (int64_t i = 1; i < vecs; ++i)
                    acc = _mm512_fmadd_ps(q[g][i], k[i], acc);
                dots[g][t] = acc;
            }
        }
        const __mmask16 live = lanes(count);
        for (int g = 0; g < G; ++g) {
            const __m512 s = _mm512_mul_ps(sum_lanes16(dots[g]), scale);
            _mm512_storeu_ps(scores.data() + g * padded + base, s);
            best[g] = _mm512_mask_max_ps(best[g], live, best[g], s);
        }
    }
    __m512 inverse[G];
    for (int g = 0; g < G; ++g) {
        float* head_scores = scores.data() + g * padded;
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(best[g]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t base = 0; base < n; base += kLanes) {
            const __mmask16 live = lanes(n - base);
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(head_scores + base), max)));
            _mm512_storeu_ps(head_scores + base, e);
            total = _mm512_add_ps(total, e);
        }
        inverse[g] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    }
    __m512 acc[G][16];
    for (int g = 0; g < G; ++g)
        for (int64_t i = 0; i < vecs; ++i)
            acc[g][i] = _mm512_setzero_ps();
    for (int64_t base = 0; base < n; base += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - base);
        rows.fill(base, count, page_rows);
        for (int64_t t = 0; t < count; ++t) {
            const T* value = p.v + (page_rows[t] * p.kv_heads + kv_head) * dim;
            __m512 weight[G];
            for (int g = 0; g < G; ++g)
                weight[g] = _mm512_set1_ps(scores[g * padded + base + t]);
            for (int64_t i = 0; i < vecs; ++i) {
                const __m512 v = load16(value + i * kLanes);
                for (int g = 0; g < G; ++g)
                    acc[g][i] = _mm512_fmadd_ps(weight[g], v, acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        T* out = p.out + (row * p.heads + head + g) * dim;
        for (int64_t i = 0; i < vecs; ++i)
            store16(out + i * kLanes, _mm512_mul_ps(acc[g][i], inverse[g]));
    }
}

constexpr int64_t kMaxGroup = 8;
constexpr int64_t kRowsPerThread = 4;  // rows a thread needs before a task takes a whole row  // query heads done together: their queries stay in registers

template <typename T, int D>
void attend_some(const PagedAttention<T>& p, int64_t count, int64_t row, int64_t head, int64_t kv_head, int64_t seq,
                 int64_t last, std::vector<float>& scores) {
    switch (count) {
        case 1: return attend_group<T, 1, D>(p, row, head, kv_head, seq, last, scores);
        case 2: return attend_group<T, 2, D>(p, row, head, kv_head, seq, last, scores);
        case 3: return attend_group<T, 3, D>(p, row, head, kv_head, seq, last, scores);
        case 4: return attend_group<T, 4, D>(p, row, head, kv_head, seq, last, scores);
        case 5: return attend_group<T, 5, D>(p, row, head, kv_head, seq, last, scores);
        case 6: return attend_group<T, 6, D>(p, row, head, kv_head, seq, last, scores);
        case 7: return attend_group<T, 7, D>(p, row, head, kv_head, seq, last, scores);
        default: return attend_group<T, 8, D>(p, row, head, kv_head, seq, last, scores);
    }
}

// Every query head of KV head `kv_head` for one row, up to kMaxGroup at a time; head_dim 32, 64
// and 128 (the embedded model's and the common ones) compiled for their size.
template <typename T>
void attend_heads(const PagedAttention<T>& p, int64_t row, int64_t kv_head, int64_t seq, int64_t last,
                  std::vector<float>& scores) {
    const int64_t group = p.heads / p.kv_heads;
    for (int64_t done = 0; done < group; done += kMaxGroup) {
        const int64_t head = kv_head * group + done, count = std::min(kMaxGroup, group - done);
        if (p.dim == 32)
            attend_some<T, 2>(p, count, row, head, kv_head, seq, last, scores);
        else if (p.dim == 64)
            attend_some<T, 4>(p, count, row, head, kv_head, seq, last, scores);
        else if (p.dim == 128)
            attend_some<T, 8>(p, count, row, head, kv_head, seq, last, scores);
        else
            attend_some<T, 0>(p, count, row, head, kv_head, seq, last, scores);
    }
}

// q [T, H, D]; k_pages, v_pages [P, kvH, D]; query_start_loc [>= B + 1], seq_lens [>= B] (int32);
// block_tables [B', max_blocks] int32, any strides. Rows outside every sequence are zero.
torch::Tensor paged_attention(const torch::Tensor& q_any, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                              const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                              const torch::Tensor& block_tables, int64_t block_size, int64_t num_seqs, double scale) {
    // q may be a view of rows of the fused q/k/v projection: each row's heads contiguous is enough
    const bool rows_packed = q_any.dim() == 3 && q_any.stride(2) == 1 && q_any.stride(1) == q_any.size(2);
    const torch::Tensor q = rows_packed ? q_any : q_any.contiguous();
    TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 3 && k_pages.is_contiguous() && v_pages.is_contiguous(),
                "q [T, H, D] and contiguous pages [P, kvH, D]");
    TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() && q.scalar_type() == v_pages.scalar_type(),
                "q and the pages must share a dtype");
    const int64_t dim = q.size(2);
    TORCH_CHECK(dim % kLanes == 0 && dim <= 256, "head_dim must be a multiple of 16, at most 256");
    TORCH_CHECK(q.size(1) % k_pages.size(1) == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                block_tables.scalar_type() == torch::kInt32, "metadata must be int32");
    const tailrace::QueryRows rows = tailrace::query_rows(query_start_loc.data_ptr<int32_t>(),
                                                          seq_lens.data_ptr<int32_t>(), num_seqs, q.size(0));
    torch::Tensor out = torch::empty(q.sizes(), q.options());
    tailrace::with_element_type(q.scalar_type(), "paged_attention", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        PagedAttention<T> p{q.data_ptr<T>(), q.stride(0), k_pages.data_ptr<T>(), v_pages.data_ptr<T>(), out.data_ptr<T>(),
                     block_tables.data_ptr<int32_t>(), block_tables.stride(0), block_tables.stride(1), block_size,
                     q.size(1), k_pages.size(1), dim, static_cast<float>(scale)};
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
    // An item is a row's KV heads, all of them where there are rows enough (a position's K and V
    // rows hold every KV head side by side, and one task reading them all uses the lines it
    // loads), one otherwise, so a lone decode row still uses every thread; a head's arithmetic is
    // the same either way. A prefill's later rows see more keys, so the threads take items one at
    // a time (parallel.h), the last rows first: the longest go out while there are others left to
    // even the threads out (contiguous halves measured 1:3 apart at 128 rows).
    const int64_t threads = at::get_num_threads(), num_rows = static_cast<int64_t>(rows.seq.size());
    const int64_t heads_per_item = num_rows >= kRowsPerThread * threads ? p.kv_heads : 1;
    const int64_t items_per_row = p.kv_heads / heads_per_item, items = num_rows * items_per_row;
    const int64_t group = p.heads / p.kv_heads;
    tailrace::parallel_chunks(items, 1, [&](int64_t taken, int64_t) {
        thread_local std::vector<float> scores;
        const int64_t item = items - 1 - taken;
        const int64_t row = item / items_per_row, kv_first = item % items_per_row * heads_per_item;
        for (int64_t kv_head = kv_first; kv_head < kv_first + heads_per_item; ++kv_head) {
            if (rows.seq[row] >= 0)
                attend_heads(p, row, kv_head, rows.seq[row], rows.last[row], scores);
            else
                std::fill_n(p.out + (row * p.heads + kv_head * group) * p.dim, group * p.dim, T(0));
        }
    });
}

template void tailrace::paged_attention(const PagedAttention<float>&, const QueryRows&);
template void tailrace::paged_attention(const PagedAttention<c10::BFloat16>&, const QueryRows&);

void register_paged_attention(pybind11::module& m) {
    m.def("paged_attention", &paged_attention,
          "causal attention of q [T, H, D] over paged K/V through block tables (bfloat16 or float32)");
}
