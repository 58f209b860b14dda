// paged_decode_avx2.h: paged_decode_attention's AVX2 + FMA path (16 ymm registers, an AVX2 laptop):
// run_avx2 for D = 8 * NC, with sum8x8 (8 keys' dot products added up at once) and weigh_rows (the output
// in slices of at most 8 registers). Shared pieces and the dispatch (run_simd) are in paged_decode_simd.h.

#pragma once

#include "paged_decode_simd.h"

namespace minivllm_paged_decode {

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

}  // namespace minivllm_paged_decode
