// The row loops of the step's small ops (RMSNorm, rope, the KV-cache write), on raw tensors
// with their outputs given: step_ops.cpp wraps them as torch ops, and decode_layers.cpp calls
// them inside its one call a step. Each computes as the torch ops it replaces do (float32
// arithmetic, bf16 results rounded to nearest even), in plain loops the compiler vectorizes.
#pragma once

#include "torch_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace gapless_step {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// Rows of a tensor whose last dim is contiguous: [rows, cols] or [T, H, cols], any strides.
struct Rows {
  int64_t outer, inner, cols, outer_stride, inner_stride;

  explicit Rows(const at::Tensor& x) {
    TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
                "takes [rows, cols] or [T, H, cols] with contiguous cols");
    cols = x.size(-1);
    outer = x.size(0);
    outer_stride = x.stride(0);
    inner = x.dim() == 3 ? x.size(1) : 1;
    inner_stride = x.dim() == 3 ? x.stride(1) : 0;
  }
  int64_t offset(int64_t row) const {
    return row / inner * outer_stride + row % inner * inner_stride;
  }
};

// fn(r0, r1) for rows [r0, r1) of `rows`, split over torch's threads where there are enough
// values to be worth waking them (a decode step's few thousand stay on the calling thread).
template <typename Fn>
void for_rows(int64_t rows, int64_t cols, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, fn);
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const Rows rows(x);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t n = rows.cols;
  for_rows(rows.outer * rows.inner, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = src + rows.offset(r);
      // 16 independent partial sums: the compiler vectorizes them without reassociating.
      float partial[16] = {};
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; ++l) {
          const float v = to_float(row[j + l]);
          partial[l] += v * v;
        }
      float sum = 0.0f;
      for (; j < n; ++j) sum += to_float(row[j]) * to_float(row[j]);
      for (float p : partial) sum += p;
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
      T* y = dst + r * n;
      // As step_ops.rms_norm's torch ops (and transformers' Llama norm): x * scale rounded to
      // x's dtype, then times the weight in that dtype.
      for (int64_t i = 0; i < n; ++i) {
        const T normed = from_float<T>(to_float(row[i]) * scale);
        y[i] = from_float<T>(to_float(normed) * to_float(w[i]));
      }
    }
  });
}

template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
               at::Tensor& out) {
  const Rows rows(x);
  const int64_t d = rows.cols, rotary = cos.size(-1), half = rotary / 2;
  const T* src = x.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = signed_sin.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for_rows(rows.outer * rows.inner, d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = src + rows.offset(r);
      const T* ct = c + r / rows.inner * rotary;
      const T* st = s + r / rows.inner * rotary;
      T* y = dst + r * d;
      // As apply_rope's torch ops: x * cos rounded to x's dtype, plus swapped halves times
      // the signed sin.
      for (int64_t i = 0; i < rotary; ++i) {
        const float swapped = to_float(row[i < half ? i + half : i - half]);
        const T first = from_float<T>(to_float(row[i]) * to_float(ct[i]));
        y[i] = from_float<T>(to_float(first) + swapped * to_float(st[i]));
      }
      std::memcpy(y + rotary, row + rotary, (d - rotary) * sizeof(T));
    }
  });
}

template <typename S, typename C>
void write_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const Rows rows(x);
  const int64_t slot_size = rows.inner * rows.cols;
  const S* src = x.data_ptr<S>();
  C* dst = cache.data_ptr<C>();
  for_rows(rows.outer * rows.inner, rows.cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* row = src + rows.offset(r);
      C* y = dst + slots[r / rows.inner] * slot_size + r % rows.inner * rows.cols;
      if constexpr (std::is_same_v<S, C>) {
        std::memcpy(y, row, rows.cols * sizeof(C));
      } else {
        for (int64_t i = 0; i < rows.cols; ++i) y[i] = from_float<C>(to_float(row[i]));
      }
    }
  });
}

// Rows of x as the int8 cache's rows (kernels/kv_format.py), bytes equal to quantize_q8's:
// per 32 values, scale = max |x| / 127 rounded to f16, codes x / scale rounded to nearest
// even (nearbyint, as torch's round) and held within +-127.
template <typename S>
void quantize_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  constexpr int64_t kGroup = 32;
  const Rows rows(x);
  const int64_t d = rows.cols, row_bytes = cache.size(3);
  const S* src = x.data_ptr<S>();
  uint8_t* dst = cache.data_ptr<uint8_t>();
  for_rows(rows.outer * rows.inner, d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* row = src + rows.offset(r);
      uint8_t* y = dst + (slots[r / rows.inner] * rows.inner + r % rows.inner) * row_bytes;
      for (int64_t g = 0; g < d; g += kGroup) {
        float amax = 0.0f;
        for (int64_t i = g; i < g + kGroup; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
        const c10::Half scale(amax / 127.0f);
        const float wide = static_cast<float>(scale);
        for (int64_t i = g; i < g + kGroup; ++i) {
          const float code = wide > 0.0f ? std::nearbyint(to_float(row[i]) / wide) : 0.0f;
          y[i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(code, -127.0f, 127.0f)));
        }
        std::memcpy(y + d + 2 * (g / kGroup), &scale.x, sizeof scale.x);
      }
    }
  });
}

template <typename S>
void write_from(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  switch (cache.scalar_type()) {
    case at::kFloat: return write_rows<S, float>(x, cache, slots);
    case at::kBFloat16: return write_rows<S, c10::BFloat16>(x, cache, slots);
    case at::kHalf: return write_rows<S, c10::Half>(x, cache, slots);
    default: return quantize_rows<S>(x, cache, slots);  // uint8, as write_kv checked
  }
}

}  // namespace gapless_step
