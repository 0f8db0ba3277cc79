// The decode step's small ops, each one call where torch takes several dispatches: RMSNorm,
// the rotary embedding of q and k, the write of new keys and values into the paged cache
// (with its cast), and the lm_head's top-k. A decode step of a small model is mostly such
// fixed costs; every torch op costs a few microseconds of dispatch however few values it
// touches. Each computes as the torch ops it replaces do (float32 arithmetic, bf16 results
// rounded to nearest even), in plain loops the compiler vectorizes. A prompt chunk's rows are
// split over the threads; torch's ops took several passes over them (RMSNorm ~6, rope 3, the
// cache write a cast and a scatter).
#include "step_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace gapless_step;

void check_float(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, " takes float32 or bfloat16 CPU tensors");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm's weight must be contiguous [cols], in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x, weight, eps, out);
  else
    rms_norm_rows<c10::BFloat16>(x, weight, eps, out);
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_float(x, "rope");
  TORCH_CHECK(x.dim() == 3, "rope takes x [T, H, D]");
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == x.size(0) && t->size(1) == 1 && t->size(2) == cos.size(2),
                "rope's cos and signed sin must be contiguous [T, 1, R], in x's dtype");
  TORCH_CHECK(cos.size(2) % 2 == 0 && cos.size(2) <= x.size(2),
              "rope rotates an even number of dims, at most D");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows<float>(x, cos, signed_sin, out);
  else
    rope_rows<c10::BFloat16>(x, cos, signed_sin, out);
  return out;
}

// The new keys and values k, v [T, Hkv, D] into the caches at their slots [T] (block *
// block_size + offset): caches [blocks, block_size, Hkv, D] of float32, bf16 or f16, cast
// to their dtype, or int8 caches, uint8 [blocks, block_size, Hkv, D + D / 16] (D a multiple
// of 32), quantized. Returns k and v as the attention plans take them: in a float cache's
// dtype (themselves where it is theirs), and for an int8 cache as they came (the chunk's own
// keys, in the queries' dtype).
std::tuple<at::Tensor, at::Tensor> write_kv(const at::Tensor& k, const at::Tensor& v,
                                            at::Tensor& k_cache, at::Tensor& v_cache,
                                            const at::Tensor& slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "write_kv's slots must be a contiguous int64 [T]");
  const int64_t* s = slots.data_ptr<int64_t>();
  const bool int8 = k_cache.scalar_type() == at::kByte;
  for (const auto& [x, cache] : {std::pair(&k, &k_cache), std::pair(&v, &v_cache)}) {
    check_float(*x, "write_kv");
    const auto type = cache->scalar_type();
    TORCH_CHECK(cache->device().is_cpu() && type == k_cache.scalar_type() &&
                    (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || int8),
                "write_kv's caches must be float32, bfloat16, float16 or uint8 (int8 rows), both alike");
    const int64_t d = x->size(-1);
    TORCH_CHECK(!int8 || d % 32 == 0, "write_kv: an int8 cache needs a head size that is a multiple of 32");
    TORCH_CHECK(x->dim() == 3 && x->size(0) == slots.size(0) && cache->is_contiguous() &&
                    cache->dim() == 4 && cache->size(2) == x->size(1) &&
                    cache->size(3) == (int8 ? d + d / 16 : d),
                "write_kv takes [T, Hkv, D] into contiguous caches [blocks, size, Hkv, D]"
                " (int8: D + D / 16 bytes)");
    const int64_t capacity = cache->size(0) * cache->size(1);
    for (int64_t t = 0; t < slots.size(0); ++t)
      TORCH_CHECK(s[t] >= 0 && s[t] < capacity, "slot ", s[t], " is outside the cache");
    if (x->scalar_type() == at::kFloat)
      write_from<float>(*x, *cache, s);
    else
      write_from<c10::BFloat16>(*x, *cache, s);
  }
  if (int8) return {k, v};
  return {k.to(k_cache.scalar_type()), v.to(v_cache.scalar_type())};
}

// The indices of the k largest values of each row of x [R, V] (float32), in no particular
// order: one pass that keeps the best k seen, where torch's topk copies and sorts every row.
at::Tensor top_k(const at::Tensor& x_in, int64_t k) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && k >= 1 && k <= x_in.size(1),
              "top_k takes float32 [R, V] and 1 <= k <= V");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({rows, k}, x.options().dtype(at::kLong));
  std::vector<float> best(k);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * v;
    int64_t* idx = out.data_ptr<int64_t>() + r * k;
    // A NaN ranks below everything (it is no logit): it takes the first k's place at -inf.
    for (int64_t j = 0; j < k; ++j)
      best[j] = std::isnan(row[j]) ? -INFINITY : row[j], idx[j] = j;
    int64_t low = std::min_element(best.begin(), best.end()) - best.begin();
    for (int64_t i = k; i < v; ++i) {
      if (!(row[i] > best[low])) continue;  // nor does a NaN enter later
      best[low] = row[i], idx[low] = i;
      low = std::min_element(best.begin(), best.end()) - best.begin();
    }
  }
  return out;
}

}  // namespace

// Registered by gguf_ops.cpp's module, which is this extension's one.
void register_step_ops(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "x [rows, cols] or [T, H, cols] RMS-normalized, times weight");
  m.def("rope", &rope, "x [T, H, D] rotated by cos and signed sin [T, 1, R]");
  m.def("write_kv", &write_kv, "new keys and values into the paged caches at their slots");
  m.def("top_k", &top_k, "indices of the k largest of each row of x [R, V], unordered");
}
