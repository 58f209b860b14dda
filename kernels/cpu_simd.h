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
//
// kernels/cpu_build.py folds this file's digest into the build flags, so editing it rebuilds the kernels
// (torch's extension builder tracks only the .cpp files).

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
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
#endif

}  // namespace minivllm_cpu_simd
