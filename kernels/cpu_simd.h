// cpu_simd.h: the small float32 / bfloat16 helpers the C++ CPU kernels share.
//
// A bfloat16 is the top 16 bits of a float32, so widening one is a shift, and narrowing one is a
// rounding of the low 16 bits away (to nearest, ties to even, as c10::BFloat16 and torch round).
//
//   to_float(v)      one value as float32
//   round_to<T>(v)   float32 -> T -> float32: v rounded as storing it in T would (nothing for float)
//   load16(p)        16 values from p, as float32 lanes                        (AVX-512)
//   round16<T>(v)    round_to<T> on 16 lanes                                   (AVX-512)
//   store16(p, v)    16 lanes into p, already rounded to p's type               (AVX-512)
//   exp16(x)         e^x on 16 lanes, relative error ~1e-7 (fp32's own)           (AVX-512)
//
// kernels/cpu_build.py folds this file's digest into the build flags, so editing it rebuilds the kernels
// (torch's extension builder tracks only the .cpp files).

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace minivllm_cpu_simd {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline float round_to(float v) { return static_cast<float>(T(v)); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // zero-extend each 16-bit value, shift it to the top half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Each lane rounded to the nearest bf16 (ties to even; NaN -> 0x7FC0, as c10::BFloat16), kept as fp32.
inline __m512 round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded,
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}
template <typename T>
inline __m512 round16(__m512 v) { return std::is_same<T, float>::value ? v : round_bf16(v); }

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {  // v already rounded: its top halves are the bf16s
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

// e^x = 2^n * e^r, n = round(x / ln 2), |r| <= ln2 / 2; e^r by its Taylor series to r^6 (relative error
// ~1e-7, fp32's own), 2^n applied exactly by vscalefps. x is clamped to [-87, 89] first: below, e^x is
// under fp32's normal range (returned as ~1e-38, not 0); above, 2^n overflows and the result is inf, as
// expf's. The clamps are max(lo, x) then min(hi, x), in that order of operands: vmaxps / vminps return
// their second operand when one is NaN, so a NaN stays NaN.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  const float c[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace minivllm_cpu_simd
