// paged_decode_avx512.h: paged_decode_attention's AVX-512 path (32 zmm registers): run_avx512 for
// D = 16 * NC, with sum16 (16 keys' dot products added up at once) and max16. The algorithm is in
// paged_decode_attention.cpp's header; the pieces every path shares (Raw, fp32_rows, exp_shifted) and the
// dispatch (run_simd) in paged_decode_simd.h.

#pragma once

#include "paged_decode_simd.h"

namespace minivllm_paged_decode {

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

}  // namespace minivllm_paged_decode
