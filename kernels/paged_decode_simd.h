// paged_decode_simd.h: paged_decode_attention.cpp's vector code, one path per instruction-set level
// (that file's header has the algorithm; this one only how each level runs it).
//
//   dot, exp_shifted, axpy   one key at a time (run_generic's pieces): 16 lanes, 8 lanes, or plain
//   run_avx512<T, NC>        D = 16 * NC: rows widened once per chunk, 16 keys' sums at once (sum16),
//                            each query head's output in registers over the value rows (32 registers);
//                            in paged_decode_avx512.h
//   run_avx2<T, NC>          D = 8 * NC: the same passes on 8 lanes and 16 registers: 8 keys' sums at
//                            once (sum8x8), the output in slices of at most 8 registers; in
//                            paged_decode_avx2.h
//   run_simd<T>(a, D)        whichever of the two this build has, for D = 16, 32, ... 128; false (run
//                            the generic path) for other head dims or a build with neither
//
// Every path computes a (request, KV head) task from its own keys alone, in an order fixed by D and
// the context length: a row's bits never depend on the rows beside it (batch invariance).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace minivllm_paged_decode {

using namespace minivllm_cpu_simd;

template <typename T>
struct Raw {  // one call's tensors as pointers (contiguous), and their sizes
  const T *q, *k_cache, *v_cache;
  const int32_t* tables;
  const int64_t* lens;
  T* out;
  int64_t B, Hq, Hkv, block_size, max_blocks;
  float scale;
  int64_t window;
};

// q (fp32, D values) . k (D values)
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  s = sum8(acc);
#endif
  for (; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// s[0:L] = exp(s[0:L] - m), returning their sum. s - m <= 0, so only underflow needs care.
inline float exp_shifted(float* s, int64_t L, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  // exp16 (cpu_simd.h) keeps a NaN score NaN, so a NaN or infinite key reaches the output, as in torch's
  // softmax, instead of weighing 0.
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);  // exp8: exp16's bits on 8 lanes, NaN kept too
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = sum8(acc);
#endif
  for (; t < L; ++t) sum += (s[t] = std::exp(s[t] - m));
  return sum;
}

// o (fp32, D values) += p * v
template <typename T>
inline void axpy(float* o, float p, const T* v, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(o + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(o + d)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(o + d)));
#endif
  for (; d < D; ++d) o[d] += p * to_float(v[d]);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Keys whose rows are widened to fp32 together: 16 KB of them, so that every query head's walk over
// them reads L1, not L2 (with 256 keys of D = 64, 64 KB, the walks took half the kernel's time).
constexpr int64_t CHUNK_VALUES = 4096;

// fp32 pointers to `n` cache rows starting at key t0: the rows themselves for a float cache (read in
// place), widened copies in `scratch` for bf16.
template <typename T, int64_t D>
void fp32_rows(const T* cache, const int32_t* table, int64_t bs, int64_t token_stride, int64_t h, int64_t t0,
               int64_t n, float* scratch, const float** rows) {
  int64_t block = t0 / bs, offset = t0 % bs;  // walked, not divided per key (a 64-bit divide is ~15 cycles)
  for (int64_t i = 0; i < n; ++i, ++offset) {
    if (offset == bs) {
      ++block;
      offset = 0;
    }
    const T* src = cache + (int64_t(table[block]) * bs + offset) * token_stride + h * D;
    if constexpr (std::is_same<T, float>::value) {
      rows[i] = src;
    } else {
#if defined(__AVX512F__)
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(scratch + i * D + c, load16(src + c));
#else
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(scratch + i * D + c, load8(src + c));
#endif
      rows[i] = scratch + i * D;
    }
  }
}
#endif

// Defined in paged_decode_avx512.h / paged_decode_avx2.h (each includes this file; the .cpp includes all
// three), declared here so that the dispatch below can name them.
#if defined(__AVX512F__)
template <typename T, int NC>
void run_avx512(const Raw<T>& a);
#elif defined(__AVX2__) && defined(__FMA__)
template <typename T, int NC>
void run_avx2(const Raw<T>& a);
#endif

// Runs this build's vector path with D = 16 * K as a compile-time constant, trying K = 1 .. 8.
template <typename T, int K = 1>
bool run_simd(const Raw<T>& a, int64_t D) {
#if defined(__AVX512F__)
  if (D == 16 * K) return run_avx512<T, K>(a), true;
#elif defined(__AVX2__) && defined(__FMA__)
  if (D == 16 * K) return run_avx2<T, 2 * K>(a), true;
#else
  return false;
#endif
  if constexpr (K < 8) return run_simd<T, K + 1>(a, D);
  return false;
}

}  // namespace minivllm_paged_decode
