// y = x @ W.T (+ bias) for weights held as integer codes with float16 scales, on CPUs with
// AVX512-VNNI: tailrace's int8 and int4 projections, and GGUF's blocks taken as they are (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, and the K-quants Q2_K to Q6_K).
//
// A weight is w = c * d + z, c an int8 code (or an unsigned one of 4 to 6 bits), d and z float16,
// either one d per output row (int8 per channel, z = 0) or one (d, z) per output and block of 32
// inputs (the GGUF blocks of 32); a K-quant's super-block of 256 instead has integer scales (and
// mins) per 32 or 16 inputs under its float16 d (and z), see tile. The activations go to integer
// codes per block of 32 inputs, with a float32 scale s = max|x| / C for the block, and an integer
// dot product adds codes times codes into int32 lanes, exactly:
// - against int8 weights, int16 activations (C = 32767, a finer grid than bfloat16's 8 bits
//   wherever |x| is within a factor 128 of the block's largest) through vpdpwssd, 2 products a lane;
// - against 4- to 6-bit weights, int8 activations (C = 127, as llama.cpp's Q8_0 and Q8_K
//   activations for its blocks) through vpdpbusd, 4 products a lane and no widening of the codes:
//   a product of 4 rows 1.6x faster at the same memory traffic on a Zen 4 (`bench/decode_step.py
//   --quantization int4 --batch 1 8 32` times the steps), where the 4-bit weights are still what
//   the result loses precision to (`bench/quality.py` shows it).
// Each block's integer sum goes to float32 once:
//     grouped: acc += (isum * s) * d  (+ z * s * sum(x codes))     per row: acc += isum * s; y = acc * d
// Every output's float32 accumulator runs over the blocks in order, so a row's bits depend neither
// on the other rows, nor on the tiling, nor on the thread count (the engine's exactness rests on it).
//
// Layouts, packed once at load (tailrace/model/cpu/int_linear.py): outputs 16 to a vector, vectors
// padded to a multiple of kVectors; int8 codes [NV][K/2][32] as bf16_linear packs its weights (the
// pair (k, k+1) of output lane l at bytes 2l, 2l+1); 4-bit codes [NV][K/8][64] bytes, lane l's 4
// bytes of a run holding its inputs 8r..8r+3 in the low nibbles and 8r+4..8r+7 in the high ones,
// and a 5- or 6-bit code's higher bits in byte masks beside them (see load_codes); d and z
// [NV / 4][G][4][16] with G = 1 (per row), K / 32, or K / 256 (super-blocks), and a K-quant's integer
// scales and mins [NV / 4][K / 32 or K / 16][4][16]: a tile's 4 vectors side by side, group by
// group, so that a tile reads its scales as one run (see scale_at).

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
// Super, SuperHalves: GGUF's K-quant blocks, integer scales (and mins) per 32 or per 16 inputs under
// a float16 scale (and min) per super-block of 256 (see the super-block sums in tile).
enum class Scales { PerRow, Grouped, GroupedWithZero, E2M1, Super, SuperHalves };

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
    const int32_t* sum16;  // [M][K / 16]: each half block's codes summed, what integer mins multiply
};

struct Problem {
    Codes x;
    const uint8_t* w;
    const uint64_t* high;  // the codes' bits 4 and 5 (tailrace::IntWeights), or nullptr
    const at::Half* d;     // [NV][G][16]
    const at::Half* z;     // [NV][G][16] or nullptr
    const int8_t* sub;     // [NV][KB * subs][16] integer scales (Scales::Super*), or nullptr
    const int8_t* mins;    // like sub, or nullptr
    const float* bias;     // [N] or nullptr
    int64_t M, K, N, KB, NV, G;
    int64_t ldy;           // y's row stride (N, or wider where y is a part's columns)
    int64_t super;         // blocks per d and z (Scales::Super*; 1 otherwise)
    bool e2m1;             // 4-bit codes of E2M1 values (Scales::E2M1)
};

template <typename C, typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, C* codes, float* scale, float* sum, int32_t* sum16) {
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
                sum16[2 * b] = sum16[2 * b + 1] = 0;
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
            sum16[2 * b] = _mm512_reduce_add_epi32(qlo);
            sum16[2 * b + 1] = _mm512_reduce_add_epi32(qhi);
            sum[b] = scale[b] * static_cast<float>(sum16[2 * b] + sum16[2 * b + 1]);
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

// With High bit planes (5- and 6-bit codes: GGUF's Q5 and Q6 blocks), each load's codes have 2 * High
// 64-bit masks beside them, mask 2 k + h holding bit 4 + k of out[h]'s 64 bytes; the bits' planes
// [NV][K / 8][High][2] follow the codes' order.
template <int High>
constexpr int64_t kHighWords = 2 * High;

template <int Bits, bool E2M1, int High>
inline void load_codes(const uint8_t* at, const uint64_t* high, __m512i* out) {
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
        for (int k = 0; k < High; ++k) {
            const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << k));
            for (int h = 0; h < 2; ++h)
                out[h] = _mm512_mask_add_epi8(out[h], high[2 * k + h], out[h], bit);
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
inline int64_t table_at(int64_t G, int64_t v, int64_t b) {
    return (((v / kVectors) * G + b) * kVectors + v % kVectors) * kLanes;
}
inline int64_t scale_at(const Problem& p, int64_t v, int64_t b) { return table_at(p.G, v, b); }
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
// Codes of 5 (6) bits widen every 2 steps (every step): 8 products of at most 31 x 127 (4 of 63 x 127).
template <bool OneRow, bool E2M1, int High, int First, int Steps, int MT, int NT>
inline void int4_block_sums(const uint8_t* codes, int64_t stride, const uint64_t* high, int64_t high_stride,
                            const int8_t* x, int64_t K, __m512i (&isum)[MT][NT]) {
    constexpr int64_t kMostSteps = E2M1 || High == 1 ? 2 : High == 2 ? 1 : 4;
    constexpr int64_t kWiden = Steps < kMostSteps ? Steps : kMostSteps;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            isum[i][j] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t first = First; first < First + Steps; first += kWiden) {
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
                const uint64_t* bits = high + j * high_stride + step * kHighWords<High>;
                prefetch_codes<OneRow>(at);
                if constexpr (High > 0)
                    prefetch_codes<OneRow>(reinterpret_cast<const uint8_t*>(bits));
                __m256i w[2][2];  // [lanes 0-7 or 8-15][inputs 0-3 or 4-7]
                for (int h = 0; h < 2; ++h) {
                    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
                    w[h][0] = _mm256_and_si256(bytes, low);
                    w[h][1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                    if constexpr (E2M1) {
                        w[h][0] = _mm256_shuffle_epi8(table, w[h][0]);
                        w[h][1] = _mm256_shuffle_epi8(table, w[h][1]);
                    }
                    for (int k = 0; k < High; ++k)
                        for (int half = 0; half < 2; ++half)
                            w[h][half] = _mm256_add_epi8(
                                w[h][half], _mm256_and_si256(tailrace::avx2::byte_bits(static_cast<uint32_t>(
                                                                 bits[2 * k + half] >> (32 * h))),
                                                             _mm256_set1_epi8(static_cast<char>(16 << k))));
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

// Steps [First, First + Steps) of one block's integer sums of MT rows (their codes K apart) by NT
// vectors (their codes `stride` apart, their high bits `high_stride`): isum[i][j] lane l = the sum
// of weight code times row code over those steps' inputs (a step: kLoadInputs of them).
template <int Bits, bool E2M1, int High, bool OneRow, int First, int Steps, int MT, int NT>
inline void dot_block_sums(const uint8_t* codes, int64_t stride, const uint64_t* high, int64_t high_stride,
                           const ActivationCode<Bits>* x, int64_t K, __m512i (&isum)[MT][NT]) {
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            isum[i][j] = _mm512_setzero_si512();
    for (int64_t step = First; step < First + Steps; ++step) {
        __m512i wv[NT][2];
        for (int j = 0; j < NT; ++j) {
            const uint8_t* at = codes + j * stride + step * kLoadBytes<Bits>;
            const uint64_t* bits = high + j * high_stride + step * kHighWords<High>;
            load_codes<Bits, E2M1, High>(at, bits, wv[j]);
            prefetch_codes<OneRow>(at);
            if constexpr (High > 0)
                prefetch_codes<OneRow>(reinterpret_cast<const uint8_t*>(bits));
        }
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NT; ++j)
                isum[i][j] = dot<Bits>(isum[i][j], wv[j], x + i * K + step * kLoadInputs<Bits>);
    }
}

template <int Bits, bool E2M1, int High, bool OneRow, int First, int Steps, int MT, int NT>
inline void block_sums(const uint8_t* codes, int64_t stride, const uint64_t* high, int64_t high_stride,
                       const ActivationCode<Bits>* x, int64_t K, __m512i (&isum)[MT][NT]) {
#ifndef __AVX512F__
    if constexpr (Bits == 4)
        int4_block_sums<OneRow, E2M1, High, First, Steps>(codes, stride, high, high_stride, x, K, isum);
    else
#endif
        dot_block_sums<Bits, E2M1, High, OneRow, First, Steps>(codes, stride, high, high_stride, x, K, isum);
}

// Blocks [b0, b1) of rows m0.. (MT of them) against vectors v0..v0+NT-1, added into `part`
// [MT][V][16]. The pointers are set once and the float sums stay in registers over the blocks:
// with a code address and the sums' loads and stores worked out per vector and block, half of a
// one-row tile's instructions were bookkeeping (`perf annotate` of the tile shows it).
//
// A super-block's weights are w = d * a * (c - o) + z * m per 32 (Super) or 16 (SuperHalves) inputs:
// a and m the block's integer scale and min, d and z float16 per super-block (z the negated min
// scale), o = 0 where there are mins, else half the codes' range (8 << High). A Super block (Q4_K's,
// Q5_K's, always with mins) takes the grouped form's arithmetic with scale d a and zero z m, each
// exact in float32. A SuperHalves block adds
//     acc += (I1 * s) * d  (+ (I2 * s) * z),   I1 = sum_h a_h (isum_h - o xsum_h),  I2 = sum_h m_h xsum_h
// with I1 and I2 exact in int32 and, below 2^24 (Q6_K's two halves, 2 x 128 x 32 x 127 x 16, come
// nearest), in float32. Either way the products are those of the file's own weights.
template <int Bits, Scales S, int High, int V, int MT, int NT>
void tile(const Problem& p, int64_t m0, int64_t v0, int64_t b0, int64_t b1, float* part) {
    constexpr int64_t kSteps = kBlock / kLoadInputs<Bits>;
    constexpr bool kOneRow = V == kOneRowVectors, kE2M1 = S == Scales::E2M1;
    constexpr int kHalves = S == Scales::SuperHalves ? 2 : 1;
    const int64_t stride = vector_bytes<Bits>(p), high_stride = p.K / kLoadInputs<Bits> * kHighWords<High>;
    const uint8_t* codes = p.w + v0 * stride + b0 * kSteps * kLoadBytes<Bits>;
    const uint64_t* high = High == 0 ? nullptr : p.high + v0 * high_stride + b0 * kSteps * kHighWords<High>;
    const auto* x = static_cast<const ActivationCode<Bits>*>(p.x.codes) + m0 * p.K + b0 * kBlock;
    const float* x_scale = p.x.scale + m0 * p.KB;
    const float* x_sum = p.x.sum + m0 * p.KB;
    const int32_t* x_sum16 = p.x.sum16 + m0 * 2 * p.KB;
    const bool mins = p.mins != nullptr;
    const int32_t offset = mins ? 0 : 8 << High;
    __m512 acc[MT][NT];
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            acc[i][j] = _mm512_loadu_ps(part + (i * V + j) * kLanes);
    for (int64_t b = b0; b < b1; ++b, codes += kSteps * kLoadBytes<Bits>, x += kBlock) {
        __m512i isum[kHalves][MT][NT];
        if constexpr (kHalves == 2) {
            block_sums<Bits, kE2M1, High, kOneRow, 0, kSteps / 2>(codes, stride, high, high_stride, x, p.K, isum[0]);
            block_sums<Bits, kE2M1, High, kOneRow, kSteps / 2, kSteps / 2>(codes, stride, high, high_stride, x, p.K,
                                                                           isum[1]);
        } else {
            block_sums<Bits, kE2M1, High, kOneRow, 0, kSteps>(codes, stride, high, high_stride, x, p.K, isum[0]);
        }
        if constexpr (High > 0)
            high += kSteps * kHighWords<High>;
        for (int j = 0; j < NT; ++j) {
            __m512 d, z;
            if constexpr (S == Scales::SuperHalves) {
                const int64_t at = scale_at(p, v0 + j, b / p.super);
                d = half16(p.d + at);
                __m512i a[2], m[2];
                for (int h = 0; h < 2; ++h) {
                    const int64_t sub_at = table_at(2 * p.KB, v0 + j, 2 * b + h);
                    a[h] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.sub + sub_at)));
                    if (mins)
                        m[h] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mins + sub_at)));
                }
                _mm_prefetch(reinterpret_cast<const char*>(p.sub + table_at(2 * p.KB, v0 + j, 2 * (b + kScalePrefetch))),
                             _MM_HINT_T0);
                if (mins)
                    z = half16(p.z + at);
                for (int i = 0; i < MT; ++i) {
                    const int32_t* xs = x_sum16 + i * 2 * p.KB + 2 * b;
                    __m512i i1 = _mm512_setzero_si512(), i2 = _mm512_setzero_si512();
                    for (int h = 0; h < 2; ++h) {
                        i1 = _mm512_add_epi32(i1, _mm512_mullo_epi32(a[h], _mm512_sub_epi32(
                                                      isum[h][i][j], _mm512_set1_epi32(offset * xs[h]))));
                        if (mins)
                            i2 = _mm512_add_epi32(i2, _mm512_mullo_epi32(m[h], _mm512_set1_epi32(xs[h])));
                    }
                    const __m512 s = _mm512_set1_ps(x_scale[i * p.KB + b]);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i1), s), d, acc[i][j]);
                    if (mins)
                        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i2), s), z, acc[i][j]);
                }
                continue;
            }
            if constexpr (S == Scales::Super) {
                // the grouped form's arithmetic with the block's scale d a and zero z m, each exact
                // in float32 (an 11-bit d times a 6-bit a)
                const int64_t at = scale_at(p, v0 + j, b / p.super), sub_at = table_at(p.KB, v0 + j, b);
                const __m512 a = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.sub + sub_at))));
                const __m512 m = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mins + sub_at))));
                d = _mm512_mul_ps(half16(p.d + at), a);
                z = _mm512_mul_ps(half16(p.z + at), m);
                const int64_t ahead = table_at(p.KB, v0 + j, b + kScalePrefetch);
                _mm_prefetch(reinterpret_cast<const char*>(p.sub + ahead), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(p.mins + ahead), _MM_HINT_T0);
            } else if constexpr (S != Scales::PerRow) {
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
                const __m512 f = _mm512_cvtepi32_ps(isum[0][i][j]);
                const __m512 s = _mm512_set1_ps(x_scale[i * p.KB + b]);
                if constexpr (S == Scales::PerRow) {
                    acc[i][j] = _mm512_fmadd_ps(f, s, acc[i][j]);
                } else {
                    acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(f, s), d, acc[i][j]);
                    if constexpr (S == Scales::GroupedWithZero || S == Scales::E2M1 || S == Scales::Super)
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
            tailrace::store16(y + (m0 + i) * p.ldy + n0, _mm512_add_ps(out, bias), mask);
        }
    }
}

// One unit of work: vectors [v_begin, v_end) in tiles of up to V, rows [m_begin, m_end), R rows a
// tile. The blocks are the middle loop so that a tile's codes are read from memory once a chunk
// and reused by every row tile from cache.
template <int Bits, Scales S, int High, int R, int V, typename T>
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
                        tile<Bits, S, High, V, decltype(mt)::value, decltype(vt)::value>(p, m0, v0, b0, b1, part);
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
template <int Bits, Scales S, int High = 0, typename T>
void run(const Problem& p, T* y) {
    const int64_t used = (p.N + kLanes - 1) / kLanes;
    tailrace::parallel_vectors(used, kVectors, p.M, kRows, [&](int64_t v0, int64_t v1, int64_t m0, int64_t m1) {
        if (p.M == 1)
            run_tiles<Bits, S, High, 1, kOneRowVectors>(p, v0, v1, m0, m1, y);
        else
            run_tiles<Bits, S, High, kRows, kTileVectors>(p, v0, v1, m0, m1, y);
    });
}

// The forms GGUF's blocks take (gguf_quant.py), and only those, with high bits: Q5_0 and Q5_1
// (grouped), Q5_K (Super) and Q6_K (SuperHalves); 4-bit K-quants Q4_K (Super), Q3_K and Q2_K
// (SuperHalves).
template <int Bits, typename T>
void run_bits(const Problem& p, T* y, int high_bits, int halves) {
    if constexpr (Bits == 4) {
        if (p.e2m1)
            return run<Bits, Scales::E2M1>(p, y);
        if (p.sub != nullptr) {
            if (halves == 2)
                return high_bits == 2 ? run<Bits, Scales::SuperHalves, 2>(p, y) : run<Bits, Scales::SuperHalves>(p, y);
            return high_bits == 1 ? run<Bits, Scales::Super, 1>(p, y) : run<Bits, Scales::Super>(p, y);
        }
        if (high_bits == 1)
            return p.z != nullptr ? run<Bits, Scales::GroupedWithZero, 1>(p, y) : run<Bits, Scales::Grouped, 1>(p, y);
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
void int_linear_bits(const T* x, int64_t M, int64_t K, const tailrace::IntWeights& w, T* y, int64_t ldy) {
    const int64_t KB = K / kBlock;
    std::vector<ActivationCode<Bits>> codes(M * K);
    std::vector<float> scale(M * KB), sum(M * KB);
    std::vector<int32_t> sum16(2 * M * KB);
    quantize_rows(x, M, K, codes.data(), scale.data(), sum.data(), sum16.data());
    run_bits<Bits>(Problem{{codes.data(), scale.data(), sum.data(), sum16.data()}, w.codes, w.high, w.d, w.z, w.sub,
                           w.mins, w.bias, M, K, w.n, KB, w.vectors, w.groups, ldy, w.super, w.e2m1},
                   y, w.high_bits, w.halves);
}

template <typename T>
void int_linear_rows(const T* x, int64_t M, int64_t K, const tailrace::IntWeights& w, T* y, int64_t ldy) {
    if (M == 0)
        return;
    if (w.bits == 8)
        int_linear_bits<8>(x, M, K, w, y, ldy);
    else
        int_linear_bits<4>(x, M, K, w, y, ldy);
}

torch::Tensor defined(const c10::optional<torch::Tensor>& t) { return t.value_or(torch::Tensor()); }

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& codes, const c10::optional<torch::Tensor>& high,
                     const torch::Tensor& d, const c10::optional<torch::Tensor>& z,
                     const c10::optional<torch::Tensor>& sub, const c10::optional<torch::Tensor>& mins,
                     const c10::optional<torch::Tensor>& bias, int64_t n) {
    const int64_t K = x.size(-1);
    const tailrace::IntWeights w = tailrace::int_weights(codes, defined(high), d, defined(z), defined(sub),
                                                         defined(mins), defined(bias), K, n);
    const torch::Tensor rows = x.reshape({-1, K}).contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    torch::Tensor y = torch::empty(shape, x.options());
    tailrace::with_element_type(x.scalar_type(), "int_linear", [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        int_linear_rows(rows.data_ptr<T>(), rows.size(0), K, w, y.data_ptr<T>(), n);
    });
    return y;
}

// rows [T, K] float32 = the weights of outputs ids [T], as IntWeight.dequantize gives them.
torch::Tensor rows(const torch::Tensor& ids, const torch::Tensor& codes, const c10::optional<torch::Tensor>& high,
                   const torch::Tensor& d, const c10::optional<torch::Tensor>& z,
                   const c10::optional<torch::Tensor>& sub, const c10::optional<torch::Tensor>& mins, int64_t n) {
    TORCH_CHECK(ids.scalar_type() == torch::kInt64, "ids must be int64");
    const int64_t K = codes.size(1) * (codes.scalar_type() == torch::kChar ? kLoadInputs<8> : kLoadInputs<4>);
    const tailrace::IntWeights w = tailrace::int_weights(codes, defined(high), d, defined(z), defined(sub),
                                                         defined(mins), torch::Tensor(), K, n);
    const torch::Tensor flat = ids.reshape({-1}).contiguous();
    torch::Tensor out = torch::empty({flat.size(0), K}, torch::kFloat32);
    for (int64_t t = 0; t < flat.size(0); ++t) {
        const int64_t id = flat.data_ptr<int64_t>()[t];
        TORCH_CHECK(0 <= id && id < n, "row ", id, " is outside the ", n, " rows");
        tailrace::int_weight_row(w, id, K, out.data_ptr<float>() + t * K);
    }
    std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
    shape.push_back(K);
    return out.view(shape);
}

// A [NV / 4, groups, 4, 16] table of `type`, as pack_scales lays it out.
bool is_table(const torch::Tensor& t, torch::ScalarType type, int64_t NV) {
    return t.scalar_type() == type && t.dim() == 4 && t.size(0) * kVectors == NV && t.size(2) == kVectors &&
           t.size(3) == kLanes && t.is_contiguous();
}

}  // namespace

tailrace::IntWeights tailrace::int_weights(const torch::Tensor& codes, const torch::Tensor& high, const torch::Tensor& d,
                                           const torch::Tensor& z, const torch::Tensor& sub, const torch::Tensor& mins,
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
    const int64_t NV = codes.size(0), G = d.size(1), KB = K / kBlock;
    const int high_bits = high.defined() ? static_cast<int>(high.size(2)) : 0;
    TORCH_CHECK(!high.defined() || (bits == 4 && !e2m1 && high.scalar_type() == torch::kInt64 && high.dim() == 4 &&
                                    high.size(0) == NV && high.size(1) == K / kLoadInputs<4> && high.size(3) == 2 &&
                                    (high_bits == 1 || high_bits == 2) && high.is_contiguous()),
                "high bits go with 4-bit codes, int64 [NV, K / 8, 1 or 2, 2]");
    TORCH_CHECK(is_table(d, torch::kHalf, NV), "scales must be float16 [NV / 4, groups, 4, 16]");
    int halves = 0;
    int64_t super = 1;
    if (sub.defined()) {
        halves = static_cast<int>(sub.size(1) / KB);
        TORCH_CHECK(bits == 4 && !e2m1 && is_table(sub, torch::kChar, NV) && (halves == 1 || halves == 2) &&
                        sub.size(1) == KB * halves && G > 0 && KB % G == 0,
                    "integer scales go with 4-bit codes, int8 [NV / 4, K / 32 or K / 16, 4, 16], under float16 ",
                    "scales per whole number of blocks");
        TORCH_CHECK(!mins.defined() || (is_table(mins, torch::kChar, NV) && mins.sizes() == sub.sizes() && z.defined()),
                    "integer mins go in the integer scales' shape, with a float16 min scale");
        TORCH_CHECK(!z.defined() || mins.defined(), "a min scale goes with integer mins");
        TORCH_CHECK(halves == 2 || mins.defined(), "integer scales per 32 inputs go with integer mins");
        TORCH_CHECK((high_bits == 0) || (high_bits == 1 && halves == 1) || (high_bits == 2 && halves == 2),
                    "no kernel for ", 4 + high_bits, "-bit codes with integer scales per ", kBlock / halves, " inputs");
        super = KB / G;
    } else {
        TORCH_CHECK(!mins.defined(), "integer mins go with integer scales");
        TORCH_CHECK(G == 1 || G == KB, "scales must be one a row or one per 32 inputs");
        TORCH_CHECK(!z.defined() || (G == KB && is_table(z, torch::kHalf, NV) && z.sizes() == d.sizes()),
                    "zero points go with grouped scales, in their shape and type");
        TORCH_CHECK(high_bits <= 1 && (high_bits == 0 || G == KB), "5-bit codes take grouped scales");
    }
    TORCH_CHECK(!e2m1 || (G == KB && !z.defined()), "E2M1 codes take grouped scales and no zero points");
    TORCH_CHECK(n <= NV * kLanes, "more outputs than the codes hold");
    TORCH_CHECK(!bias.defined() || (bias.scalar_type() == torch::kFloat && bias.numel() >= n), "bias must be float32");
    auto pointer = [](const torch::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
    return {static_cast<const uint8_t*>(codes.data_ptr()), bits, static_cast<const uint64_t*>(pointer(high)), high_bits,
            d.data_ptr<at::Half>(), static_cast<const at::Half*>(pointer(z)), static_cast<const int8_t*>(pointer(sub)),
            static_cast<const int8_t*>(pointer(mins)), halves, bias.defined() ? bias.data_ptr<float>() : nullptr, NV,
            G, super, n, e2m1};
}

void tailrace::int_weight_row(const IntWeights& w, int64_t n, int64_t K, float* row) {
    const int64_t v = n / kLanes, lane = n % kLanes, KB = K / kBlock, halves = w.sub ? w.halves : 1;
    const int32_t offset = w.sub && !w.mins ? 8 << w.high_bits : 0;
    auto at = [&](int64_t groups, int64_t g) { return table_at(groups, v, g) + lane; };
    for (int64_t k = 0; k < K; ++k) {
        float code;
        if (w.bits == 8) {
            code = static_cast<int8_t>(w.codes[(v * K / 2 + k / 2) * 2 * kLanes + 2 * lane + k % 2]);
        } else {
            const int64_t r = k / 8, j = k % 8, h = j / 4;
            const uint8_t byte = w.codes[(v * K / 8 + r) * 4 * kLanes + 4 * lane + j % 4];
            int32_t c = h ? byte >> 4 : byte & 0x0F;
            for (int q = 0; q < w.high_bits; ++q)
                c += ((w.high[((v * K / 8 + r) * w.high_bits + q) * 2 + h] >> (4 * lane + j % 4)) & 1) << (4 + q);
            code = w.e2m1 ? static_cast<float>(kE2M1Codes[c]) - kE2M1Offset : static_cast<float>(c - offset);
        }
        const int64_t b = k / kBlock;
        if (w.sub) {  // (d a) (c - o) + z m, as IntWeight.dequantize
            const int64_t s = b * halves + (k % kBlock) * halves / kBlock, super = b / w.super;
            const float scale = static_cast<float>(w.d[at(w.groups, super)]) * static_cast<float>(w.sub[at(KB * halves, s)]);
            row[k] = scale * code;
            if (w.mins)
                row[k] += static_cast<float>(w.z[at(w.groups, super)]) * static_cast<float>(w.mins[at(KB * halves, s)]);
        } else {  // c d + z
            const int64_t g = w.groups == 1 ? 0 : b;
            row[k] = code * static_cast<float>(w.d[at(w.groups, g)]);
            if (w.z)
                row[k] += static_cast<float>(w.z[at(w.groups, g)]);
        }
    }
}

void tailrace::int_linear(const c10::BFloat16* x, int64_t rows, int64_t k, const IntWeights& w, c10::BFloat16* y,
                          int64_t y_stride) {
    int_linear_rows(x, rows, k, w, y, y_stride);
}

void register_int_linear(pybind11::module& m) {
    m.def("int_linear", &linear,
          "y = x @ W.T + bias for W = codes * d (+ z), or GGUF's super-blocks: int8 or 4- to 6-bit codes packed as "
          "in int_linear.cpp (AVX512-VNNI)");
    m.def("int_rows", &rows, "the float32 weights of rows `ids` of int_linear's packed weights (an embedding lookup)");
}
