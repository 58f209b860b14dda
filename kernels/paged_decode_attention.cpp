// paged_decode_attention: attention for decode rows (one query token per request), reading K/V where
// they lie in the paged cache (see paged_decode_attention.py for the why).
//
//   q            (B, Hq, D)                   one query token per request
//   k/v cache    (num_blocks, block_size, Hkv, D)
//   block_tables (B, max_blocks) int32        the request's blocks, in order
//   context_lens (B,) int64                   keys to attend to (the query's own included)
//   out          (B, Hq, D)
//
// One task per (request b, KV head h): the G = Hq / Hkv query heads that share KV head h are done
// together, so each key and value row is read once for all of them.
//   pass 1: s[g][t] = scale * q[b][hG+g] . K[t]           for every key t, walking the block table
//   softmax over t, per g (max, exp, sum): the scores are few (G x context), so they sit in a buffer
//   pass 2: o[g] = sum_t p[g][t] V[t] / sum_t p[g][t]
// K[t] is one contiguous run of D values (cache[block][t % block_size][h]), so a dot product is a few
// vector FMAs and one horizontal sum; with D = 64 that is cheap next to reading the row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // a bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif

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
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2; exp(r) by its Taylor series to r^6
  // (relative error ~1e-7, fp32's own), 2^n applied exactly by vscalefps.
  const __m512 mv = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.0f), log2e = _mm512_set1_ps(1.44269504f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const float c[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m512 acc = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv), lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, x));
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    const __m512 e = _mm512_scalef_ps(p, n);
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

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& context_lens, double scale, at::Tensor& out) {
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
      const int64_t b = task / Hkv, h = task % Hkv, L = lens[b];
      const int32_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qp[(b * Hq + h * G + g) * D + d]) * float(scale);
      scores.resize(G * L);
      // pass 1: scores, one key row at a time
      for (int64_t t = 0; t < L; ++t) {
        const T* k = kc + (int64_t(table[t / bs]) * bs + t % bs) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qf.data() + g * D, k, D);
      }
      // softmax numerators per query head; the denominators divide at the end
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        denom[g] = exp_shifted(s, L, *std::max_element(s, s + L));
      }
      // pass 2: weighted sum of the value rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* v = vc + (int64_t(table[t / bs]) * bs + t % bs) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, scores[g * L + t], v, D);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) op[(b * Hq + h * G + g) * D + d] = T(acc[g * D + d] / denom[g]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
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
    for (int64_t i = 0; i < (lens[b] + k_cache.size(1) - 1) / k_cache.size(1); ++i) {
      const int32_t block = tables[b * bt.size(1) + i];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "paged_decode_attention: block ", block,
                  " of row ", b, " is not in the cache");
    }
  }
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat) run<float>(qc, k_cache, v_cache, bt, cl, scale, out);
  else if (q.scalar_type() == at::kBFloat16) run<c10::BFloat16>(qc, k_cache, v_cache, bt, cl, scale, out);
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
        "Tensor context_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
