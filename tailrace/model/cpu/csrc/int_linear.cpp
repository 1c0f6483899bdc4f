// y = x @ W.T (+ bias) for weights held as integer codes with float16 scales, on CPUs with
// AVX512-VNNI: tailrace's int8 and int4 projections, and GGUF's Q8_0, Q4_0, Q4_1, Q4_K and MXFP4
// blocks taken as they are.
//
// A weight is w = c * d + z, c an int8 code (or a 4-bit one in 0..15), d and z float16, either one
// d per output row (int8 per channel, z = 0) or one (d, z) per output and block of 32 inputs (the
// GGUF blocks). The activations go to integer codes per block of 32 inputs, with a float32 scale
// s = max|x| / C for the block, and an integer dot product adds codes times codes into int32 lanes,
// exactly:
// - against int8 weights, int16 activations (C = 32767, a finer grid than bfloat16's 8 bits
//   wherever |x| is within a factor 128 of the block's largest) through vpdpwssd, 2 products a lane;
// - against int4 weights, int8 activations (C = 127, as llama.cpp's Q8_0 activations for its 4-bit
//   blocks) through vpdpbusd, 4 products a lane and no widening of the codes: a product of 4 rows
//   1.6x faster at the same memory traffic on a Zen 4 (`bench/decode_step.py --quantization int4
//   --batch 1 8 32` times the steps), where the 4-bit weights are still what the result loses
//   precision to (`bench/quality.py` shows it).
// Each block's integer sum goes to float32 once:
//     grouped: acc += (isum * s) * d  (+ z * s * sum(x codes))     per row: acc += isum * s; y = acc * d
// Every output's float32 accumulator runs over the blocks in order, so a row's bits depend neither
// on the other rows, nor on the tiling, nor on the thread count (the engine's exactness rests on it).
//
// Layouts, packed once at load (tailrace/model/int_linear.py): outputs 16 to a vector, vectors
// padded to a multiple of kVectors; int8 codes [NV][K/2][32] as bf16_linear packs its weights (the
// pair (k, k+1) of output lane l at bytes 2l, 2l+1); int4 codes [NV][K/8][64] bytes, lane l's 4
// bytes of a run holding its inputs 8r..8r+3 in the low nibbles and 8r+4..8r+7 in the high ones;
// d and z [NV / 4][G][4][16] with G = 1 (per row) or K / 32: a tile's 4 vectors side by side, group
// by group, so that a tile reads its scales as one run (see scale_at).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace {

using tailrace::kLanes;
using tailrace::lanes;

constexpr int64_t kBlock = 32;             // inputs per activation scale and per weight group
constexpr int64_t kVectors = 4;            // vectors a scale run holds (see scale_at), and a share of the work
constexpr int64_t kRows = 4;               // rows per tile: each code load serves this many rows
#ifdef __AVX512F__
constexpr int64_t kTileVectors = 4;        // vectors per tile: a tile's rows reuse each code load 4 ways
constexpr int64_t kOneRowVectors = 8;      // vectors per tile of a lone row (see run)
#else
// AVX2 has 16 registers, not 32: a tile of 4 rows by 4 vectors wanted 64 of them for its integer
// and float sums alone. 4 rows by 1 vector with int4_block_sums took a batch's rows through
// Gemma-3-1B's int4 projections in 0.65x of the time on a Zen 1 (`bench/decode_step.py --model
// bench/.shapes/gemma-3-1b --quantization int4 --batch 1 8 32` times the steps).
constexpr int64_t kTileVectors = 1;
constexpr int64_t kOneRowVectors = 4;
#endif
constexpr int64_t kChunkBlocks = 16;       // blocks per pass over the row tiles: the codes stay in L2

// E2M1: MXFP4's blocks (gpt-oss's experts), grouped scales whose 4-bit codes index the E2M1 values
// (see kE2M1Codes) rather than count up from zero, the zero point implied by the scale.
enum class Scales { PerRow, Grouped, GroupedWithZero, E2M1 };

// An E2M1 code's value times 2 (a whole number, -12..12), plus 12: the unsigned bytes the 4-bit
// kernels multiply, at most 24, so that a weight is (byte - 12) * d with d half the block's E8M0
// power of two, a zero point of -12 d. The products stay exact: 24 x 127 per product, and on AVX2
// int4_block_sums widens its int16 pairs twice a block rather than once.
alignas(16) constexpr uint8_t kE2M1Codes[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr float kE2M1Offset = 12.0f;

// The activations' codes: int16 against int8 weights, int8 against int4 ones (vpdpbusd multiplies
// unsigned bytes, the 4-bit codes, by signed ones).
template <int Bits>
using ActivationCode = std::conditional_t<Bits == 8, int16_t, int8_t>;

// The activations as codes: x ~ s * code per block.
struct Codes {
    const void* codes;     // [M][K] ActivationCode
    const float* scale;    // [M][KB]
    const float* sum;      // [M][KB]: s * (the block's codes summed), what a zero point multiplies
};

struct Problem {
    Codes x;
    const uint8_t* w;
    const at::Half* d;     // [NV][G][16]
    const at::Half* z;     // [NV][G][16] or nullptr
    const float* bias;     // [N] or nullptr
    int64_t M, K, N, KB, NV, G;
    bool e2m1;             // 4-bit codes of E2M1 values (Scales::E2M1)
};

template <typename C, typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, C* codes, float* scale, float* sum) {
    constexpr float kCodeMax = std::numeric_limits<C>::max();
    using tailrace::load16;
    const int64_t KB = K / kBlock;
    at::parallel_for(0, M * KB, 64, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const __m512 lo = load16(x + b * kBlock), hi = load16(x + b * kBlock + kLanes);
            const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            if (largest == 0.0f || !std::isfinite(largest)) {
                // all zero, or inf/nan that no scale holds: NaN out, as a float matmul would give
                const float s = largest == 0.0f ? 0.0f : std::numeric_limits<float>::quiet_NaN();
                std::fill_n(codes + b * kBlock, kBlock, C{0});  // 32 codes: 64 bytes of int16, 32 of int8
                scale[b] = s;
                sum[b] = s;
                continue;
            }
            const __m512 inverse = _mm512_set1_ps(kCodeMax / largest);
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
            if constexpr (sizeof(C) == 2) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kBlock), _mm512_cvtepi32_epi16(qlo));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kBlock + kLanes), _mm512_cvtepi32_epi16(qhi));
            } else {
                _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock), _mm512_cvtepi32_epi8(qlo));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock + kLanes), _mm512_cvtepi32_epi8(qhi));
            }
            scale[b] = largest / kCodeMax;
            sum[b] = scale[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
        }
    });
}

// Bytes of codes per vector: 16 lanes of K codes, a byte each (int8) or half a byte (int4).
template <int Bits>
inline int64_t vector_bytes(const Problem& p) {
    return kLanes * p.K * Bits / 8;
}

// A code load: 32 bytes of int8 codes (16 lanes x a pair of inputs), widened to int16; or 64 bytes
// of int4 codes, 16 lanes x 8 inputs, lane l's 4 bytes holding inputs 0..3 in their low nibbles
// and 4..7 in their high ones, out[0] and out[1] those nibbles as bytes (E2M1: the bytes they
// stand for, kE2M1Codes).
template <int Bits>
constexpr int64_t kLoadBytes = Bits == 8 ? 32 : 64;
template <int Bits>
constexpr int64_t kLoadInputs = Bits == 8 ? 2 : 8;

template <int Bits, bool E2M1>
inline void load_codes(const uint8_t* at, __m512i* out) {
    if constexpr (Bits == 8) {
        out[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    } else {
        const __m512i bytes = _mm512_loadu_si512(at), low = _mm512_set1_epi8(0x0F);
        out[0] = _mm512_and_si512(bytes, low);
        out[1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        if constexpr (E2M1) {
            const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
            out[0] = _mm512_shuffle_epi8(table, out[0]);
            out[1] = _mm512_shuffle_epi8(table, out[1]);
        }
    }
}

// A row's products with one load's codes, added into int32 lanes exactly: int16 pairs (vpdpwssd),
// or the 4-bit codes as unsigned bytes by the activations' signed ones in fours (vpdpbusd).
template <int Bits>
inline __m512i dot(__m512i sum, const __m512i* w, const ActivationCode<Bits>* x) {
    const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
    if constexpr (Bits == 8)
        return _mm512_dpwssd_epi32(sum, a, w[0]);
    else
        return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, w[0], a),
                                   w[1], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + 4)));
}

// A tile reads its vectors' codes as up to 4 runs side by side (a lone row's tile 8), each 16 K
// (int8) or 8 K (int4) bytes long (4.5-24 KB in SmolLM2's layers), short for the hardware's
// stream prefetch to ramp up on. Asking for each run's line 1 KB ahead (past a run's end: the
// next vector's, the next tile's for the last) read the 0.2-1.8 MB projections of a decode step
// 2-10% faster on an Ice Lake (a same-process A/B of both builds at one row). A lone row's tiles
// (see run) ask for the line 2 KB ahead into L2 alone: 0.94x of their time without (int4; int8
// 0.96-0.98x), where the line 1 KB ahead into L1 made them 5% slower (a Zen 4; `bench/decode_step.py
// --quantization int4 --batch 1 --prefill 0` shows the one-row step against its floor).
constexpr int64_t kPrefetch = 1024;
constexpr int64_t kOneRowPrefetch = 2048;

// Where vector v's 16 scales (or zeros) of group b start. A tile's scales in one run, prefetched
// 4 groups ahead, read a one-row int4 step 7-8% faster than 8 runs of 9-48 lines each (a vector's
// d and z apart), too short for the hardware to prefetch (`bench/decode_step.py --quantization int4
// --batch 1 --prefill 0` times the step).
inline int64_t scale_at(const Problem& p, int64_t v, int64_t b) {
    return (((v / kVectors) * p.G + b) * kVectors + v % kVectors) * kLanes;
}
constexpr int64_t kScalePrefetch = 4;

inline __m512 half16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

template <bool OneRow>
inline void prefetch_codes(const uint8_t* at) {
    if constexpr (OneRow)
        _mm_prefetch(reinterpret_cast<const char*>(at) + kOneRowPrefetch, _MM_HINT_T1);
    else
        _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetch, _MM_HINT_T0);
}

#ifndef __AVX512F__
// AVX2's int4 block: vpdpbusd is three instructions here (maddubs, madd, add), so the products go
// into int16 pairs over the whole block and widen to int32 once, with the same sums. Exact: a
// pair's 16 products over the block are each at most 15 x 127, 30480 in all, within int16. E2M1's
// bytes reach 24, so its pairs widen every half block (8 products, at most 24384).
template <bool OneRow, bool E2M1, int MT, int NT>
inline void int4_block_sums(const uint8_t* codes, int64_t stride, const int8_t* x, int64_t K,
                            __m512i (&isum)[MT][NT]) {
    constexpr int64_t kSteps = kBlock / kLoadInputs<4>, kWiden = E2M1 ? kSteps / 2 : kSteps;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            isum[i][j] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t first = 0; first < kSteps; first += kWiden) {
        __m256i pairs[MT][NT][2];
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NT; ++j)
                pairs[i][j][0] = pairs[i][j][1] = _mm256_setzero_si256();
        // Not unrolled: unrolled, GCC computed all of the block's products before adding any, and
        // spilled them to the stack.
#pragma GCC unroll 1
        for (int64_t step = first; step < first + kWiden; ++step)
            for (int j = 0; j < NT; ++j) {
                const uint8_t* at = codes + j * stride + step * kLoadBytes<4>;
                prefetch_codes<OneRow>(at);
                __m256i w[2][2];  // [lanes 0-7 or 8-15][inputs 0-3 or 4-7]
                for (int h = 0; h < 2; ++h) {
                    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
                    w[h][0] = _mm256_and_si256(bytes, low);
                    w[h][1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                    if constexpr (E2M1) {
                        w[h][0] = _mm256_shuffle_epi8(table, w[h][0]);
                        w[h][1] = _mm256_shuffle_epi8(table, w[h][1]);
                    }
                }
                for (int i = 0; i < MT; ++i) {
                    const int8_t* row = x + i * K + step * kLoadInputs<4>;
                    const __m256i a0 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(row));
                    const __m256i a1 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(row + 4));
                    for (int h = 0; h < 2; ++h)
                        pairs[i][j][h] = _mm256_add_epi16(
                            pairs[i][j][h],
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[h][0], a0), _mm256_maddubs_epi16(w[h][1], a1)));
                }
            }
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NT; ++j)
                isum[i][j] = {_mm256_add_epi32(isum[i][j].lo, _mm256_madd_epi16(pairs[i][j][0], ones)),
                              _mm256_add_epi32(isum[i][j].hi, _mm256_madd_epi16(pairs[i][j][1], ones))};
    }
}
#endif

// One block's integer sums of MT rows (their codes K apart) by NT vectors (their codes `stride`
// apart): isum[i][j] lane l = the sum of weight code times row code over the block's 32 inputs.
template <int Bits, bool E2M1, bool OneRow, int MT, int NT>
inline void dot_block_sums(const uint8_t* codes, int64_t stride, const ActivationCode<Bits>* x, int64_t K,
                           __m512i (&isum)[MT][NT]) {
    constexpr int64_t kSteps = kBlock / kLoadInputs<Bits>;
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            isum[i][j] = _mm512_setzero_si512();
    for (int64_t step = 0; step < kSteps; ++step) {
        __m512i wv[NT][2];
        for (int j = 0; j < NT; ++j) {
            const uint8_t* at = codes + j * stride + step * kLoadBytes<Bits>;
            load_codes<Bits, E2M1>(at, wv[j]);
            prefetch_codes<OneRow>(at);
        }
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NT; ++j)
                isum[i][j] = dot<Bits>(isum[i][j], wv[j], x + i * K + step * kLoadInputs<Bits>);
    }
}

template <int Bits, bool E2M1, bool OneRow, int MT, int NT>
inline void block_sums(const uint8_t* codes, int64_t stride, const ActivationCode<Bits>* x, int64_t K,
                       __m512i (&isum)[MT][NT]) {
#ifndef __AVX512F__
    if constexpr (Bits == 4)
        int4_block_sums<OneRow, E2M1>(codes, stride, x, K, isum);
    else
#endif
        dot_block_sums<Bits, E2M1, OneRow>(codes, stride, x, K, isum);
}

// Blocks [b0, b1) of rows m0.. (MT of them) against vectors v0..v0+NT-1, added into `part`
// [MT][V][16]. The pointers are set once and the float sums stay in registers over the blocks:
// with a code address and the sums' loads and stores worked out per vector and block, half of a
// one-row tile's instructions were bookkeeping (`perf annotate` of the tile shows it).
template <int Bits, Scales S, int V, int MT, int NT>
void tile(const Problem& p, int64_t m0, int64_t v0, int64_t b0, int64_t b1, float* part) {
    constexpr int64_t kSteps = kBlock / kLoadInputs<Bits>;
    constexpr bool kOneRow = V == kOneRowVectors;
    const int64_t stride = vector_bytes<Bits>(p);
    const uint8_t* codes = p.w + v0 * stride + b0 * kSteps * kLoadBytes<Bits>;
    const auto* x = static_cast<const ActivationCode<Bits>*>(p.x.codes) + m0 * p.K + b0 * kBlock;
    const float* x_scale = p.x.scale + m0 * p.KB;
    const float* x_sum = p.x.sum + m0 * p.KB;
    __m512 acc[MT][NT];
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            acc[i][j] = _mm512_loadu_ps(part + (i * V + j) * kLanes);
    for (int64_t b = b0; b < b1; ++b, codes += kSteps * kLoadBytes<Bits>, x += kBlock) {
        __m512i isum[MT][NT];
        block_sums<Bits, S == Scales::E2M1, kOneRow, MT, NT>(codes, stride, x, p.K, isum);
        for (int j = 0; j < NT; ++j) {
            __m512 d, z;
            if constexpr (S != Scales::PerRow) {
                const int64_t at = scale_at(p, v0 + j, b), ahead = scale_at(p, v0 + j, b + kScalePrefetch);
                d = half16(p.d + at);
                _mm_prefetch(reinterpret_cast<const char*>(p.d + ahead), _MM_HINT_T0);
                if constexpr (S == Scales::GroupedWithZero) {
                    z = half16(p.z + at);
                    _mm_prefetch(reinterpret_cast<const char*>(p.z + ahead), _MM_HINT_T0);
                } else if constexpr (S == Scales::E2M1) {
                    z = _mm512_mul_ps(d, _mm512_set1_ps(-kE2M1Offset));  // exact: d a power of two
                }
            }
            for (int i = 0; i < MT; ++i) {
                const __m512 f = _mm512_cvtepi32_ps(isum[i][j]);
                const __m512 s = _mm512_set1_ps(x_scale[i * p.KB + b]);
                if constexpr (S == Scales::PerRow) {
                    acc[i][j] = _mm512_fmadd_ps(f, s, acc[i][j]);
                } else {
                    acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(f, s), d, acc[i][j]);
                    if constexpr (S == Scales::GroupedWithZero || S == Scales::E2M1)
                        acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(x_sum[i * p.KB + b]), z, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            _mm512_storeu_ps(part + (i * V + j) * kLanes, acc[i][j]);
}

template <Scales S, int V, typename T>
void store_outputs(const Problem& p, int64_t m0, int64_t mt, int64_t v0, int64_t nt, const float* part, T* y) {
    for (int j = 0; j < nt; ++j) {
        const int64_t n0 = (v0 + j) * kLanes;
        const __mmask16 mask = lanes(p.N - n0);
        const __m512 d = half16(p.d + scale_at(p, v0 + j, 0));
        const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
        for (int i = 0; i < mt; ++i) {
            __m512 out = _mm512_loadu_ps(part + (i * V + j) * kLanes);
            if constexpr (S == Scales::PerRow)
                out = _mm512_mul_ps(out, d);
            tailrace::store16(y + (m0 + i) * p.N + n0, _mm512_add_ps(out, bias), mask);
        }
    }
}

// One unit of work: vectors [v_begin, v_end) in tiles of up to V, rows [m_begin, m_end), R rows a
// tile. The blocks are the middle loop so that a tile's codes are read from memory once a chunk
// and reused by every row tile from cache.
template <int Bits, Scales S, int R, int V, typename T>
void run_tiles(const Problem& p, int64_t v_begin, int64_t v_end, int64_t m_begin, int64_t m_end, T* y) {
    const int64_t row_tiles = (m_end - m_begin + R - 1) / R;
    std::vector<float> parts(row_tiles * R * V * kLanes);
    for (int64_t v0 = v_begin; v0 < v_end; v0 += V) {
        const int64_t nt = std::min<int64_t>(V, v_end - v0);
        std::fill(parts.begin(), parts.end(), 0.0f);
        for (int64_t b0 = 0; b0 < p.KB; b0 += kChunkBlocks)
            for (int64_t r = 0; r < row_tiles; ++r) {
                const int64_t m0 = m_begin + r * R, b1 = std::min(p.KB, b0 + kChunkBlocks);
                float* part = parts.data() + r * R * V * kLanes;
                tailrace::up_to<R>(std::min<int64_t>(R, m_end - m0), [&](auto mt) {
                    tailrace::up_to<V>(nt, [&](auto vt) {
                        tile<Bits, S, V, decltype(mt)::value, decltype(vt)::value>(p, m0, v0, b0, b1, part);
                    });
                });
            }
        for (int64_t r = 0; r < row_tiles; ++r) {
            const int64_t m0 = m_begin + r * R;
            store_outputs<S, V>(p, m0, std::min<int64_t>(R, m_end - m0), v0, nt, parts.data() + r * R * V * kLanes, y);
        }
    }
}

// The vectors that hold outputs and the rows, split over the threads as parallel.h splits a
// projection's. Each output's arithmetic is the same whichever thread computes it. A lone row (a
// decode step's) reads 8 vectors a tile, as bf16_linear does: more runs in flight. SmolLM2's 120
// one-row projections, same-process A/B: 0.87-0.90x of their time at 4 vectors, int4 and int8
// alike (without prefetch; 6 vectors the same, int4 at 12 or 16 0.95-1.04x); whole one-row steps
// with the prefetch above int4 0.86-0.92x, int8 0.83-0.94x (`bench/decode_step.py --quantization
// int4 --batch 1 --prefill 0` shows the one-row step against its floor).
template <int Bits, Scales S, typename T>
void run(const Problem& p, T* y) {
    const int64_t used = (p.N + kLanes - 1) / kLanes;
    tailrace::parallel_vectors(used, kVectors, p.M, kRows, [&](int64_t v0, int64_t v1, int64_t m0, int64_t m1) {
        if (p.M == 1)
            run_tiles<Bits, S, 1, kOneRowVectors>(p, v0, v1, m0, m1, y);
        else
            run_tiles<Bits, S, kRows, kTileVectors>(p, v0, v1, m0, m1, y);
    });
}

template <int Bits, typename T>
void run_bits(const Problem& p, T* y) {
    if constexpr (Bits == 4) {
        if (p.e2m1)
            return run<Bits, Scales::E2M1>(p, y);
    }
    if (p.z != nullptr)
        run<Bits, Scales::GroupedWithZero>(p, y);
    else if (p.G == 1)
        run<Bits, Scales::PerRow>(p, y);  // also where K is one block: the same sums
    else
        run<Bits, Scales::Grouped>(p, y);
}

// Quantizes the rows, then runs the kernel form the weights take.
template <int Bits, typename T>
void int_linear_bits(const T* x, int64_t M, int64_t K, const tailrace::IntWeights& w, T* y) {
    const int64_t KB = K / kBlock;
    std::vector<ActivationCode<Bits>> codes(M * K);
    std::vector<float> scale(M * KB), sum(M * KB);
    quantize_rows(x, M, K, codes.data(), scale.data(), sum.data());
    run_bits<Bits>(Problem{{codes.data(), scale.data(), sum.data()}, w.codes, w.d, w.z, w.bias, M, K, w.n, KB,
                           w.vectors, w.groups, w.e2m1}, y);
}

template <typename T>
void int_linear_rows(const T* x, int64_t M, int64_t K, const tailrace::IntWeights& w, T* y) {
    if (M == 0)
        return;
    if (w.bits == 8)
        int_linear_bits<8>(x, M, K, w, y);
    else
        int_linear_bits<4>(x, M, K, w, y);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                     const c10::optional<torch::Tensor>& z, const c10::optional<torch::Tensor>& bias, int64_t n) {
    const int64_t K = x.size(-1);
    const tailrace::IntWeights w = tailrace::int_weights(codes, d, z ? *z : torch::Tensor(),
                                                         bias ? *bias : torch::Tensor(), K, n);
    const torch::Tensor rows = x.reshape({-1, K}).contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    torch::Tensor y = torch::empty(shape, x.options());
    tailrace::with_element_type(x.scalar_type(), "int_linear", [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        int_linear_rows(rows.data_ptr<T>(), rows.size(0), K, w, y.data_ptr<T>());
    });
    return y;
}

}  // namespace

tailrace::IntWeights tailrace::int_weights(const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& z,
                                           const torch::Tensor& bias, int64_t K, int64_t n) {
    const int bits = codes.scalar_type() == torch::kChar ? 8 : 4;
    const bool e2m1 = codes.scalar_type() == torch::kFloat4_e2m1fn_x2;
    TORCH_CHECK(bits == 8 || e2m1 || codes.scalar_type() == torch::kByte,
                "int_linear codes are int8, uint8 (4-bit pairs) or float4_e2m1fn_x2 (E2M1 pairs)");
    TORCH_CHECK(K % kBlock == 0, "int_linear takes inputs in blocks of ", kBlock, ", not ", K);
    const int64_t load_bytes = bits == 8 ? kLoadBytes<8> : kLoadBytes<4>;
    const int64_t inputs_per_load = bits == 8 ? kLoadInputs<8> : kLoadInputs<4>;
    TORCH_CHECK(codes.dim() == 3 && codes.size(2) == load_bytes && codes.is_contiguous() &&
                    codes.size(0) % kVectors == 0,
                "codes must be [NV, K / 2, 32] (int8) or [NV, K / 8, 64] (int4) with NV a multiple of ", kVectors);
    TORCH_CHECK(codes.size(1) == K / inputs_per_load, "input width ", K, " does not match the codes");
    const int64_t NV = codes.size(0), G = d.size(1);
    TORCH_CHECK(d.scalar_type() == torch::kHalf && d.dim() == 4 && d.size(0) * kVectors == NV &&
                    d.size(2) == kVectors && d.size(3) == kLanes && d.is_contiguous() && (G == 1 || G == K / kBlock),
                "scales must be float16 [NV / 4, 1 or K / 32, 4, 16]");
    TORCH_CHECK(!z.defined() || (G == K / kBlock && z.sizes() == d.sizes() && z.scalar_type() == torch::kHalf &&
                                 z.is_contiguous()),
                "zero points go with grouped scales, in their shape and type");
    TORCH_CHECK(!e2m1 || (G == K / kBlock && !z.defined()), "E2M1 codes take grouped scales and no zero points");
    TORCH_CHECK(n <= NV * kLanes, "more outputs than the codes hold");
    TORCH_CHECK(!bias.defined() || (bias.scalar_type() == torch::kFloat && bias.numel() >= n), "bias must be float32");
    return {static_cast<const uint8_t*>(codes.data_ptr()), bits, d.data_ptr<at::Half>(),
            z.defined() ? z.data_ptr<at::Half>() : nullptr, bias.defined() ? bias.data_ptr<float>() : nullptr, NV, G,
            n, e2m1};
}

void tailrace::int_linear(const c10::BFloat16* x, int64_t rows, int64_t k, const IntWeights& w, c10::BFloat16* y) {
    int_linear_rows(x, rows, k, w, y);
}

void register_int_linear(pybind11::module& m) {
    m.def("int_linear", &linear,
          "y = x @ W.T + bias for W = codes * d (+ z): int8 or 4-bit codes packed as in int_linear.cpp (AVX512-VNNI)");
}
