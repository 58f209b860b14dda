// rotary_embedding: RoPE ("rotate-half" layout) applied to every head of a step's rows, reading the
// cos / sin tables at each row's position (see rotary_embedding.py for the why).
//
//   x           (T, H, D)   each head's D values contiguous (any row and head strides: a view of qkv)
//   positions   (T,) int64
//   cos, sin    (P, D)      float32 tables; sin's first half negated (layers/rotary.py, `signed_sin`)
//   out         (T, H, D)   contiguous
//
// With x = (x1, x2) split in halves and c, s the row's table entries rounded to x's dtype:
//   out1 = round(round(x1 * c1) + round(x2 * s1))        (s1 = -sin: rotate_half's minus sign)
//   out2 = round(round(x2 * c2) + round(x1 * s2))
// which is torch's `x * cos + rotate_half(x) * sin` rounding for rounding (round(): to x's dtype,
// nothing for fp32). No fused multiply-add: it would round once fewer and differ from HF, so this file
// asks the compiler not to contract `a * b + c * d` into one (GCC does by default, even at -std=c++20).
// Paths: AVX-512 (16 lanes), AVX2 + FMA (8 lanes), the plain loop elsewhere: all bit-identical to torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#pragma GCC optimize("fp-contract=off")
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include "cpu_simd.h"  // after the pragma: its helpers are compiled under it too

namespace {

using namespace minivllm_cpu_simd;

constexpr int64_t GRAIN_VALUES = 32768;  // below this many values a thread's wake-up costs more than it saves

// One head: out = x * c + swap_halves(x) * s, rounded as torch rounds.
template <typename T>
void rotate_head(const T* x, const float* cos, const float* sin, T* out, int64_t half) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= half; j += 16) {
    const __m512 x1 = load16(x + j), x2 = load16(x + half + j);
    const __m512 c1 = round16<T>(_mm512_loadu_ps(cos + j)), c2 = round16<T>(_mm512_loadu_ps(cos + half + j));
    const __m512 s1 = round16<T>(_mm512_loadu_ps(sin + j)), s2 = round16<T>(_mm512_loadu_ps(sin + half + j));
    store16(out + j, round16<T>(_mm512_add_ps(round16<T>(_mm512_mul_ps(x1, c1)), round16<T>(_mm512_mul_ps(x2, s1)))));
    store16(out + half + j,
            round16<T>(_mm512_add_ps(round16<T>(_mm512_mul_ps(x2, c2)), round16<T>(_mm512_mul_ps(x1, s2)))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= half; j += 8) {  // the same rounding, 8 lanes at a time
    const __m256 x1 = load8(x + j), x2 = load8(x + half + j);
    const __m256 c1 = round8<T>(_mm256_loadu_ps(cos + j)), c2 = round8<T>(_mm256_loadu_ps(cos + half + j));
    const __m256 s1 = round8<T>(_mm256_loadu_ps(sin + j)), s2 = round8<T>(_mm256_loadu_ps(sin + half + j));
    store8(out + j, round8<T>(_mm256_add_ps(round8<T>(_mm256_mul_ps(x1, c1)), round8<T>(_mm256_mul_ps(x2, s1)))));
    store8(out + half + j, round8<T>(_mm256_add_ps(round8<T>(_mm256_mul_ps(x2, c2)), round8<T>(_mm256_mul_ps(x1, s2)))));
  }
#endif
  for (; j < half; ++j) {
    const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[half + j]);
    const float a1 = round_to<T>(x1 * round_to<T>(cos[j])), b1 = round_to<T>(x2 * round_to<T>(sin[j]));
    const float a2 = round_to<T>(x2 * round_to<T>(cos[half + j])), b2 = round_to<T>(x1 * round_to<T>(sin[half + j]));
    out[j] = T(a1 + b1);
    out[half + j] = T(a2 + b2);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
         at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), P = cos.size(0);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* op = out.data_ptr<T>();
  for (int64_t t = 0; t < T_; ++t)  // checked before any thread starts: an error leaves nothing half-written
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary_embedding: position ", pos[t], " of row ", t,
                " is outside the tables (", P, " positions)");
  at::parallel_for(0, T_ * H, std::max<int64_t>(1, GRAIN_VALUES / D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      rotate_head<T>(xp + t * s0 + h * s1, cp + pos[t] * D, sp + pos[t] * D, op + i * D, D / 2);
    }
  });
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                            const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x must be (T, H, D), each head contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_embedding: the head dim must be even, not ", x.size(2));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rotary_embedding: float32 or bfloat16 only, not ", x.scalar_type());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong &&
              positions.is_contiguous(), "rotary_embedding: positions must be (T,) int64, contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == x.size(2) && cos.sizes() == sin.sizes() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "rotary_embedding: cos and sin must be contiguous (positions, D) float32 tables");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) run<float>(x, positions, cos, sin, out);
  else run<c10::BFloat16>(x, positions, cos, sin, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) {
  m.def("rotary_embedding(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
