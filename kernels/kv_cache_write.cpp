// kv_cache_write: store each new token's key and value rows at its slot of the paged cache; the CPU
// twin of kv_cache_write.py's Triton kernel (its docstring has the picture).
//
//   k, v          (T, Hkv, D)                       row t: Hkv * D contiguous values (any row stride)
//   k/v cache     (num_blocks, block_size, Hkv, D)  contiguous: slot s is row s of (num_slots, Hkv * D)
//   slot_mapping  (T,) int64                        -1: nothing to store
//
//   for t in 0 .. T-1:  if slot[t] >= 0:  k_cache[slot[t]] = k[t];  v_cache[slot[t]] = v[t]
//
// Why a kernel for a copy: `index_copy_` costs ~35 µs a call on tensors this small (dispatch, checks,
// a parallel region) and runs twice a layer; here each row is one memcpy of a few hundred bytes, and
// the whole write is a few µs. Serial on purpose: T rows of ~256 bytes are less work than waking threads.
// No paths per instruction set, unlike its neighbours: a copy does no arithmetic, and memcpy is already
// the C library's best copy for the CPU it runs on (glibc picks its AVX2 / AVX-512 version at load time).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be (T, Hkv, D) with each row's Hkv * D values contiguous");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), name, " and its cache must have one dtype");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(2) == x.size(1) && cache.size(3) == x.size(2),
              "the caches must be contiguous (num_blocks, block_size, Hkv, D) matching ", name);
}

void kv_cache_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  TORCH_CHECK(k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes(), "k and v (and their caches) must match");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == k.size(0), "slot_mapping must be (T,) int64, contiguous");
  const int64_t T = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t esize = k.element_size(), row_bytes = k.size(1) * k.size(2) * esize;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "slot ", s, " of row ", t, " is outside the cache (", num_slots, " slots)");
    std::memcpy(kc + s * row_bytes, kp + t * k.stride(0) * esize, row_bytes);
    std::memcpy(vc + s * row_bytes, vp + t * v.stride(0) * esize, row_bytes);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MINIVLLM_CPU_LIBRARY, m) {
  m.def("kv_cache_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(MINIVLLM_CPU_LIBRARY, CPU, m) { m.impl("kv_cache_write", &kv_cache_write); }
