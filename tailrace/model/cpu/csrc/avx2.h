// The AVX-512 types and intrinsics the kernels use, each as two AVX2 halves: the kernels' build for
// x86-64-v3 CPUs (AVX2, FMA, F16C), which have no AVX-512: every AMD before Zen 4, Intel's client
// chips since Alder Lake. vec.h includes this where __AVX512F__ is not defined; each kernel's source
// stays the one the AVX-512 build compiles, and gives the same bits:
// - lane-wise float arithmetic is the same IEEE operation on each half;
// - the horizontal sums and maxima follow GCC's _mm512_reduce_* tree (halves, then quarters, then
//   pairs), so a row's reductions add in the AVX-512 build's order;
// - vpdpbusd is maddubs then madd: exact where the unsigned operand's bytes are at most 128, as
//   the integer kernel's codes are (a pair of products then stays within int16, where maddubs
//   saturates);
// - vdpbf16ps and vcvtneps2bf16 compile here for the native-bfloat16 template branch, which runs
//   only where __builtin_cpu_supports("avx512bf16"), never on such a CPU.
// Masks stay __mmask16 bit masks (GCC declares the type for every target); masked loads and stores
// of 32-bit lanes use AVX2's vmaskmov, which never touches a masked-off lane's memory, and those of
// 16-bit lanes go lane by lane where the mask is not full (a row's tail only).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tailrace::avx2 {

struct F32x16 {
    __m256 lo, hi;
};
struct I32x16 {
    __m256i lo, hi;
};
struct F64x8 {
    __m256d lo, hi;
};

inline __m256i lane_bits(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit);
}
inline __m256i low_mask(__mmask16 m) { return lane_bits(m & 0xFF); }
inline __m256i high_mask(__mmask16 m) { return lane_bits(m >> 8); }
inline __mmask16 to_mask(__m256 lo, __m256 hi) {
    return static_cast<__mmask16>(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

inline F32x16 set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F32x16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32x16 loadu_ps(const void* p) {
    const float* f = static_cast<const float*>(p);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
inline void storeu_ps(void* p, F32x16 v) {
    float* f = static_cast<float*>(p);
    _mm256_storeu_ps(f, v.lo);
    _mm256_storeu_ps(f + 8, v.hi);
}
inline F32x16 maskz_loadu_ps(__mmask16 m, const void* p) {
    const float* f = static_cast<const float*>(p);
    return {_mm256_maskload_ps(f, low_mask(m)), _mm256_maskload_ps(f + 8, high_mask(m))};
}
inline F32x16 mask_mov_ps(F32x16 src, __mmask16 m, F32x16 a) {
    return {_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(low_mask(m))),
            _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(high_mask(m)))};
}
inline F32x16 maskz_mov_ps(__mmask16 m, F32x16 a) { return mask_mov_ps(setzero_ps(), m, a); }
inline F32x16 mask_loadu_ps(F32x16 src, __mmask16 m, const void* p) { return mask_mov_ps(src, m, maskz_loadu_ps(m, p)); }
inline void mask_storeu_ps(void* p, __mmask16 m, F32x16 v) {
    float* f = static_cast<float*>(p);
    _mm256_maskstore_ps(f, low_mask(m), v.lo);
    _mm256_maskstore_ps(f + 8, high_mask(m), v.hi);
}

#define TAILRACE_LANEWISE_PS(name, op)                                                          \
    inline F32x16 name(F32x16 a, F32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
TAILRACE_LANEWISE_PS(add_ps, _mm256_add_ps)
TAILRACE_LANEWISE_PS(sub_ps, _mm256_sub_ps)
TAILRACE_LANEWISE_PS(mul_ps, _mm256_mul_ps)
TAILRACE_LANEWISE_PS(div_ps, _mm256_div_ps)
TAILRACE_LANEWISE_PS(max_ps, _mm256_max_ps)
TAILRACE_LANEWISE_PS(min_ps, _mm256_min_ps)
TAILRACE_LANEWISE_PS(unpacklo_ps, _mm256_unpacklo_ps)
TAILRACE_LANEWISE_PS(unpackhi_ps, _mm256_unpackhi_ps)
#undef TAILRACE_LANEWISE_PS

inline F32x16 fmadd_ps(F32x16 a, F32x16 b, F32x16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F32x16 fnmadd_ps(F32x16 a, F32x16 b, F32x16 c) {
    return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32x16 abs_ps(F32x16 a) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
inline F32x16 mask_max_ps(F32x16 src, __mmask16 m, F32x16 a, F32x16 b) { return mask_mov_ps(src, m, max_ps(a, b)); }

template <int Predicate>
inline __mmask16 cmp_ps_mask(F32x16 a, F32x16 b) {
    return to_mask(_mm256_cmp_ps(a.lo, b.lo, Predicate), _mm256_cmp_ps(a.hi, b.hi, Predicate));
}

// n is a whole number here (exp16's power of two, |n| <= 128): p * 2^n as two exact halvings of
// the exponent, so neither factor leaves float's range and only the last product rounds, as
// vscalefps rounds once.
inline __m256 scalef8(__m256 p, __m256 n) {
    const __m256i whole = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(whole, 1);
    const __m256i rest = _mm256_sub_epi32(whole, half);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}
inline F32x16 scalef_ps(F32x16 p, F32x16 n) { return {scalef8(p.lo, n.lo), scalef8(p.hi, n.hi)}; }

template <int Rounding>
inline F32x16 roundscale_ps(F32x16 a) {
    static_assert((Rounding & 0xF0) == 0, "scaled rounding is not used");
    return {_mm256_round_ps(a.lo, Rounding), _mm256_round_ps(a.hi, Rounding)};
}

// GCC's _mm512_reduce_add_ps / _max_ps order: the two halves, their two quarters, then pairs.
template <typename Op>
inline float reduce_ps(F32x16 a, Op op) {
    const __m256 half = op(a.hi, a.lo);
    __m128 q = op(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
    q = op(q, _mm_shuffle_ps(q, q, 78));
    q = op(q, _mm_shuffle_ps(q, q, 177));
    return _mm_cvtss_f32(q);
}
inline float reduce_add_ps(F32x16 a) {
    return reduce_ps(a, [](auto x, auto y) {
        if constexpr (sizeof(x) == 32) return _mm256_add_ps(x, y); else return _mm_add_ps(x, y);
    });
}
inline float reduce_max_ps(F32x16 a) {
    return reduce_ps(a, [](auto x, auto y) {
        if constexpr (sizeof(x) == 32) return _mm256_max_ps(x, y); else return _mm_max_ps(x, y);
    });
}

// 128-bit lane i (0-3) of a.
inline __m128 quarter(F32x16 a, int i) {
    const __m256 half = i < 2 ? a.lo : a.hi;
    return (i & 1) ? _mm256_extractf128_ps(half, 1) : _mm256_castps256_ps128(half);
}
template <int Select>
inline F32x16 shuffle_f32x4(F32x16 a, F32x16 b) {
    return {_mm256_set_m128(quarter(a, (Select >> 2) & 3), quarter(a, Select & 3)),
            _mm256_set_m128(quarter(b, (Select >> 6) & 3), quarter(b, (Select >> 4) & 3))};
}

inline F32x16 permutexvar_ps(I32x16 index, F32x16 a) {
    auto half = [&](__m256i i) {
        const __m256 from_high = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));  // sign: index bit 3
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(a.lo, i), _mm256_permutevar8x32_ps(a.hi, i), from_high);
    };
    return {half(index.lo), half(index.hi)};
}

inline F64x8 castps_pd(F32x16 a) { return {_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
inline F32x16 castpd_ps(F64x8 a) { return {_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
inline F64x8 unpacklo_pd(F64x8 a, F64x8 b) { return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
inline F64x8 unpackhi_pd(F64x8 a, F64x8 b) { return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }
inline I32x16 castps_si512(F32x16 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
inline F32x16 castsi512_ps(I32x16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }

inline I32x16 set1_epi32(int v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I32x16 set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
inline I32x16 setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32x16 setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9, int e10,
                         int e11, int e12, int e13, int e14, int e15) {
    return {_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15)};
}
inline I32x16 loadu_si512(const void* p) {
    const __m256i* v = static_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
inline void storeu_si512(void* p, I32x16 a) {
    __m256i* v = static_cast<__m256i*>(p);
    _mm256_storeu_si256(v, a.lo);
    _mm256_storeu_si256(v + 1, a.hi);
}
inline I32x16 maskz_loadu_epi32(__mmask16 m, const void* p) {
    const int* i = static_cast<const int*>(p);
    return {_mm256_maskload_epi32(i, low_mask(m)), _mm256_maskload_epi32(i + 8, high_mask(m))};
}
inline void mask_storeu_epi32(void* p, __mmask16 m, I32x16 a) {
    int* i = static_cast<int*>(p);
    _mm256_maskstore_epi32(i, low_mask(m), a.lo);
    _mm256_maskstore_epi32(i + 8, high_mask(m), a.hi);
}
inline I32x16 mask_mov_epi32(I32x16 src, __mmask16 m, I32x16 a) {
    return {_mm256_blendv_epi8(src.lo, a.lo, low_mask(m)), _mm256_blendv_epi8(src.hi, a.hi, high_mask(m))};
}

#define TAILRACE_LANEWISE_SI(name, op)                                                          \
    inline I32x16 name(I32x16 a, I32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
TAILRACE_LANEWISE_SI(and_si512, _mm256_and_si256)
TAILRACE_LANEWISE_SI(or_si512, _mm256_or_si256)
TAILRACE_LANEWISE_SI(add_epi32, _mm256_add_epi32)
TAILRACE_LANEWISE_SI(shuffle_epi8, _mm256_shuffle_epi8)  // both shuffle within 128-bit lanes
TAILRACE_LANEWISE_SI(sub_epi32, _mm256_sub_epi32)
TAILRACE_LANEWISE_SI(mullo_epi32, _mm256_mullo_epi32)
#undef TAILRACE_LANEWISE_SI
// 32 bytes, byte i all ones where bit i of m is set: a 32-bit byte mask's vector.
inline __m256i byte_bits(uint32_t m) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(m)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
// vpaddb under a 64-bit byte mask: src where m's bit is clear.
inline I32x16 mask_add_epi8(I32x16 src, uint64_t m, I32x16 a, I32x16 b) {
    return {_mm256_blendv_epi8(src.lo, _mm256_add_epi8(a.lo, b.lo), byte_bits(static_cast<uint32_t>(m))),
            _mm256_blendv_epi8(src.hi, _mm256_add_epi8(a.hi, b.hi), byte_bits(static_cast<uint32_t>(m >> 32)))};
}
inline I32x16 cvtepi8_epi32(__m128i a) { return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))}; }
inline I32x16 broadcast_i32x4(__m128i a) {
    const __m256i both = _mm256_broadcastsi128_si256(a);
    return {both, both};
}

inline I32x16 slli_epi32(I32x16 a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline I32x16 srli_epi32(I32x16 a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline I32x16 srli_epi16(I32x16 a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }

inline I32x16 cvtps_epi32(F32x16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline F32x16 cvtepi32_ps(I32x16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I32x16 cvtepu16_epi32(__m256i a) {
    return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
inline I32x16 cvtepi8_epi16(__m256i a) {
    return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1))};
}
inline F32x16 cvtph_ps(__m256i a) {
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}
// vpmovdw / vpmovdb: each 32-bit lane's low 16 or 8 bits, truncated.
inline __m128i low_words(__m256i a) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), 0x08));
}
inline __m256i cvtepi32_epi16(I32x16 a) { return _mm256_set_m128i(low_words(a.hi), low_words(a.lo)); }
inline __m128i cvtepi32_epi8(I32x16 a) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i gather = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    const __m128i lo = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a.lo, pick), gather));
    const __m128i hi = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a.hi, pick), gather));
    return _mm_unpacklo_epi64(lo, hi);
}
inline int reduce_add_epi32(I32x16 a) {
    const __m256i half = _mm256_add_epi32(a.lo, a.hi);
    __m128i q = _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 78));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 177));
    return _mm_cvtsi128_si32(q);
}

inline I32x16 dpwssd_epi32(I32x16 sum, I32x16 a, I32x16 b) {
    return {_mm256_add_epi32(sum.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(sum.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
inline I32x16 dpbusd_epi32(I32x16 sum, I32x16 u, I32x16 s) {
    const __m256i ones = _mm256_set1_epi16(1);
    return {_mm256_add_epi32(sum.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(u.lo, s.lo), ones)),
            _mm256_add_epi32(sum.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(u.hi, s.hi), ones))};
}
// vdpbf16ps: lane l += a[2l + 1] * b[2l + 1], then += a[2l] * b[2l] (bfloat16 products are exact).
inline F32x16 dpbf16_ps(F32x16 sum, I32x16 a, I32x16 b) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    auto half = [&](__m256 acc, __m256i x, __m256i y) {
        acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(x, high)), _mm256_castsi256_ps(_mm256_and_si256(y, high)), acc);
        return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(y, 16)), acc);
    };
    return {half(sum.lo, a.lo, b.lo), half(sum.hi, a.hi, b.hi)};
}
// vcvtneps2bf16: round to nearest even; float32 denormals to zero; a NaN made quiet.
inline __m128i bf16_half(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i exponent = _mm256_and_si256(bits, _mm256_set1_epi32(0x7F800000));
    const __m256i flushed = _mm256_blendv_epi8(bits, _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u))),
                                               _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(flushed, 16), _mm256_set1_epi32(1));
    __m256i out = _mm256_srli_epi32(_mm256_add_epi32(flushed, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    out = _mm256_blendv_epi8(out, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08));
}
inline __m256i cvtneps_pbh(F32x16 v) { return _mm256_set_m128i(bf16_half(v.hi), bf16_half(v.lo)); }

// 16-bit lanes (vmovdqu16): a full mask is one load or store, a row's tail goes lane by lane.
inline __m256i maskz_loadu_epi16(__mmask16 m, const void* p) {
    if (m == 0xFFFF)
        return _mm256_loadu_si256(static_cast<const __m256i*>(p));
    alignas(32) uint16_t lanes[16] = {};
    for (int i = 0; i < 16; ++i)
        if (m >> i & 1)
            lanes[i] = static_cast<const uint16_t*>(p)[i];
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}
inline void mask_storeu_epi16(void* p, __mmask16 m, __m256i a) {
    if (m == 0xFFFF) {
        _mm256_storeu_si256(static_cast<__m256i*>(p), a);
        return;
    }
    alignas(32) uint16_t lanes[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    for (int i = 0; i < 16; ++i)
        if (m >> i & 1)
            static_cast<uint16_t*>(p)[i] = lanes[i];
}

}  // namespace tailrace::avx2

// The kernels' spelling, mapped to the above (immintrin.h has declared the AVX-512 originals, which
// would not compile for this target; some of them as macros).
#undef __m512
#define __m512 ::tailrace::avx2::F32x16
#undef __m512i
#define __m512i ::tailrace::avx2::I32x16
#undef __m512bh
#define __m512bh ::tailrace::avx2::I32x16
#undef __m512d
#define __m512d ::tailrace::avx2::F64x8
#undef _mm512_set1_ps
#define _mm512_set1_ps ::tailrace::avx2::set1_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps ::tailrace::avx2::setzero_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps ::tailrace::avx2::loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps ::tailrace::avx2::storeu_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps ::tailrace::avx2::maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps ::tailrace::avx2::mask_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps ::tailrace::avx2::mask_storeu_ps
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps ::tailrace::avx2::mask_mov_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps ::tailrace::avx2::maskz_mov_ps
#undef _mm512_add_ps
#define _mm512_add_ps ::tailrace::avx2::add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps ::tailrace::avx2::sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps ::tailrace::avx2::mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps ::tailrace::avx2::div_ps
#undef _mm512_max_ps
#define _mm512_max_ps ::tailrace::avx2::max_ps
#undef _mm512_min_ps
#define _mm512_min_ps ::tailrace::avx2::min_ps
#undef _mm512_mask_max_ps
#define _mm512_mask_max_ps ::tailrace::avx2::mask_max_ps
#undef _mm512_unpacklo_ps
#define _mm512_unpacklo_ps ::tailrace::avx2::unpacklo_ps
#undef _mm512_unpackhi_ps
#define _mm512_unpackhi_ps ::tailrace::avx2::unpackhi_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps ::tailrace::avx2::fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps ::tailrace::avx2::fnmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps ::tailrace::avx2::abs_ps
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, predicate) ::tailrace::avx2::cmp_ps_mask<(predicate)>(a, b)
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask(m, a, b, predicate) \
    static_cast<__mmask16>((m) & ::tailrace::avx2::cmp_ps_mask<(predicate)>(a, b))
#undef _mm512_scalef_ps
#define _mm512_scalef_ps ::tailrace::avx2::scalef_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, rounding) ::tailrace::avx2::roundscale_ps<(rounding)>(a)
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps ::tailrace::avx2::reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps ::tailrace::avx2::reduce_max_ps
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, select) ::tailrace::avx2::shuffle_f32x4<(select)>(a, b)
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps ::tailrace::avx2::permutexvar_ps
#undef _mm512_castps_pd
#define _mm512_castps_pd ::tailrace::avx2::castps_pd
#undef _mm512_castpd_ps
#define _mm512_castpd_ps ::tailrace::avx2::castpd_ps
#undef _mm512_unpacklo_pd
#define _mm512_unpacklo_pd ::tailrace::avx2::unpacklo_pd
#undef _mm512_unpackhi_pd
#define _mm512_unpackhi_pd ::tailrace::avx2::unpackhi_pd
#undef _mm512_castps_si512
#define _mm512_castps_si512 ::tailrace::avx2::castps_si512
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps ::tailrace::avx2::castsi512_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 ::tailrace::avx2::set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 ::tailrace::avx2::set1_epi8
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 ::tailrace::avx2::setzero_si512
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 ::tailrace::avx2::setr_epi32
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 ::tailrace::avx2::loadu_si512
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 ::tailrace::avx2::storeu_si512
#undef _mm512_maskz_loadu_epi32
#define _mm512_maskz_loadu_epi32 ::tailrace::avx2::maskz_loadu_epi32
#undef _mm512_mask_storeu_epi32
#define _mm512_mask_storeu_epi32 ::tailrace::avx2::mask_storeu_epi32
#undef _mm512_mask_mov_epi32
#define _mm512_mask_mov_epi32 ::tailrace::avx2::mask_mov_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 ::tailrace::avx2::and_si512
#undef _mm512_or_si512
#define _mm512_or_si512 ::tailrace::avx2::or_si512
#undef _mm512_add_epi32
#define _mm512_add_epi32 ::tailrace::avx2::add_epi32
#undef _mm512_shuffle_epi8
#define _mm512_shuffle_epi8 ::tailrace::avx2::shuffle_epi8
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 ::tailrace::avx2::sub_epi32
#undef _mm512_mullo_epi32
#define _mm512_mullo_epi32 ::tailrace::avx2::mullo_epi32
#undef _mm512_mask_add_epi8
#define _mm512_mask_add_epi8 ::tailrace::avx2::mask_add_epi8
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 ::tailrace::avx2::cvtepi8_epi32
#undef _mm512_broadcast_i32x4
#define _mm512_broadcast_i32x4 ::tailrace::avx2::broadcast_i32x4
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 ::tailrace::avx2::slli_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 ::tailrace::avx2::srli_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 ::tailrace::avx2::srli_epi16
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 ::tailrace::avx2::cvtps_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps ::tailrace::avx2::cvtepi32_ps
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 ::tailrace::avx2::cvtepu16_epi32
#undef _mm512_cvtepi8_epi16
#define _mm512_cvtepi8_epi16 ::tailrace::avx2::cvtepi8_epi16
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps ::tailrace::avx2::cvtph_ps
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 ::tailrace::avx2::cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 ::tailrace::avx2::cvtepi32_epi8
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 ::tailrace::avx2::reduce_add_epi32
#undef _mm512_dpwssd_epi32
#define _mm512_dpwssd_epi32 ::tailrace::avx2::dpwssd_epi32
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 ::tailrace::avx2::dpbusd_epi32
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps ::tailrace::avx2::dpbf16_ps
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh ::tailrace::avx2::cvtneps_pbh
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 ::tailrace::avx2::maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 ::tailrace::avx2::mask_storeu_epi16
