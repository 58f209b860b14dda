// paged_decode_simd.h: paged_decode_attention.cpp's vector code, one path per instruction-set level
// (that file's header has the algorithm; this one only how each level runs it).
//
//   dot, exp_shifted, axpy   one key at a time (run_generic's pieces): 16 lanes, 8 lanes, or plain
//   run_avx512<T, NC>        D = 16 * NC: rows widened once per chunk, 16 keys' sums at once (sum16),
//                            each query head's output in registers over the value rows (32 registers)
//   run_avx2<T, NC>          D = 8 * NC: the same passes on 8 lanes and 16 registers: 8 keys' sums at
//                            once (sum8x8), the output in slices of at most 8 registers
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

#if defined(__AVX512F__)
// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: each round halves the lanes that still hold
// partial sums and packs two vectors' partials into one (a transpose folded into adds), so 16 sums cost
// 31 shuffles and 15 adds instead of 16 horizontal reductions of 4 dependent steps each.
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: a[i] = v[2i] on 8 lanes, then v[2i+1] on 8 lanes
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: quarter j of b[i] is vector 4i + j on 4 lanes
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  // Within each quarter j: pairs of floats (vectors j and 4 + j, then 8 + j and 12 + j), then singles.
  const __m512 c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const __m512 c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
  const __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1))));
  // Lane 4j + m of d holds vector j + 4m's sum: put each in lane j + 4m.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

// max(s[0:L]), 16 lanes at a time (a scalar running max waits on itself every step)
inline float max16(const float* s, int64_t L) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float r = _mm512_reduce_max_ps(m);
  for (; t < L; ++t) r = std::max(r, s[t]);
  return r;
}

template <typename T, int NC>
void run_avx512(const Raw<T>& a) {
  const T *qp = a.q, *kc = a.k_cache, *vc = a.v_cache;
  const int32_t* tables = a.tables;
  const int64_t* lens = a.lens;
  T* op = a.out;
  const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, bs = a.block_size, max_blocks = a.max_blocks, window = a.window;
  const float scale = a.scale;
  constexpr int64_t D = 16 * NC, CHUNK = CHUNK_VALUES / D / 16 * 16;  // whole groups of 16 keys
  const int64_t G = Hq / Hkv, token_stride = Hkv * D;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * D), acc(G * D), denom(G), scores;
    std::vector<float> scratch(std::is_same<T, float>::value ? 0 : CHUNK * D);  // fp32 rows are read in place
    std::vector<const float*> rows(CHUNK);
    for (int64_t task = t0; task < t1; ++task) {
      // keys first .. lens[b] - 1: L of them (the window's, or all)
      const int64_t b = task / Hkv, h = task % Hkv, first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t L = lens[b] - first;
      const int32_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qp[(b * Hq + h * G + g) * D + d]) * scale;
      scores.resize(G * L);
      // pass 1: scores, 16 keys at a time per query head
      for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, L - c0);
        fp32_rows<T, D>(kc, table, bs, token_stride, h, first + c0, n, scratch.data(), rows.data());
        for (int64_t g = 0; g < G; ++g) {
          __m512 qv[NC];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qf.data() + g * D + 16 * c);
          for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t m = std::min<int64_t>(16, n - i0);
            __m512 part[16];
            for (int64_t i = 0; i < m; ++i) {
              __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(rows[i0 + i]));
              for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[i0 + i] + 16 * c), s);
              part[i] = s;
            }
            for (int64_t i = m; i < 16; ++i) part[i] = _mm512_setzero_ps();
            _mm512_mask_storeu_ps(scores.data() + g * L + c0 + i0, __mmask16((1u << m) - 1), sum16(part));
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        denom[g] = exp_shifted(s, L, max16(s, L));
      }
      // pass 2: each query head's output in registers while it walks a chunk's value rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, L - c0);
        fp32_rows<T, D>(vc, table, bs, token_stride, h, first + c0, n, scratch.data(), rows.data());
        for (int64_t g = 0; g < G; ++g) {
          // Two sets of sums, even and odd keys: an FMA waits ~4 cycles for the one before it in its
          // chain, so twice the chains keep the FMA units busy.
          __m512 o[NC], o2[NC];
          for (int c = 0; c < NC; ++c) {
            o[c] = _mm512_loadu_ps(acc.data() + g * D + 16 * c);
            o2[c] = _mm512_setzero_ps();
          }
          const float* p = scores.data() + g * L + c0;
          int64_t i = 0;
          for (; i + 2 <= n; i += 2) {
            const __m512 p0 = _mm512_set1_ps(p[i]), p1 = _mm512_set1_ps(p[i + 1]);
            for (int c = 0; c < NC; ++c) {
              o[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(rows[i] + 16 * c), o[c]);
              o2[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(rows[i + 1] + 16 * c), o2[c]);
            }
          }
          if (i < n) {
            const __m512 p0 = _mm512_set1_ps(p[i]);
            for (int c = 0; c < NC; ++c) o[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(rows[i] + 16 * c), o[c]);
          }
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc.data() + g * D + 16 * c, _mm512_add_ps(o[c], o2[c]));
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) op[(b * Hq + h * G + g) * D + d] = T(acc[g * D + d] * inv);
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX-512 path's passes on 8 lanes (16 registers, not 32). r[i] = the sum of v[i]'s 8 lanes, for 8
// vectors at once: two rounds of pairwise adds (hadd) leave each vector's low and high half-sums in the
// two 128-bit halves; one cross-half add finishes all 8.
inline __m256 sum8x8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // [v0..v3 low | v0..v3 high]
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// o[0:8W] += sum_i p[i] * rows[i][off : off + 8W]: W accumulators stay in registers while the keys go by
// (W <= 8 of the 16 registers; a head of D = 128 is walked as two slices).
template <int W>
inline void weigh_rows(float* o, const float* p, const float* const* rows, int64_t n, int64_t off) {
  __m256 a[W];
  for (int c = 0; c < W; ++c) a[c] = _mm256_loadu_ps(o + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(rows[i] + off + 8 * c), a[c]);
  }
  for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + 8 * c, a[c]);
}

template <typename T, int NC>
void run_avx2(const Raw<T>& a) {
  const T *qp = a.q, *kc = a.k_cache, *vc = a.v_cache;
  const int32_t* tables = a.tables;
  const int64_t* lens = a.lens;
  T* op = a.out;
  const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, bs = a.block_size, max_blocks = a.max_blocks, window = a.window;
  const float scale = a.scale;
  constexpr int64_t D = 8 * NC, CHUNK = CHUNK_VALUES / D / 8 * 8;  // whole groups of 8 keys
  const int64_t G = Hq / Hkv, token_stride = Hkv * D;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<float> scratch(std::is_same<T, float>::value ? 0 : CHUNK * D);  // fp32 rows are read in place
    std::vector<const float*> rows(CHUNK);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t L = lens[b] - first;
      const int32_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qp[(b * Hq + h * G + g) * D + d]) * scale;
      scores.resize(G * L);
      // pass 1: scores, 8 keys at a time per query head (a short last group repeats its last key, unstored)
      for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, L - c0);
        fp32_rows<T, D>(kc, table, bs, token_stride, h, first + c0, n, scratch.data(), rows.data());
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i0 = 0; i0 < n; i0 += 8) {
            const int64_t m = std::min<int64_t>(8, n - i0);
            const float* r[8];
            __m256 part[8];
            for (int64_t i = 0; i < 8; ++i) r[i] = rows[i0 + std::min(i, m - 1)], part[i] = _mm256_setzero_ps();
            for (int c = 0; c < NC; ++c) {  // 8 independent chains: the FMA latency is hidden
              const __m256 qv = _mm256_loadu_ps(qf.data() + g * D + 8 * c);
              for (int i = 0; i < 8; ++i) part[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[i] + 8 * c), part[i]);
            }
            alignas(32) float sums[8];
            _mm256_store_ps(sums, sum8x8(part));
            std::copy(sums, sums + m, scores.data() + g * L + c0 + i0);
          }
      }
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        denom[g] = exp_shifted(s, L, *std::max_element(s, s + L));
      }
      // pass 2: each query head's output (or a slice of 8 registers of it) in registers over a chunk's rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, L - c0);
        fp32_rows<T, D>(vc, table, bs, token_stride, h, first + c0, n, scratch.data(), rows.data());
        for (int64_t g = 0; g < G; ++g) {
          const float* p = scores.data() + g * L + c0;
          weigh_rows<std::min(NC, 8)>(acc.data() + g * D, p, rows.data(), n, 0);
          if constexpr (NC > 8) weigh_rows<NC - 8>(acc.data() + g * D + 64, p, rows.data(), n, 64);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) op[(b * Hq + h * G + g) * D + d] = T(acc[g * D + d] * inv);
      }
    }
  });
}
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
