// silu_and_mul: the MLP's activation, silu(gate) * up, in one pass over the gate_up projection's output
// (see silu_and_mul.py for the why).
//
//   x    (R, 2I)   gate = x[:, :I], up = x[:, I:]; each row's 2I values contiguous (any row stride)
//   out  (R, I)    contiguous, x's dtype
//
//   out = round(round(silu(gate)) * up),   silu(g) = g / (1 + e^-g) in fp32
//
// round() is to x's dtype (nothing for fp32), as torch's two ops round: F.silu returns x's dtype, then the
// product is rounded again. silu is torch's formula; only e^-g is computed another way (exp16, cpu_simd.h),
// so an fp32 result can differ from torch's in its last bit or two and a bf16 one, rarely, by one ulp.
// Paths: AVX-512 (exp16) and AVX2 + FMA (exp8) give the same bits for every value both take in a vector
// (all of them when I is a multiple of 16); the plain loop (and a row's last I % 8 or I % 16 values) takes
// std::exp, whose last bit can differ from theirs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_simd.h"

namespace {

using namespace minivllm_cpu_simd;

constexpr int64_t GRAIN_VALUES = 32768;  // below this many values a thread's wake-up costs more than it saves

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t I) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; d + 16 <= I; d += 16) {
    const __m512 g = load16(gate + d);
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store16(out + d, round16<T>(_mm512_mul_ps(silu, load16(up + d))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; d + 8 <= I; d += 8) {
    const __m256 g = load8(gate + d);
    const __m256 silu = round8<T>(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
    store8(out + d, round8<T>(_mm256_mul_ps(silu, load8(up + d))));
  }
#endif
  for (; d < I; ++d) {
    const float g = to_float(gate[d]);
    out[d] = T(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[d]));
  }
}

template <typename T>
void run(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), I = out.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN_VALUES / I), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) silu_mul_row<T>(xp + i * stride, xp + i * stride + I, op + i * I, I);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "silu_and_mul: x must be (rows, 2 * I), not ", x.dim(), "-D");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x's last dim must be even (gate and up), not ", x.size(1));
  TORCH_CHECK(x.stride(1) == 1, "silu_and_mul: each row's values must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "silu_and_mul: float32 or bfloat16 only, not ", x.scalar_type());
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) run<float>(x, out);
  else run<c10::BFloat16>(x, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
