// Decode attention straight from the paged KV cache: one query token per sequence, its keys
// found through its block table. No gather of the history, no padding, no mask tensor.
//
// Work items are (sequence, KV head) pairs; each reads that head's keys and values once for
// all the query heads that share it (GQA), so a step streams the cache once. Scores and
// sums in float32 whatever the cache dtype, as the reference's softmax does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Scores for keys [first, n) of one (sequence, KV head), for its `group` query heads.
template <typename T, int D>
void attend(const float* __restrict query, const T* __restrict keys, const T* __restrict values,
            const int64_t* table, int64_t block_size, int64_t token_stride, int64_t first,
            int64_t n, int64_t group, float* __restrict scores, float* __restrict total,
            float* __restrict acc) {
  const int64_t len = n - first;
  float row[D];
  // Slots of keys first .. n - 1, block by block: no division per key.
  auto for_each_slot = [&](auto&& body) {
    int64_t block = first / block_size, offset = first % block_size;
    for (int64_t i = 0; i < len; ++i) {
      body(i, table[block] * block_size + offset);
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
  };
  for_each_slot([&](int64_t i, int64_t slot) {
    const T* k = keys + slot * token_stride;
    for (int d = 0; d < D; ++d) row[d] = to_float(k[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * D;
      float part[16] = {0};
      for (int d = 0; d < D; d += 16)
        for (int j = 0; j < 16; ++j) part[j] += qg[d + j] * row[d + j];
      float s = 0.0f;
      for (int j = 0; j < 16; ++j) s += part[j];
      scores[g * len + i] = s;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float peak = sg[0];
    for (int64_t i = 1; i < len; ++i) peak = std::max(peak, sg[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < len; ++i) {
      sg[i] = std::exp(sg[i] - peak);
      sum += sg[i];
    }
    total[g] = sum;
  }
  std::fill(acc, acc + group * D, 0.0f);
  for_each_slot([&](int64_t i, int64_t slot) {
    const T* v = values + slot * token_stride;
    for (int d = 0; d < D; ++d) row[d] = to_float(v[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * len + i];
      float* ag = acc + g * D;
      for (int d = 0; d < D; ++d) ag[d] += w * row[d];
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) acc[g * D + d] /= total[g];
}

template <typename T, int D>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& num_keys, int64_t window,
            double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, table_width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lengths = num_keys.data_ptr<int64_t>();
  const int64_t token_stride = kv_heads * D;  // elements between two slots of a head

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * D), acc(group * D), total(group), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t n = lengths[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      scores.resize(group * (n - first));
      const T* qh = qp + (b * heads + h * group) * D;
      for (int64_t i = 0; i < group * D; ++i) query[i] = to_float(qh[i]) * static_cast<float>(scale);
      attend<T, D>(query.data(), kp + h * D, vp + h * D, tables + b * table_width, block_size,
                   token_stride, first, n, group, scores.data(), total.data(), acc.data());
      T* dst = op + (b * heads + h * group) * D;
      for (int64_t i = 0; i < group * D; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
}

// q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, width] int64;
// num_keys [B] int64: sequence b attends keys 0 .. num_keys[b] - 1 of its table (its own
// included), the last `window` of them when window > 0. Returns [B, H, D].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& num_keys, int64_t window,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && num_keys.scalar_type() == at::kLong);
  auto tables = block_tables.contiguous();
  auto lengths = num_keys.contiguous();
  auto out = at::empty_like(q);
  // The head size is a template argument, so the loops over it unroll and vectorize.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    switch (q.size(2)) {
      case 16: return decode<scalar_t, 16>(q, k_cache, v_cache, tables, lengths, window, scale, out);
      case 32: return decode<scalar_t, 32>(q, k_cache, v_cache, tables, lengths, window, scale, out);
      case 64: return decode<scalar_t, 64>(q, k_cache, v_cache, tables, lengths, window, scale, out);
      case 128: return decode<scalar_t, 128>(q, k_cache, v_cache, tables, lengths, window, scale, out);
      case 256: return decode<scalar_t, 256>(q, k_cache, v_cache, tables, lengths, window, scale, out);
      default: TORCH_CHECK(false, "paged_decode: head size ", q.size(2), " is not 16, 32, 64, 128 or 256");
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
