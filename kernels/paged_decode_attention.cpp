// paged_decode_attention: attention for decode rows (one query token per request), reading K/V where
// they lie in the paged cache (see paged_decode_attention.py for the why).
//
//   q            (B, Hq, D)                   one query token per request
//   k/v cache    (num_blocks, block_size, Hkv, D)
//   block_tables (B, max_blocks) int32        the request's blocks, in order
//   context_lens (B,) int64                   keys to attend to (the query's own included)
//   window       int                          > 0: only the last `window` of those keys (a sliding-window
//                                             layer); their blocks are the only ones read, so the table's
//                                             entries before them may be anything in the cache
//   out          (B, Hq, D)
//
// One task per (request b, KV head h): the G = Hq / Hkv query heads that share KV head h are done
// together, so each key and value row is read once for all of them.
//   pass 1: s[g][t] = scale * q[b][hG+g] . K[t]           for every key t, walking the block table
//   softmax over t, per g (max, exp, sum): the scores are few (G x context), so they sit in a buffer
//   pass 2: o[g] = sum_t p[g][t] V[t] / sum_t p[g][t]
// K[t] is one contiguous run of D values (cache[block][t % block_size][h]).
//
// With AVX-512 and D a multiple of 16 up to 128 (`run_avx512`, D/16 a compile-time constant, so a row's
// 16-value pieces and a head's output sit in registers), the work per key is cut three ways:
//   * a bf16 K or V row is widened to fp32 once, into a scratch buffer, not once per query head;
//   * a dot product's 16 partial sums are not added up one key at a time (a chain of 4 dependent
//     shuffles each): 16 keys' sums are added up together by `sum16`, a transpose folded into adds;
//   * pass 2 keeps each query head's output in registers while it walks the keys.
// Timed against `run_generic` in one process on 2 AMD EPYC (Zen 4) cores: 1.3-1.7x in bf16, 1.8-2.1x in
// fp32, over batches of 1-32 requests, contexts 16-1024 and head dims 32-128.
// Keys go in chunks of ~16 KB of widened rows, so the scratch stays in L1 however long the context is.
// Other head dims (or CPUs without AVX-512) take `run_generic`: the same passes, key by key.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

using namespace minivllm_cpu_simd;

// q (fp32, D values) . k (D values)
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  s = _mm512_reduce_add_ps(acc);
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
#endif
  for (; d < D; ++d) o[d] += p * to_float(v[d]);
}

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

// Keys whose rows are widened to fp32 together: 16 KB of them, so that every query head's walk over
// them reads L1, not L2 (with 256 keys of D = 64, 64 KB, the walks took half the kernel's time).
constexpr int64_t CHUNK_VALUES = 4096;

// max(s[0:L]), 16 lanes at a time (a scalar running max waits on itself every step)
inline float max16(const float* s, int64_t L) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float r = _mm512_reduce_max_ps(m);
  for (; t < L; ++t) r = std::max(r, s[t]);
  return r;
}

// fp32 pointers to `n` cache rows starting at key t0: the rows themselves for a float cache (read in
// place), widened copies in `scratch` for bf16.
template <typename T, int NC>
void fp32_rows(const T* cache, const int32_t* table, int64_t bs, int64_t token_stride, int64_t h, int64_t t0,
               int64_t n, float* scratch, const float** rows) {
  constexpr int64_t D = 16 * NC;
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
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(scratch + i * D + 16 * c, load16(src + 16 * c));
      rows[i] = scratch + i * D;
    }
  }
}

template <typename T, int NC>
void run_avx512(const T* qp, const T* kc, const T* vc, const int32_t* tables, const int64_t* lens, T* op,
                int64_t B, int64_t Hq, int64_t Hkv, int64_t bs, int64_t max_blocks, float scale, int64_t window) {
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
        fp32_rows<T, NC>(kc, table, bs, token_stride, h, first + c0, n, scratch.data(), rows.data());
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
        fp32_rows<T, NC>(vc, table, bs, token_stride, h, first + c0, n, scratch.data(), rows.data());
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

template <typename T>
void run_generic(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                 at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t token_stride = Hkv * D;  // between two keys of one block, for one head
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t L = lens[b] - first;  // keys first .. lens[b] - 1
      const int32_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qp[(b * Hq + h * G + g) * D + d]) * float(scale);
      scores.resize(G * L);
      // pass 1: scores, one key row at a time
      for (int64_t i = 0; i < L; ++i) {
        const int64_t t = first + i;
        const T* k = kc + (int64_t(table[t / bs]) * bs + t % bs) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + i] = dot(qf.data() + g * D, k, D);
      }
      // softmax numerators per query head; the denominators divide at the end
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        denom[g] = exp_shifted(s, L, *std::max_element(s, s + L));
      }
      // pass 2: weighted sum of the value rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t t = first + i;
        const T* v = vc + (int64_t(table[t / bs]) * bs + t % bs) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, scores[g * L + i], v, D);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) op[(b * Hq + h * G + g) * D + d] = T(acc[g * D + d] / denom[g]);
    }
  });
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& context_lens, double scale, int64_t window, at::Tensor& out) {
#if defined(__AVX512F__)
  const int64_t D = q.size(2);
  if (D % 16 == 0 && D <= 128) {
    const T* qp = q.data_ptr<T>();
    const T* kc = k_cache.data_ptr<T>();
    const T* vc = v_cache.data_ptr<T>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    T* op = out.data_ptr<T>();
    const int64_t B = q.size(0), Hq = q.size(1), Hkv = k_cache.size(2), bs = k_cache.size(1);
    const int64_t mb = block_tables.size(1);
    switch (D / 16) {
      case 1: return run_avx512<T, 1>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 2: return run_avx512<T, 2>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 3: return run_avx512<T, 3>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 4: return run_avx512<T, 4>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 5: return run_avx512<T, 5>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 6: return run_avx512<T, 6>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 7: return run_avx512<T, 7>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
      case 8: return run_avx512<T, 8>(qp, kc, vc, tables, lens, op, B, Hq, Hkv, bs, mb, float(scale), window);
    }
  }
#endif
  run_generic<T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q (B, Hq, D), caches (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head dims differ, or Hq is not a multiple of Hkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables int32, context_lens int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode_attention: one block table and one context length per query row");
  at::Tensor qc = q.contiguous(), bt = block_tables.contiguous(), cl = context_lens.contiguous();
  const int64_t cap = bt.size(1) * k_cache.size(1);
  const int64_t* lens = cl.data_ptr<int64_t>();
  const int32_t* tables = bt.data_ptr<int32_t>();
  for (int64_t b = 0; b < cl.size(0); ++b) {  // nothing is read outside the cache
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= cap, "paged_decode_attention: context length ", lens[b],
                " outside 1..", cap, " (block table width x block size)");
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;  // blocks before it: unread
    for (int64_t i = first / k_cache.size(1); i < (lens[b] + k_cache.size(1) - 1) / k_cache.size(1); ++i) {
      const int32_t block = tables[b * bt.size(1) + i];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "paged_decode_attention: block ", block,
                  " of row ", b, " is not in the cache");
    }
  }
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat) run<float>(qc, k_cache, v_cache, bt, cl, scale, window, out);
  else if (q.scalar_type() == at::kBFloat16) run<c10::BFloat16>(qc, k_cache, v_cache, bt, cl, scale, window, out);
  else TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  return out;
}

}  // namespace

// torch.ops.minivllm_cpu.*, with skinny_gemm.cpp (kernels/cpu_build.py builds both as one extension)
#ifndef MINIVLLM_CPU_LIBRARY
#define MINIVLLM_CPU_LIBRARY minivllm_cpu
#endif
TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0) -> Tensor");
}
TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
