// greedy_argmax: each row's argmax, read straight from the model's logits (see greedy_argmax.py for why).
//
//   logits (S, V) bfloat16 or float32, rows contiguous     ->  out (S,) int64
//   out[s] = the first index of row s's maximum, or of its first NaN if it has one (torch.argmax's rule)
//
// One pass over a row, 16 lanes at a time. Each lane keeps the largest value it has seen and where:
//     for i in 0, 16, 32, ...:  v = x[i .. i+16]  (bf16 -> fp32: the bf16 is the top half of an fp32)
//                               if v has a NaN: return i + its first NaN lane
//                               where v > best:  best = v, at = i + lane      (strictly: ties keep the first)
//     m = max over lanes of best;  out = min over lanes with best == m of at  (the first index of the max)
//     the last V % 16 values: one by one, the same rules
// (The loop keeps two such sets, for even and odd chunks, merged at the end: independent work per chunk.)
// Rows are split across threads (at::parallel_for) when there are enough of them.
// Paths: AVX-512 (16 lanes), AVX2 + FMA (8 lanes, the same rules), the plain loop elsewhere; each returns
// torch.argmax's index exactly (an index, not a sum: nothing to round).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_simd.h"

namespace {

using namespace minivllm_cpu_simd;

// The scalar rules, from index `start` on, against the best value so far (`best` at `at`).
template <typename T>
int64_t finish_row(const T* x, int64_t start, int64_t V, float best, int64_t at) {
  for (int64_t i = start; i < V; ++i) {
    const float v = to_float(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) best = v, at = i;
  }
  return at;
}

template <typename T>
int64_t row_argmax(const T* x, int64_t V) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
#if defined(__AVX512F__)
  if (V >= 16) {
    // Two independent sets of lanes (even and odd 16-value chunks), so one chunk's compare does not
    // wait for the previous one's: a single chain ran at about half the speed.
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 best0 = minus_inf, best1 = minus_inf;
    __m512i at0 = _mm512_setzero_si512(), at1 = _mm512_setzero_si512();  // int32 lanes: V < 2^31
    __m512i lane0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i lane1 = _mm512_add_epi32(lane0, _mm512_set1_epi32(16));
    const __m512i step = _mm512_set1_epi32(32);
    for (; i + 32 <= V; i += 32) {
      const __m512 v0 = load16(x + i), v1 = load16(x + i + 16);
      const __mmask16 nan0 = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q), nan1 = _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
      if (nan0 | nan1) return nan0 ? i + __builtin_ctz(nan0) : i + 16 + __builtin_ctz(nan1);
      const __mmask16 gt0 = _mm512_cmp_ps_mask(v0, best0, _CMP_GT_OQ), gt1 = _mm512_cmp_ps_mask(v1, best1, _CMP_GT_OQ);
      best0 = _mm512_mask_mov_ps(best0, gt0, v0);
      at0 = _mm512_mask_mov_epi32(at0, gt0, lane0);
      best1 = _mm512_mask_mov_ps(best1, gt1, v1);
      at1 = _mm512_mask_mov_epi32(at1, gt1, lane1);
      lane0 = _mm512_add_epi32(lane0, step);
      lane1 = _mm512_add_epi32(lane1, step);
    }
    if (i + 16 <= V) {  // one chunk left over: into the first set
      const __m512 v = load16(x + i);
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      if (nan) return i + __builtin_ctz(nan);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best0, _CMP_GT_OQ);
      best0 = _mm512_mask_mov_ps(best0, gt, v);
      at0 = _mm512_mask_mov_epi32(at0, gt, lane0);
      i += 16;
    }
    // merge the sets lane by lane: the larger value, or on a tie the earlier index
    const __mmask16 take = _mm512_cmp_ps_mask(best1, best0, _CMP_GT_OQ) |
                           (_mm512_cmp_ps_mask(best1, best0, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(at1, at0));
    best0 = _mm512_mask_mov_ps(best0, take, best1);
    at0 = _mm512_mask_mov_epi32(at0, take, at1);
    best = _mm512_reduce_max_ps(best0);
    const __mmask16 is_max = _mm512_cmp_ps_mask(best0, _mm512_set1_ps(best), _CMP_EQ_OQ);
    // lanes that never saw a value above -inf keep index 0, which is right: then the max is -inf, first at 0
    at = _mm512_mask_reduce_min_epi32(is_max, at0);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (V >= 8) {
    // The same two sets on 8 lanes; AVX2 has no mask registers, so a compare gives an all-ones lane
    // mask that blendv selects by, and movemask turns into bits for the NaN test.
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 best0 = minus_inf, best1 = minus_inf;
    __m256i at0 = _mm256_setzero_si256(), at1 = _mm256_setzero_si256();  // int32 lanes: V < 2^31
    __m256i lane0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lane1 = _mm256_add_epi32(lane0, _mm256_set1_epi32(8));
    auto take = [](__m256 v, __m256 gt, __m256& best, __m256i& at, __m256i lane) {
      best = _mm256_blendv_ps(best, v, gt);
      at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(lane), gt));
    };
    for (; i + 16 <= V; i += 16) {
      const __m256 v0 = load8(x + i), v1 = load8(x + i + 8);
      const int nan0 = _mm256_movemask_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q));
      const int nan1 = _mm256_movemask_ps(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));
      if (nan0 | nan1) return nan0 ? i + __builtin_ctz(nan0) : i + 8 + __builtin_ctz(nan1);
      take(v0, _mm256_cmp_ps(v0, best0, _CMP_GT_OQ), best0, at0, lane0);
      take(v1, _mm256_cmp_ps(v1, best1, _CMP_GT_OQ), best1, at1, lane1);
      lane0 = _mm256_add_epi32(lane0, _mm256_set1_epi32(16));
      lane1 = _mm256_add_epi32(lane1, _mm256_set1_epi32(16));
    }
    if (i + 8 <= V) {  // one chunk left over: into the first set
      const __m256 v = load8(x + i);
      const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      if (nan) return i + __builtin_ctz(nan);
      take(v, _mm256_cmp_ps(v, best0, _CMP_GT_OQ), best0, at0, lane0);
      i += 8;
    }
    // merge the sets lane by lane (the larger value, or on a tie the earlier index), then the 8 lanes
    const __m256 tie = _mm256_and_ps(_mm256_cmp_ps(best1, best0, _CMP_EQ_OQ),
                                     _mm256_castsi256_ps(_mm256_cmpgt_epi32(at0, at1)));
    take(best1, _mm256_or_ps(_mm256_cmp_ps(best1, best0, _CMP_GT_OQ), tie), best0, at0, at1);
    alignas(32) float bests[8];
    alignas(32) int32_t ats[8];
    _mm256_store_ps(bests, best0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ats), at0);
    best = bests[0], at = ats[0];
    for (int l = 1; l < 8; ++l)
      if (bests[l] > best || (bests[l] == best && ats[l] < at)) best = bests[l], at = ats[l];
  }
#endif
  if (i == 0) {  // no vector pass: start from the first value
    best = to_float(x[0]);
    if (std::isnan(best)) return 0;
    i = 1;
  }
  return finish_row(x, i, V, best, at);
}

template <typename T>
void run(const at::Tensor& logits, at::Tensor& out) {
  const int64_t S = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  const T* x = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  // A thread gets at least ~256K logits (8 rows of a 32K vocabulary): waking threads for less costs
  // more than the pass itself (and made the warm-up's timing, on 2 busy cores, swing from 0.6x to 7x).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / V);
  at::parallel_for(0, S, grain, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) o[s] = row_argmax(x + s * stride, V);
  });
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "greedy_argmax: logits must be (S, V) with V > 0 and each row contiguous");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "greedy_argmax: V must be below 2^31");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat) {
    run<float>(logits, out);
  } else if (logits.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(logits, out);
  } else {
    TORCH_CHECK(false, "greedy_argmax: logits must be float32 or bfloat16, not ", logits.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("greedy_argmax", &greedy_argmax); }
