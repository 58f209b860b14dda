// skinny_gemm: y = x W^T + b for a few rows of x, on CPU (see skinny_gemm.py for the why).
//
// The weight arrives pre-laid-out by `pack_skinny_weight` in "column blocks" of 16 outputs:
//
//   fp32:  Wp[N/16][K][16]        Wp[b][k][j]    = W[16b + j][k]
//   bf16:  Wp[N/16][K/2][16][2]   Wp[b][p][j][i] = W[16b + j][2p + i]   (pairs along k, for vdpbf16ps)
//
// so one block is one contiguous run of memory, read front to back exactly once per call, and each
// 64-byte load feeds 16 output lanes at once. With W row-major instead, every output would end in a
// horizontal sum of a 16-lane vector, which for K = 576 costs as much as the loop that fills it.
//
// Per block and a group of MB rows of x, for each k (or k pair):
//   acc[m] += Wp[b][k][0:16] * broadcast(x[m][k])          (fp32, one FMA)
//   acc[m] += dot-pairs(Wp[b][p][0:16][0:2], broadcast(x[m][2p:2p+2]))   (bf16, one vdpbf16ps)
// NB blocks are walked side by side so NB * MB accumulators are independent (hiding FMA latency),
// and a W vector loaded once serves all MB rows: the weight streams once per call for up to MB rows.
//
// Built by kernels/cpu_build.py with -march=native (on the machine that runs it), one path per level:
//   AVX-512            16 lanes a register; bf16 by vdpbf16ps where the CPU has AVX512_BF16, else widened
//   AVX2 + FMA         the same sums on two 8-lane halves of each block (x86-64-v3: an AVX2 laptop)
//   portable           plain loops, one explicit fused multiply-add per term where the target has one
//
// Every output is ONE chain of sums over k, in k's order, whatever path and however many rows share the
// call: acc = fma(W[k], x[k], acc) for k = 0, 1, ... (bf16 without vdpbf16ps: k even, then k odd, as
// widened pairs). So a row's bits never depend on the rows beside it (batch invariance relies on it), and
// the fp32 result is the same on all three paths. The portable loop once left the `a * b + c` to the
// compiler: at -march=x86-64-v3 it contracted it into an FMA for groups of 2-4 rows and not for a row
// alone, and a row got other bits when other rows shared its call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"

namespace {

constexpr int64_t kLanes = 16;  // outputs per column block
constexpr int kBlocks = 4;      // NB: column blocks walked side by side
constexpr int kRows = 4;        // MB: rows of x sharing each loaded W vector

using namespace minivllm_cpu_simd;

// acc + a * b with one rounding where the target has a fused multiply-add (what the SIMD paths do),
// written out so the compiler's choice to contract or not cannot differ between instantiations.
inline float madd(float a, float b, float acc) {
#if defined(FP_FAST_FMAF)
  return std::fma(a, b, acc);
#else
  return a * b + acc;  // no FMA instruction on this target: nothing the compiler could contract it into
#endif
}

// acc[j][m][0:16] = sum over k of Wp[block0 + j][k][0:16] * x[m][k], the portable version.
template <typename T, int NB, int MB>
void blocks_portable(const T* x, int64_t K, const T* wp, int64_t block0, float (*acc)[MB][kLanes]) {
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      for (int64_t l = 0; l < kLanes; ++l) acc[j][m][l] = 0.f;
  for (int j = 0; j < NB; ++j) {
    const T* w = wp + (block0 + j) * K * kLanes;
    for (int64_t k = 0; k < K; ++k)
      for (int m = 0; m < MB; ++m) {
        const float xv = to_float(x[m * K + k]);
        for (int64_t l = 0; l < kLanes; ++l) {
          // the bf16 layout pairs k: element (k, l) sits at ((k / 2) * 16 + l) * 2 + k % 2
          const int64_t at = std::is_same_v<T, float> ? k * kLanes + l : ((k / 2) * kLanes + l) * 2 + k % 2;
          acc[j][m][l] = madd(to_float(w[at]), xv, acc[j][m][l]);
        }
      }
  }
}

#if defined(__AVX512F__)
template <typename T, int NB, int MB>
void blocks_avx512(const T* x, int64_t K, const T* wp, int64_t block0, float (*out)[MB][kLanes]) {
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  const T* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = wp + (block0 + j) * K * kLanes;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < K; ++k) {
      __m512 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NB; ++j) {
        const __m512 wv = _mm512_loadu_ps(w[j] + k * kLanes);
        for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_fmadd_ps(wv, xv[m], acc[j][m]);
      }
    }
  } else {
    for (int64_t p = 0; p < K / 2; ++p) {
      __m512i xv[MB];  // the pair x[m][2p], x[m][2p+1] in every 32-bit lane
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + 2 * p, sizeof pair);
        xv[m] = _mm512_set1_epi32(pair);
      }
      for (int j = 0; j < NB; ++j) {
        const __m512i wv = _mm512_loadu_si512(w[j] + p * kLanes * 2);
        for (int m = 0; m < MB; ++m) {
#if defined(__AVX512BF16__)
          acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)wv, (__m512bh)xv[m]);
#else  // widen bf16 to fp32 (a bf16 is the top half of an fp32): even k in the low halves, odd in the high
          const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
          const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(wv, _mm512_set1_epi32(0xFFFF0000)));
          const __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(xv[m], 16));
          const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(xv[m], _mm512_set1_epi32(0xFFFF0000)));
          acc[j][m] = _mm512_fmadd_ps(w_odd, x_odd, _mm512_fmadd_ps(w_even, x_even, acc[j][m]));
#endif
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out[j][m], acc[j][m]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX-512 path's sums on 8-lane halves: lanes 0-7 and 8-15 of each block are two chains each. AVX2 has
// 16 registers, not 32, so JB blocks go side by side (JB * MB * 2 <= 8 accumulators, enough to hide the
// FMA latency) instead of all NB: the grouping changes which chains run together, never a chain's order.
template <typename T, int NB, int MB>
void blocks_avx2(const T* x, int64_t K, const T* wp, int64_t block0, float (*out)[MB][kLanes]) {
  constexpr int JB = std::max(1, std::min(NB, 4 / MB));
  static_assert(NB % JB == 0, "the blocks go JB at a time");
  for (int j0 = 0; j0 < NB; j0 += JB) {
    __m256 acc[JB][MB][2];
    for (int j = 0; j < JB; ++j)
      for (int m = 0; m < MB; ++m) acc[j][m][0] = acc[j][m][1] = _mm256_setzero_ps();
    const T* w[JB];
    for (int j = 0; j < JB; ++j) w[j] = wp + (block0 + j0 + j) * K * kLanes;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t k = 0; k < K; ++k) {
        __m256 xv[MB];
        for (int m = 0; m < MB; ++m) xv[m] = _mm256_set1_ps(x[m * K + k]);
        for (int j = 0; j < JB; ++j)
          for (int half = 0; half < 2; ++half) {
            const __m256 wv = _mm256_loadu_ps(w[j] + k * kLanes + 8 * half);
            for (int m = 0; m < MB; ++m) acc[j][m][half] = _mm256_fmadd_ps(wv, xv[m], acc[j][m][half]);
          }
      }
    } else {  // bf16 widened by a shift, as the AVX-512 path without AVX512_BF16: even k, then odd k
      const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
      for (int64_t p = 0; p < K / 2; ++p) {
        __m256 x_even[MB], x_odd[MB];  // x[m][2p] and x[m][2p+1] in every lane
        for (int m = 0; m < MB; ++m) {
          int32_t pair;
          std::memcpy(&pair, x + m * K + 2 * p, sizeof pair);
          const __m256i xv = _mm256_set1_epi32(pair);
          x_even[m] = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
          x_odd[m] = _mm256_castsi256_ps(_mm256_and_si256(xv, high));
        }
        for (int j = 0; j < JB; ++j)
          for (int half = 0; half < 2; ++half) {  // 8 pairs: lanes 8 * half ... 8 * half + 7
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + (p * kLanes + 8 * half) * 2));
            const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
            const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
            for (int m = 0; m < MB; ++m)
              acc[j][m][half] = _mm256_fmadd_ps(w_odd, x_odd[m], _mm256_fmadd_ps(w_even, x_even[m], acc[j][m][half]));
          }
      }
    }
    for (int j = 0; j < JB; ++j)
      for (int m = 0; m < MB; ++m)
        for (int half = 0; half < 2; ++half) _mm256_storeu_ps(out[j0 + j][m] + 8 * half, acc[j][m][half]);
  }
}
#endif

// y[m][16 * (block0 + j) + l] for NB blocks and MB rows, bias added, rounded to T; columns >= N are padding.
template <typename T, int NB, int MB>
void blocks(const T* x, int64_t K, const T* wp, const T* bias, T* y, int64_t N, int64_t block0) {
  float acc[NB][MB][kLanes];
#if defined(__AVX512F__)
  blocks_avx512<T, NB, MB>(x, K, wp, block0, acc);
#elif defined(__AVX2__) && defined(__FMA__)
  blocks_avx2<T, NB, MB>(x, K, wp, block0, acc);
#else
  blocks_portable<T, NB, MB>(x, K, wp, block0, acc);
#endif
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t n = (block0 + j) * kLanes + l;
        if (n < N) y[m * N + n] = T(acc[j][m][l] + (bias ? to_float(bias[n]) : 0.f));
      }
}

template <typename T, int NB>
void rows_of_x(const T* x, int64_t M, int64_t K, const T* wp, const T* bias, T* y, int64_t N, int64_t block0) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) blocks<T, NB, kRows>(x + m * K, K, wp, bias, y + m * N, N, block0);
  switch (M - m) {  // the last 1-3 rows
    case 1: blocks<T, NB, 1>(x + m * K, K, wp, bias, y + m * N, N, block0); break;
    case 2: blocks<T, NB, 2>(x + m * K, K, wp, bias, y + m * N, N, block0); break;
    case 3: blocks<T, NB, 3>(x + m * K, K, wp, bias, y + m * N, N, block0); break;
    default: break;
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& wp, const T* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), n_blocks = wp.size(0);
  const T* xp = x.data_ptr<T>();
  const T* w = wp.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Threads split the groups of column blocks: each reads (and writes) its own share. A task of at
  // least ~64 KB of weight keeps the start-up cost of a thread small next to its work; a small
  // weight (576 x 576 bf16: 9 groups of 72 KB) still spreads over up to 9 threads.
  const int64_t groups = (n_blocks + kBlocks - 1) / kBlocks;
  const int64_t group_bytes = kBlocks * kLanes * K * int64_t(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(1, group_bytes));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * kBlocks;
      if (b + kBlocks <= n_blocks) {
        rows_of_x<T, kBlocks>(xp, M, K, w, bias, yp, N, b);
      } else {
        for (int64_t bb = b; bb < n_blocks; ++bb) rows_of_x<T, 1>(xp, M, K, w, bias, yp, N, bb);
      }
    }
  });
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "skinny_gemm: x must be a 2-D CPU tensor (rows, in)");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "skinny_gemm: x and the weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_gemm: float32 or bfloat16 only");
  const int64_t layout_dims = x.scalar_type() == at::kFloat ? 3 : 4;  // (blocks, in, 16) / (blocks, in/2, 16, 2)
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == layout_dims &&
                  packed.size(0) == (out_features + kLanes - 1) / kLanes,
              "skinny_gemm: the weight must come from pack_skinny_weight of an (out_features, in) weight");
  at::Tensor xc = x.contiguous();
  TORCH_CHECK(packed.numel() == packed.size(0) * kLanes * xc.size(1),
              "skinny_gemm: x has ", xc.size(1), " features, the packed weight another count");
  at::Tensor b = bias ? bias->to(x.scalar_type()).contiguous() : at::Tensor();  // alive until we return
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.numel() == out_features),
              "skinny_gemm: the bias must be (out_features,)");
  at::Tensor y = at::empty({xc.size(0), out_features}, x.options());
  if (x.scalar_type() == at::kFloat) {
    run<float>(xc, packed, b.defined() ? b.data_ptr<float>() : nullptr, y);
  } else {
    TORCH_CHECK(xc.size(1) % 2 == 0, "skinny_gemm: bfloat16 needs an even in_features");
    run<c10::BFloat16>(xc, packed, b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, y);
  }
  return y;
}

}  // namespace

// torch.ops.minivllm_cpu.skinny_gemm, with paged_decode_attention.cpp (kernels/cpu_build.py builds both as
// one extension); the tests build the other code paths under other library names
#ifndef MINIVLLM_CPU_LIBRARY
#define MINIVLLM_CPU_LIBRARY minivllm_cpu
#endif
TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) {
  m.def("skinny_gemm(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("skinny_gemm", &skinny_gemm); }
