// rms_norm / fused_add_rms_norm: RMSNorm as HF transformers computes it, one pass over each row
// (see rms_norm.py for the why).
//
//   x, residual  (R, N) or (R1, R2, N)   each row's N values contiguous (any row strides)
//   weight       (N,)                    x's dtype
//
//   rms_norm:            out = weight * round(x * r),   r = 1 / sqrt(mean(x^2) + eps) in fp32
//   fused_add_rms_norm:  h = round(x + residual);  returns (rms_norm(h), h)
//
// round() is to x's dtype (nothing for fp32): HF normalises in fp32, casts back, and only then scales
// by the weight, so a bf16 result is rounded twice, as here. Every product is rounded to bf16 exactly
// as torch rounds (to nearest, ties to even), so the only difference from torch's ops is how the squares
// are summed (in another order, with fused multiply-adds): a last-bit difference in r, which rarely
// moves a bf16 result and moves an fp32 one by an ulp or two.
//
// Paths: AVX-512 (16 lanes), AVX2 + FMA (8 lanes: the squares summed in 8 partial sums, not 16), and the
// plain loop elsewhere; each row is computed alone, so a row's bits never depend on the rows beside it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "cpu_simd.h"

namespace {

using namespace minivllm_cpu_simd;

constexpr int64_t GRAIN_VALUES = 32768;  // below this many values a thread's wake-up costs more than it saves

// One row: out[0:N] = w * round(x * r); with a residual, x is first replaced by h = round(x + res), stored.
template <typename T>
void norm_row(const T* x, const T* res, T* h_out, const T* w, T* out, int64_t N, float eps) {
  int64_t d = 0;
  float sumsq = 0.f;
  const T* src = x;
  if (res != nullptr) {  // h = round(x + residual), written first; the norm then reads h
#if defined(__AVX512F__)
    for (; d + 16 <= N; d += 16) store16(h_out + d, round16<T>(_mm512_add_ps(load16(x + d), load16(res + d))));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; d + 8 <= N; d += 8) store8(h_out + d, round8<T>(_mm256_add_ps(load8(x + d), load8(res + d))));
#endif
    for (; d < N; ++d) h_out[d] = T(static_cast<float>(x[d]) + static_cast<float>(res[d]));
    src = h_out;
    d = 0;
  }
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= N; d += 16) {
    const __m512 v = load16(src + d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sumsq = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= N; d += 8) {
    const __m256 v = load8(src + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sumsq = sum8(acc);
#endif
  for (; d < N; ++d) sumsq += static_cast<float>(src[d]) * static_cast<float>(src[d]);
  const float r = 1.f / std::sqrt(sumsq / static_cast<float>(N) + eps);
  d = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r);
  for (; d + 16 <= N; d += 16)
    store16(out + d, round16<T>(_mm512_mul_ps(load16(w + d), round16<T>(_mm512_mul_ps(load16(src + d), rv)))));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 rv = _mm256_set1_ps(r);
  for (; d + 8 <= N; d += 8)
    store8(out + d, round8<T>(_mm256_mul_ps(load8(w + d), round8<T>(_mm256_mul_ps(load8(src + d), rv)))));
#endif
  for (; d < N; ++d) out[d] = T(static_cast<float>(w[d]) * round_to<T>(static_cast<float>(src[d]) * r));
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, name, ": x must be (rows, N) or (R1, R2, N), not ", x.dim(), "-D");
  TORCH_CHECK(x.stride(-1) == 1, name, ": each row's N values must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 only, not ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), name, ": weight must be (N,) contiguous, in x's dtype");
}

// Row i of x, (R1, R2, N) or (R, N) seen as (R, 1, N), starts at this offset.
inline int64_t row_offset(const at::Tensor& x, int64_t i) {
  return x.dim() == 2 ? i * x.stride(0) : (i / x.size(1)) * x.stride(0) + (i % x.size(1)) * x.stride(1);
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor* residual, at::Tensor* h, const at::Tensor& weight, at::Tensor& out,
         double eps) {
  const int64_t N = x.size(-1), rows = x.numel() / N;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* hp = h ? h->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN_VALUES / N), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i)
      norm_row<T>(xp + row_offset(x, i), rp ? rp + row_offset(*residual, i) : nullptr, hp ? hp + i * N : nullptr,
                  wp, op + i * N, N, float(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) run<float>(x, nullptr, nullptr, weight, out, eps);
  else run<c10::BFloat16>(x, nullptr, nullptr, weight, out, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.stride(-1) == 1,
              "fused_add_rms_norm: residual must have x's shape and dtype, each row contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options()), h = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return {out, h};
  if (x.scalar_type() == at::kFloat) run<float>(x, &residual, &h, weight, out, eps);
  else run<c10::BFloat16>(x, &residual, &h, weight, out, eps);
  return {out, h};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
