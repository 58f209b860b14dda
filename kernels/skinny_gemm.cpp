// skinny_gemm: y = x W^T + b for a few rows of x, on CPU (see skinny_gemm.py for the why).
//
// The weight arrives pre-laid-out by `pack_skinny_weight` in "column blocks" of 16 outputs:
//
//   fp32:  Wp[N/16][K][16]        Wp[b][k][j]    = W[16b + j][k]
//   bf16:  Wp[N/16][K/2][16][2]   Wp[b][p][j][i] = W[16b + j][2p + i]   (pairs along k, for vdpbf16ps)
//
// so a block is one contiguous run of memory, read front to back, each 64-byte line feeding 16 output lanes.
// Row-major W would end each output in a horizontal sum of a 16-lane vector, at K = 576 as costly as the loop before.
//
// A thread takes a group of 4 blocks and the rows of x, 8 at a time (kMaxRows), and cuts the group into
// COLUMNS of one register's width (16 lanes on AVX-512; 8 on AVX2, where a block is two columns). A tile of
// C columns x MB rows keeps its C * MB accumulators in registers; for each k (or k pair):
//
//   w[c] = Wp[column c][k]                                   (loaded once: serves all MB rows)
//   for m: acc[c][m] = fma(w[c], broadcast(x[m][k]), acc[c][m])
//
// bf16: vdpbf16ps takes a k pair at once where the CPU has AVX512_BF16; elsewhere a pair is widened by a
// shift and a mask (a bf16 is the top half of an fp32): k even, then k odd, two FMAs against x in fp32.
// C is the most columns the registers hold (side_by_side); the tiles of a group walk the same lines one
// after the other, so the weight streams from memory ONCE a call for up to 8 rows: a 5-row verify step
// reads what a 1-row decode step reads (AVX2 at 7-8 rows reads a block's second half from L1/L2).
//
//   AVX-512 (32 zmm)   C = 4 (whole blocks) to 6 rows (5 widened bf16), 2 beyond; vdpbf16ps or widened
//   AVX2 + FMA (16)    C = 8 at 1 row, 4 at 2 fp32, 2 (one block) to 6 fp32 / 5 bf16, 1 beyond; prefetch
//   portable           plain loops over whole 16-lane blocks, one explicit fused multiply-add per term
//
// Every output is ONE chain of sums over k in k's order, whatever the path and rows: acc = fma(W[k], x[k], acc),
// k = 0, 1, ... (vdpbf16ps: a pair a step). So a row's bits never depend on the rows beside it (batch invariance
// relies on it), fp32 matches on all 3 paths (GCC once fused a portable `a * b + c` at x86-64-v3 for 2-4 rows, not 1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

constexpr int64_t kLanes = 16;  // outputs per column block (the packed layout)
constexpr int kBlocks = 4;      // NB: column blocks per task of a thread
constexpr int kMaxRows = 8;     // MB: rows of x sharing one pass over the weight

using namespace minivllm_cpu_simd;
using bf16 = c10::BFloat16;

// acc + a * b with one rounding where the target has a fused multiply-add (what the SIMD paths do),
// written out so the compiler's choice to contract or not cannot differ between instantiations.
inline float madd(float a, float b, float acc) {
#if defined(FP_FAST_FMAF)
  return std::fma(a, b, acc);
#else
  return a * b + acc;  // no FMA instruction on this target: nothing the compiler could contract it into
#endif
}

// --- the instruction sets: a vector V of kWidth fp32 lanes and what the tile does with it ---------------
// widen(p, even, odd): kWidth bf16 pairs at p -> the first of each pair (k even), the second (k odd).
struct Portable {
  static constexpr int kWidth = 16, kRegisters = 1 << 10, kAhead = 0;  // no register file to fit: whole groups
  static constexpr bool kDotPairs = false;
  struct V { float l[kWidth]; };
  static V zero() { return V{}; }
  static V load(const float* p) { V v; std::memcpy(v.l, p, sizeof v.l); return v; }
  static V broadcast(const float* p) { V v; std::fill(v.l, v.l + kWidth, *p); return v; }
  static V fma(const V& a, const V& b, V acc) {
    for (int i = 0; i < kWidth; ++i) acc.l[i] = madd(a.l[i], b.l[i], acc.l[i]);
    return acc;
  }
  static void widen(const bf16* p, V& even, V& odd) {
    for (int i = 0; i < kWidth; ++i) even.l[i] = to_float(p[2 * i]), odd.l[i] = to_float(p[2 * i + 1]);
  }
  static void store(float* p, const V& v) { std::memcpy(p, v.l, sizeof v.l); }
};

#if defined(__AVX512F__)
struct Avx512 {
  static constexpr int kWidth = 16, kRegisters = 32, kAhead = 0;  // a software prefetch cost 5-20% at 1-6 rows
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static void widen(const bf16* p, V& even, V& odd) {
    const __m512i w = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
#if defined(__AVX512BF16__)
  static constexpr bool kDotPairs = true;  // acc += w[2p] x[2p] + w[2p+1] x[2p+1] per lane, one instruction
  using Pairs = __m512i;
  static Pairs load_pairs(const bf16* p) { return _mm512_loadu_si512(p); }
  static Pairs broadcast_pair(const bf16* p) { int32_t v; std::memcpy(&v, p, sizeof v); return _mm512_set1_epi32(v); }
  static V dot_pairs(Pairs w, Pairs x, V acc) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
#else
  static constexpr bool kDotPairs = false;
#endif
};
using Simd = Avx512;
#elif defined(__AVX2__) && defined(__FMA__)
struct Avx2 {  // x86-64-v3: 16 ymm registers; a 16-lane block is two columns
  // kAhead: prefetch 2 KB down each stream from 3 rows: at 4-6, slow on each line, the hardware prefetcher fell
  // behind (1.6-1.9x the 1-row time without, 1.1-1.3x with; x86-64-v3, Zen 4); at 1-2 it keeps up, prefetch cost time.
  static constexpr int kWidth = 8, kRegisters = 16, kAhead = 32;
  static constexpr bool kDotPairs = false;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
  static void widen(const bf16* p, V& even, V& odd) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
using Simd = Avx2;
#else
using Simd = Portable;
#endif

// How many columns a tile takes side by side: the most (a power of two, within the group's `columns`)
// whose registers fit: C * rows accumulators, the weight's C vectors (2C once widened), one broadcast x. At one
// row a weight vector feeds one FMA and is dead: none stays live (AVX2 then walks all 8 columns, 4 streams).
template <class Isa, typename T>
constexpr int registers_per_column(int rows) {
  return rows + (rows == 1 ? 0 : std::is_same_v<T, bf16> && !Isa::kDotPairs ? 2 : 1);
}
template <class Isa, typename T>
constexpr int side_by_side(int rows, int columns) {
  int c = 1;
  while (2 * c <= columns && 2 * c * registers_per_column<Isa, T>(rows) + 1 <= Isa::kRegisters) c *= 2;
  return c;
}

// A prefetch kAhead steps (64-byte lines: one k of fp32, one k pair of bf16) down each of the C columns.
template <class Isa, int MB, typename T, int C>
inline void prefetch_ahead(const T* const (&w)[C], int64_t step) {
  if constexpr (Isa::kAhead > 0 && MB >= 3)
    for (int c = 0; c < C; ++c) __builtin_prefetch(reinterpret_cast<const char*>(w[c]) + (step + Isa::kAhead) * 64);
}

// --- one tile: C columns x MB rows, each output lane one chain over k: out[j][m][l] for columns q0 .. q0 + C - 1
// of the group at wp (column q: block q / per_block, lanes from (q % per_block) * kWidth); x (MB, K) in T, xf fp32.
template <class Isa, typename T, int C, int MB>  // noinline: inlined, GCC 12 spilled 2 of 16 zmm accumulators
[[gnu::noinline]] void tile(const T* x, const float* xf, int64_t K, const T* wp, int q0, float (*out)[MB][kLanes]) {
  using V = typename Isa::V;
  constexpr int kWidth = Isa::kWidth, per_block = kLanes / kWidth;
  constexpr int64_t step = 2 * kLanes;  // elements from one k (fp32) or k pair (bf16) to the next: 64 bytes
  const T* w[C];
  for (int c = 0; c < C; ++c) {
    const int q = q0 + c, lane0 = (q % per_block) * kWidth;
    w[c] = wp + (q / per_block) * K * kLanes + (std::is_same_v<T, float> ? lane0 : 2 * lane0);
  }
  V acc[C][MB];  // unrolled in full where touched whole: else GCC 12 kept acc in memory too, storing it every k
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[c][m] = Isa::zero();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < K; ++k) {
      prefetch_ahead<Isa, MB>(w, k);
      V wv[C];
      for (int c = 0; c < C; ++c) wv[c] = Isa::load(w[c] + k * kLanes);
      for (int m = 0; m < MB; ++m) {
        const V xv = Isa::broadcast(xf + m * K + k);
        for (int c = 0; c < C; ++c) acc[c][m] = Isa::fma(wv[c], xv, acc[c][m]);
      }
    }
  } else if constexpr (Isa::kDotPairs) {
    for (int64_t p = 0; p < K / 2; ++p) {
      prefetch_ahead<Isa, MB>(w, p);
      typename Isa::Pairs wv[C];
      for (int c = 0; c < C; ++c) wv[c] = Isa::load_pairs(w[c] + p * step);
      for (int m = 0; m < MB; ++m) {
        const auto xv = Isa::broadcast_pair(x + m * K + 2 * p);
        for (int c = 0; c < C; ++c) acc[c][m] = Isa::dot_pairs(wv[c], xv, acc[c][m]);
      }
    }
  } else {  // widened pairs: k even, then k odd, one x broadcast live at a time (the register budget's 1)
    for (int64_t p = 0; p < K / 2; ++p) {
      prefetch_ahead<Isa, MB>(w, p);
      V even[C], odd[C];
      for (int c = 0; c < C; ++c) Isa::widen(w[c] + p * step, even[c], odd[c]);
      for (int m = 0; m < MB; ++m) {
        const V x_even = Isa::broadcast(xf + m * K + 2 * p);
        for (int c = 0; c < C; ++c) acc[c][m] = Isa::fma(even[c], x_even, acc[c][m]);
        const V x_odd = Isa::broadcast(xf + m * K + 2 * p + 1);
        for (int c = 0; c < C; ++c) acc[c][m] = Isa::fma(odd[c], x_odd, acc[c][m]);
      }
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) Isa::store(out[(q0 + c) / per_block][m] + ((q0 + c) % per_block) * kWidth, acc[c][m]);
}

// y[m][16 * (block0 + j) + l] for NB blocks and MB rows, bias added, rounded to T; columns >= N are padding.
template <typename T, int NB, int MB>
void blocks(const T* x, const float* xf, int64_t K, const T* wp, const T* bias, T* y, int64_t N, int64_t block0) {
  constexpr int columns = NB * kLanes / Simd::kWidth, C = side_by_side<Simd, T>(MB, columns);
  float acc[NB][MB][kLanes];
  for (int q = 0; q < columns; q += C) tile<Simd, T, C, MB>(x, xf, K, wp + block0 * K * kLanes, q, acc);
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      for (int64_t l = 0, n = (block0 + j) * kLanes; l < kLanes && n + l < N; ++l)  // padding lanes are last
        y[m * N + n + l] = T(acc[j][m][l] + (bias ? to_float(bias[n + l]) : 0.f));
}

// `rows` (1 .. kMaxRows) rows through blocks<T, NB, rows>: one instantiation per row count.
template <typename T, int NB, int MB = kMaxRows>
void some_rows(int64_t rows, const T* x, const float* xf, int64_t K, const T* wp, const T* bias, T* y, int64_t N,
               int64_t block0) {
  if (rows == MB) return blocks<T, NB, MB>(x, xf, K, wp, bias, y, N, block0);
  if constexpr (MB > 1) some_rows<T, NB, MB - 1>(rows, x, xf, K, wp, bias, y, N, block0);
}

template <typename T>
void run(const at::Tensor& x, const float* xfp, const at::Tensor& wp, const T* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), n_blocks = wp.size(0);
  const T *xp = x.data_ptr<T>(), *w = wp.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Threads split the groups of column blocks, each its own share of the weight. A task of >= ~64 KB keeps a thread's
  // start-up small next to its work; a small weight (576 x 576 bf16: 9 groups of 72 KB) still spreads over 9 threads.
  const int64_t groups = (n_blocks + kBlocks - 1) / kBlocks;
  const int64_t group_bytes = kBlocks * kLanes * K * int64_t(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(1, group_bytes));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * kBlocks;
      for (int64_t m = 0; m < M; m += kMaxRows) {  // up to 8 rows a pass; a 9th row re-reads the group from cache
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m);
        const float* xf = xfp ? xfp + m * K : nullptr;  // none where vdpbf16ps reads x's pairs as they are
        if (b + kBlocks <= n_blocks) some_rows<T, kBlocks>(rows, xp + m * K, xf, K, w, bias, yp + m * N, N, b);
        else  // the last group, short of kBlocks blocks: one block at a time
          for (int64_t j = b; j < n_blocks; ++j) some_rows<T, 1>(rows, xp + m * K, xf, K, w, bias, yp + m * N, N, j);
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
    run<float>(xc, xc.data_ptr<float>(), packed, b.defined() ? b.data_ptr<float>() : nullptr, y);
  } else {
    TORCH_CHECK(xc.size(1) % 2 == 0, "skinny_gemm: bfloat16 needs an even in_features");
    // widened pairs multiply by x in fp32: one copy a call (rows x in), not one conversion a block
    const at::Tensor xf = Simd::kDotPairs ? at::Tensor() : xc.to(at::kFloat);
    run<bf16>(xc, xf.defined() ? xf.data_ptr<float>() : nullptr, packed, b.defined() ? b.data_ptr<bf16>() : nullptr, y);
  }
  return y;
}

// How this build walks `rows` rows (of bf16 or fp32): {rows a pass, passes over the weight, columns a tile,
// lanes a column, registers a tile holds, registers the ISA has} at the first pass's row count.
std::vector<int64_t> skinny_gemm_tiling(int64_t rows, bool bf16_weight) {
  TORCH_CHECK(rows >= 1, "skinny_gemm_tiling: rows must be >= 1");
  const int first = int(std::min<int64_t>(rows, kMaxRows)), columns = kBlocks * kLanes / Simd::kWidth;
  const int c = bf16_weight ? side_by_side<Simd, bf16>(first, columns) : side_by_side<Simd, float>(first, columns);
  const int per = bf16_weight ? registers_per_column<Simd, bf16>(first) : registers_per_column<Simd, float>(first);
  return {kMaxRows, (rows + kMaxRows - 1) / kMaxRows, c, Simd::kWidth, c * per + 1, Simd::kRegisters};
}

}  // namespace

// torch.ops.minivllm_cpu.*, built with the other kernels (cpu_build.py); tests build other paths under other names
#ifndef MINIVLLM_CPU_LIBRARY
#define MINIVLLM_CPU_LIBRARY minivllm_cpu
#endif
TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) {
  m.def("skinny_gemm(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("skinny_gemm_tiling(int rows, bool bf16) -> int[]", &skinny_gemm_tiling);
}
TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("skinny_gemm", &skinny_gemm); }
