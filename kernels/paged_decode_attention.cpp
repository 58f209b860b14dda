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
// With AVX2 + FMA (an AVX2 laptop, -march=x86-64-v3) `run_avx2` does the same on 8 lanes (the two
// paths: paged_decode_avx512.h, paged_decode_avx2.h). Other head dims, or a build with neither, take
// `run_generic`: the same passes, key by key (its pieces vectorised where the build allows).

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
#include "paged_decode_simd.h"
#include "paged_decode_avx512.h"  // run_avx512 (an AVX-512 build)
#include "paged_decode_avx2.h"    // run_avx2 (an AVX2 + FMA build without AVX-512)

namespace {

using namespace minivllm_cpu_simd;
using namespace minivllm_paged_decode;

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
  const Raw<T> raw{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_tables.data_ptr<int32_t>(),
                   context_lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(2),
                   k_cache.size(1), block_tables.size(1), float(scale), window};
  if (!run_simd<T>(raw, q.size(2))) run_generic<T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
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
