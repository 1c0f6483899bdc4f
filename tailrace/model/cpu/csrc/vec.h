// 16 lanes of float32 loaded from and stored to bfloat16 or float32 memory, with a lane mask for
// tails, and exp: what the kernels here share.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>

#ifndef __AVX512F__
#include "avx2.h"  // the x86-64-v3 build: the same kernels on two AVX2 halves
#endif

namespace tailrace {

constexpr int kLanes = 16;

// f(static_cast<T*>(nullptr)) with T the element type of `dtype`, bfloat16 or float32: the one
// place the kernels turn a tensor's dtype into a template argument.
template <typename F>
void with_element_type(c10::ScalarType dtype, const char* op, F&& f) {
    if (dtype == c10::kBFloat16)
        f(static_cast<c10::BFloat16*>(nullptr));
    else if (dtype == c10::kFloat)
        f(static_cast<float*>(nullptr));
    else
        TORCH_CHECK(false, op, " takes bfloat16 or float32");
}

inline __mmask16 lanes(int64_t count) {
    return count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

inline __m512 load16(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }

// Round to nearest even, as PyTorch's float -> bfloat16 conversion (NaN kept, made quiet): the
// bfloat16 bits in the low half of each 32-bit lane.
inline __m512i bf16_lanes(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// The same rounding to 16 bfloat16. Native: AVX512-BF16's vcvtneps2bf16, one instruction for the
// eight above, which takes float32 denormals as zero where PyTorch keeps them (the one difference,
// as in bf16_linear.cpp's tiles) and keeps a NaN's sign and payload; callers choose it where
// native_bf16_dot() (kernels.h: with_native_bf16).
template <bool Native = false>
inline __m256i to_bf16_bits(__m512 v) {
    if constexpr (Native)
        return (__m256i)_mm512_cvtneps_pbh(v);
    else
        return _mm512_cvtepi32_epi16(bf16_lanes(v));
}

template <bool Native = false>
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

template <bool Native = false>
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

template <bool Native = false>
inline void store16(c10::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits<Native>(v));
}

template <bool Native = false>
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits<Native>(v)); }

// v as the storage type T holds it: rounded to bfloat16 and back, or unchanged for float32.
template <bool Native = false>
inline __m512 rounded(__m512 v, const float*) { return v; }

template <bool Native = false>
inline __m512 rounded(__m512 v, const c10::BFloat16*) { return widen(to_bf16_bits<Native>(v)); }

// exp(x): 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial for e^r (relative error about
// 2e-7); 0 below -87, infinity above 88.
inline __m512 exp16(__m512 x) {
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), tiny, _mm512_setzero_ps());
}

// tanh(x) as 1 - 2 / (1 + e^2x): -1 and 1 at the ends, where e^2x is 0 or past float's range.
inline __m512 tanh16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp16(_mm512_add_ps(x, x));
    return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(one, e)));
}

}  // namespace tailrace
