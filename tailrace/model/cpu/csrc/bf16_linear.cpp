// y = x @ W.T (+ bias) for bfloat16 x and W on AVX512 CPUs, every output row computed the same way
// whatever the batch: the engine's exactness rests on a row's bits not depending on its
// neighbours, the batch size or the thread count.
//
// W is packed once at load as [NV][KP][16][2]: 16 outputs to a vector, K in pairs (vdpbf16ps
// multiplies a pair of bfloat16 and adds both products to a float32 lane). Without AVX512-BF16
// the same sums come from two FMAs a pair (`Emulated`): a product of two bfloat16 is exact in
// float32, so each FMA rounds once, as the instruction does (which also flushes denormals to zero;
// these FMAs keep them, so the two paths' bits may differ there and only there). Bfloat16 weights
// stream half the bytes of float32 ones, which is what a decode step waits on. Each output lane
// owns one float32 accumulator that runs over the pairs in order 0..KP-1, so the tiling (rows per
// tile, vectors per tile, K blocks, threads splitting the vectors) never changes a result. K blocks
// only park the accumulators in float32 between blocks, which is exact.
//
// The same tiles take float32 x and W (`Float32`, f32_linear): a float32 model's projections,
// packed as [NV][KP][2][16], one FMA a value and nothing to widen; a tied model's embedding lookups
// read their rows out of its packed head (one table held, not two; bf16_linear.py PackedEmbedding).
//
// Why not oneDNN: this one measured 0.80-0.99x oneDNN's packed bfloat16 time on the SmolLM2-135M
// shape's projections at 1-128 rows and 2 threads, most at 8 rows (bench/bf16_linear_ab.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace {

using tailrace::kLanes;  // outputs per vector
using tailrace::lanes;

constexpr int64_t kWideFrom = 8;     // rows from which the FMA pairs take wide tiles (see bf16_linear)
#ifdef __AVX512F__
// Tiles, rows x vectors, for 32 registers of 16 lanes (see bf16_linear).
constexpr int kTileRows = 4, kTileVectors = 4, kLoneVectors = 8, kWideRows = 12, kWideVectors = 2;
#else
// The AVX2 build (avx2.h): 16 registers of 8 lanes, a vector two of them. 6 rows x 1 vector keeps
// the 12 accumulators, one step's weight vector (2) and a broadcast input (1) in registers, where
// the AVX-512 tiles spill; and it is faster than 4 rows taking both of a pair's weight vectors at
// once (bench/bf16_linear_ab.py on the Gemma-3-1B shape's projections).
constexpr int kTileRows = 6, kTileVectors = 1, kLoneVectors = 4, kWideRows = 6, kWideVectors = 1;
#endif
constexpr int64_t kBlockPairs = 256; // K pairs per block: a tile's weights (64 KB) stay in L2
constexpr int64_t kWidenGrain = 1024;  // vectors of x a thread widens at least (16k values)

struct Problem {
    const uint16_t* x;   // [M][K] bfloat16, for `Native`
    const float* xf;     // [M][K] float32: x widened (`Emulated`) or as given (`Float32`)
    const void* w;       // [NV][KP][32] of the policy's W
    const float* bias;   // [NV * 16] or nullptr
    void* y;             // [M][N] of the policy's Y
    int64_t M, K, N, KP, NV;
};

// A Dot adds a K pair's products to each output lane in `kPhases` steps: per step one weight
// vector (Weights) and one broadcast input (In) a row. Taking a tile's rows step by step keeps one
// step's weights in registers instead of all of them, so more rows fit in a tile; each lane still
// adds its products in the same order, whatever the tile.

// vdpbf16ps: lane l += x[2l + 1] * w[2l + 1], then += x[2l] * w[2l] (the instruction's order).
struct Native {
    using W = uint16_t;
    using Y = uint16_t;
    using In = __m512i;       // one input pair, broadcast
    using Weights = __m512i;  // 16 weight pairs
    static constexpr int kPhases = 1;
    static In input(const Problem& p, int64_t row, int64_t kp, int) {
        return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p.x + row * p.K + 2 * kp));
    }
    static Weights weights(const uint16_t* w, int) { return _mm512_loadu_si512(w); }
    static __m512 dot(__m512 acc, In a, Weights w) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w); }
    static void store(uint16_t* y, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(y, m, tailrace::to_bf16_bits<true>(v)); }
};

// The same sums from two FMAs, the pair's high value first. Compute-bound tiles (prefill, large
// batches) are limited by the two vector ports the FMAs share with the bfloat16 widening, so the
// inputs are widened once per call (p.xf, broadcast straight from memory) and each weight vector
// once per tile step.
struct Emulated {
    using W = uint16_t;
    using Y = uint16_t;
    using In = __m512;
    using Weights = __m512;
    static constexpr int kPhases = 2;
    static In input(const Problem& p, int64_t row, int64_t kp, int phase) {
        return _mm512_set1_ps(p.xf[row * p.K + 2 * kp + 1 - phase]);
    }
    static Weights weights(const uint16_t* w, int phase) {
        const __m512i pairs = _mm512_loadu_si512(w);
        return _mm512_castsi512_ps(phase == 0 ? _mm512_and_si512(pairs, _mm512_set1_epi32(-65536))
                                              : _mm512_slli_epi32(pairs, 16));
    }
    static __m512 dot(__m512 acc, In a, Weights w) { return _mm512_fmadd_ps(a, w, acc); }
    static void store(uint16_t* y, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(y, m, tailrace::to_bf16_bits<false>(v)); }
};

// float32 x and W: a pair's two k are two runs of 16 lanes, the even one first, one FMA each, so
// each output sums its K products in order.
struct Float32 {
    using W = float;
    using Y = float;
    using In = __m512;
    using Weights = __m512;
    static constexpr int kPhases = 2;
    static In input(const Problem& p, int64_t row, int64_t kp, int phase) {
        return _mm512_set1_ps(p.xf[row * p.K + 2 * kp + phase]);
    }
    static Weights weights(const float* w, int phase) { return _mm512_loadu_ps(w + phase * kLanes); }
    static __m512 dot(__m512 acc, In a, Weights w) { return _mm512_fmadd_ps(a, w, acc); }
    static void store(float* y, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(y, m, v); }
};

// Rows m0..m0+MT-1 against vectors v0..v0+NT-1 over pairs [kp0, kp1); `part` holds the rows'
// float32 sums between K blocks, V vectors a row.
template <typename Dot, int V, int MT, int NT>
void tile(const Problem& p, int64_t m0, int64_t v0, int64_t kp0, int64_t kp1, float* part, bool first,
          bool last) {
    __m512 acc[MT][NT];
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (i * V + j) * kLanes);
    const typename Dot::W* w = static_cast<const typename Dot::W*>(p.w) + v0 * p.KP * 2 * kLanes;
    for (int64_t kp = kp0; kp < kp1; ++kp) {
        for (int phase = 0; phase < Dot::kPhases; ++phase) {
            typename Dot::Weights wv[NT];
            for (int j = 0; j < NT; ++j)
                wv[j] = Dot::weights(w + (j * p.KP + kp) * 2 * kLanes, phase);
            for (int i = 0; i < MT; ++i) {
                const typename Dot::In a = Dot::input(p, m0 + i, kp, phase);
                for (int j = 0; j < NT; ++j)
                    acc[i][j] = Dot::dot(acc[i][j], a, wv[j]);
            }
        }
    }
    if (!last) {
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NT; ++j)
                _mm512_storeu_ps(part + (i * V + j) * kLanes, acc[i][j]);
        return;
    }
    for (int j = 0; j < NT; ++j) {
        const int64_t n0 = (v0 + j) * kLanes;
        const __mmask16 mask = lanes(p.N - n0);
        const __m512 b = p.bias ? _mm512_loadu_ps(p.bias + n0) : _mm512_setzero_ps();
        for (int i = 0; i < MT; ++i)
            Dot::store(static_cast<typename Dot::Y*>(p.y) + (m0 + i) * p.N + n0, mask, _mm512_add_ps(acc[i][j], b));
    }
}

// One unit of work: vectors [v_begin, v_end) in groups of up to V, rows [m_begin, m_end) in tiles
// of at most R rows, as even as that allows (32 rows in tiles of 6 are 5 and 6 rows, not five of 6
// and one of 2, which would load and widen its weights for 2 rows' FMAs). K is the middle loop so
// that a group's block of weights is read from memory once and reused by every row tile from cache.
template <typename Dot, int R, int V>
void run_groups(const Problem& p, int64_t v_begin, int64_t v_end, int64_t m_begin, int64_t m_end) {
    const int64_t rows = m_end - m_begin, row_tiles = (rows + R - 1) / R;
    const int64_t blocks = (p.KP + kBlockPairs - 1) / kBlockPairs;
    // the tiles' float32 sums between K blocks, kept by the thread from unit to unit
    thread_local std::vector<float> parts;
    if (blocks > 1 && static_cast<int64_t>(parts.size()) < row_tiles * R * V * kLanes)
        parts.resize(row_tiles * R * V * kLanes);
    for (int64_t v0 = v_begin; v0 < v_end; v0 += V) {
        const int64_t nt = std::min<int64_t>(V, v_end - v0);
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t kp0 = b * kBlockPairs;
            const int64_t kp1 = std::min(p.KP, kp0 + kBlockPairs);
            for (int64_t t = 0; t < row_tiles; ++t) {
                const int64_t m0 = m_begin + t * rows / row_tiles;
                float* part = blocks > 1 ? parts.data() + t * R * V * kLanes : nullptr;
                tailrace::up_to<R>(m_begin + (t + 1) * rows / row_tiles - m0, [&](auto mt) {
                    tailrace::up_to<V>(nt, [&](auto vt) {
                        tile<Dot, V, decltype(mt)::value, decltype(vt)::value>(p, m0, v0, kp0, kp1, part, b == 0,
                                                                               b == blocks - 1);
                    });
                });
            }
        }
    }
}

// x in float32 for the FMA pairs (exact), the vectors split over the threads: widened by the
// calling thread alone, it would be a serial part of every prefill while the other threads wait.
std::unique_ptr<float[]> widened(const c10::BFloat16* x, int64_t count) {
    std::unique_ptr<float[]> out(new float[count]);
    at::parallel_for(0, (count + kLanes - 1) / kLanes, kWidenGrain, [&](int64_t v0, int64_t v1) {
        for (int64_t i = v0 * kLanes; i < std::min(count, v1 * kLanes); i += kLanes) {
            const __mmask16 m = lanes(count - i);
            tailrace::store16(out.get() + i, tailrace::load16(x + i, m), m);
        }
    });
    return out;
}

// y [..., n] = x [..., K] @ W.T (+ bias): bfloat16 or float32 x and packed weights of x's dtype.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t n) {
    TORCH_CHECK((x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat) &&
                    packed.scalar_type() == x.scalar_type(),
                "the linear kernel takes bfloat16 or float32 input and packed weights of the same dtype");
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kLanes && packed.is_contiguous(),
                "packed weights must be [NV, K/2, 32]");
    const int64_t K = x.size(-1);
    TORCH_CHECK(K == 2 * packed.size(1), "input width ", K, " does not match the packed weights' ", 2 * packed.size(1));
    const torch::Tensor rows = x.reshape({-1, K}).contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    torch::Tensor y = torch::empty(shape, x.options());
    const float* b = bias ? bias->data_ptr<float>() : nullptr;
    if (x.scalar_type() == torch::kFloat)
        tailrace::f32_linear(rows.data_ptr<float>(), packed.data_ptr<float>(), packed.size(0), b, y.data_ptr<float>(),
                             rows.size(0), K, n);
    else
        tailrace::bf16_linear(rows.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), packed.size(0), b,
                              y.data_ptr<c10::BFloat16>(), rows.size(0), K, n);
    return y;
}

}  // namespace

namespace {
// Set before any kernel runs and never after, so plain bools suffice.
bool g_amx_allowed = true;
bool g_bf16_dot_allowed = true;
}  // namespace

void tailrace::configure(bool amx, bool bf16_dot) {
    g_amx_allowed = amx;
    g_bf16_dot_allowed = bf16_dot;
}

bool tailrace::amx_allowed() { return g_amx_allowed; }

// AVX512-BF16, unless configure() asked for the FMA pairs (to test them where it is).
bool tailrace::native_bf16_dot() {
    static const bool has = __builtin_cpu_supports("avx512bf16");
    return has && g_bf16_dot_allowed;
}

void tailrace::bf16_linear(const c10::BFloat16* x, const c10::BFloat16* packed, int64_t vectors, const float* bias,
                           c10::BFloat16* y, int64_t rows, int64_t k, int64_t n) {
    if (rows == 0 || bf16_linear_amx(x, packed, vectors, bias, y, rows, k, n))
        return;
    const bool native = tailrace::native_bf16_dot();
    const std::unique_ptr<float[]> xf = native ? nullptr : widened(x, rows * k);
    const Problem p{reinterpret_cast<const uint16_t*>(x), xf.get(), packed, bias, y, rows, k, n, k / 2, vectors};
    // Tiles on AVX-512 (the AVX2 build's are smaller, see kTileRows): 4 rows x 4 vectors (16
    // accumulators, each weight load serving 4 rows), but where the FMA pairs widen every weight vector, 12 rows x 2 vectors (24 accumulators) from 8 rows on:
    // the widening is then 4 of 52 vector instructions a step instead of 8 of 40. Same-process A/B
    // on SmolLM2's projections (bench/bf16_linear_ab.py) is faster at 8 rows and more, and
    // beats 8 x 2 and 16 x 1 tiles. A lone row with AVX512-BF16 reads 8 vectors at a time: 8 runs
    // of weights in flight instead of 4 keep the memory busier for a one-row decode step
    // (bench/decode_step.py), where software prefetching does not.
    const bool wide = !native && p.M >= kWideFrom;
    const int64_t row_tile = wide ? kWideRows : kTileRows;
    tailrace::parallel_vectors(p.NV, wide ? kWideVectors : kTileVectors, p.M, row_tile,
                               [&](int64_t v0, int64_t v1, int64_t m0, int64_t m1) {
        if (native && p.M == 1)
            run_groups<Native, 1, kLoneVectors>(p, v0, v1, m0, m1);
        else if (native)
            run_groups<Native, kTileRows, kTileVectors>(p, v0, v1, m0, m1);
        else if (wide)
            run_groups<Emulated, kWideRows, kWideVectors>(p, v0, v1, m0, m1);
        else
            run_groups<Emulated, kTileRows, kTileVectors>(p, v0, v1, m0, m1);
    });
}

// float32 x through float32 weights packed as [NV][KP][2][16] (see Float32).
void tailrace::f32_linear(const float* x, const float* packed, int64_t vectors, const float* bias, float* y,
                          int64_t rows, int64_t k, int64_t n) {
    if (rows == 0)
        return;
    const Problem p{nullptr, x, packed, bias, y, rows, k, n, k / 2, vectors};
    // A lone row reads kLoneVectors at a time, as bfloat16's does; on AVX-512 at 4 x 4 a step's 8 weight loads
    // and 8 broadcasts feed 32 FMAs.
    tailrace::parallel_vectors(p.NV, kTileVectors, p.M, kTileRows, [&](int64_t v0, int64_t v1, int64_t m0, int64_t m1) {
        if (p.M == 1)
            run_groups<Float32, 1, kLoneVectors>(p, v0, v1, m0, m1);
        else
            run_groups<Float32, kTileRows, kTileVectors>(p, v0, v1, m0, m1);
    });
}

void register_bf16_linear(pybind11::module& m) {
    m.def("linear", &linear, "y = x @ W.T + bias over weights packed as [NV, K/2, 32] (bfloat16 or float32, AVX512)");
    m.def("configure", &tailrace::configure, pybind11::arg("amx"), pybind11::arg("bf16_dot"),
          "the process-wide switches: AMX tiles and AVX512-BF16's dot product allowed where the CPU has them");
    m.def("amx_active", &tailrace::amx_active, "AMX tiles serve bfloat16 projections here");
    m.def("bf16_dot_active", &tailrace::native_bf16_dot, "AVX512-BF16's dot product serves bfloat16 pairs here");
}
