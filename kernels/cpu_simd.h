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
//   load8, round8<T>, store8, exp8, sum8                the same on 8 lanes      (AVX2 + FMA)
//
// The 8-lane helpers give each lane the very bits the 16-lane ones give it (the same operations in the
// same order), so a kernel's AVX2 path and its AVX-512 path agree lane for lane wherever they only
// differ in width. A kernel uses the 16-lane helpers on an AVX-512 build, the 8-lane ones on an AVX2 +
// FMA build (-march=x86-64-v3: an AVX2 laptop), and its plain loop on anything else.
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

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // zero-extend each 16-bit value, shift it to the top half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// round_bf16 on 8 lanes: the same integer rounding, NaN -> 0x7FC0 by a blend on the unordered compare.
inline __m256 round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
  return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
template <typename T>
inline __m256 round8(__m256 v) { return std::is_same<T, float>::value ? v : round_bf16_8(v); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // v already rounded: pack the top halves (no saturation
  // can bite: the top half, shifted down, is below 2^16), then undo packus's lane interleave
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// 2^n for integral n in [-126, 128] (n as floats) as two factors 2^(n/2) and 2^(n - n/2), each built in
// the exponent bits: one 2^n cannot hold n = 128 (its exponent field would be 255: inf), yet p * 2^128
// is finite for p < 1. p * a * b then rounds once, as vscalefps's p * 2^n does: the first product is exact.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));  // NaN stays NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  const float c[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

// The sum of an 8-lane vector's lanes: halves, then quarters, then pairs.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace minivllm_cpu_simd
