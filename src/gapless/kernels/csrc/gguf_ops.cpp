// Torch ops over GGUF weight blocks (gguf_blocks.h): dequantize, the decode-row product
// (gemv: activations quantized to 8 bits per block, integer dots with the blocks as stored)
// and the prompt-chunk product (mm: a tile of rows dequantized at a time, then a GEMM).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"

namespace {

namespace gg = gapless_gguf;

const gg::BlockType& block_type(int64_t qtype) {
  const gg::BlockType* t = gg::q32_type(qtype);
  if (t == nullptr) t = gg::kquant_type(qtype);
  TORCH_CHECK(t != nullptr, "GGUF block type ", qtype,
              " has no kernel here (have Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and the K-quants)");
  return *t;
}

// Blocks [rows, nblocks * block_bytes] holding `cols` values a row: the number of blocks.
int64_t check_blocks(const at::Tensor& blocks, const gg::BlockType& t, int64_t cols) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 tensor [rows, bytes per row]");
  TORCH_CHECK(cols % t.block_elems == 0, t.name, " rows hold multiples of ", t.block_elems,
              " values, not ", cols);
  const int64_t nblocks = cols / t.block_elems;
  TORCH_CHECK(blocks.size(1) == nblocks * t.block_bytes, t.name, " rows of ", cols,
              " values take ", nblocks * t.block_bytes, " bytes, not ", blocks.size(1));
  return nblocks;
}

inline uint16_t to_bf16_bits(float f) {
  return c10::BFloat16(f).x;  // round to nearest even, as Tensor.to(bfloat16)
}

// Rows r0..r1 of the blocks as floats (or bf16) at out, `cols` a row; `scratch` holds a row.
void dequantize_rows(const gg::BlockType& t, const uint8_t* blocks, int64_t r0, int64_t r1,
                     int64_t cols, at::ScalarType dtype, void* out, float* scratch) {
  const int64_t nblocks = cols / t.block_elems, row_bytes = nblocks * t.block_bytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = blocks + r * row_bytes;
    if (dtype == at::kFloat) {
      t.dequantize(row, static_cast<float*>(out) + (r - r0) * cols, nblocks);
    } else {
      t.dequantize(row, scratch, nblocks);
      uint16_t* dst = static_cast<uint16_t*>(out) + (r - r0) * cols;
      for (int64_t j = 0; j < cols; ++j) dst[j] = to_bf16_bits(scratch[j]);
    }
  }
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t cols,
                      at::ScalarType dtype) {
  const gg::BlockType& t = block_type(qtype);
  check_blocks(blocks, t, cols);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize gives float32 or bfloat16");
  const int64_t rows = blocks.size(0);
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(dtype));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const size_t elem = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(cols);
    dequantize_rows(t, src, r0, r1, cols, dtype, dst + r0 * cols * elem, scratch.data());
  });
  return out;
}

// Activation rows x [M, K] quantized in the type's format: M rows of act_bytes each.
std::vector<uint8_t> quantize_acts(const gg::BlockType& t, const at::Tensor& x,
                                   int64_t* act_row_bytes) {
  const int64_t m = x.size(0), k = x.size(1), nblocks = k / t.block_elems;
  const bool q8 = t.act == gg::ActFormat::Q8;
  *act_row_bytes = nblocks * (q8 ? sizeof(gg::ActQ8) : sizeof(gg::ActQ8K));
  std::vector<uint8_t> acts(m * *act_row_bytes);
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      void* dst = acts.data() + i * *act_row_bytes;
      if (q8)
        gg::quantize_act_q8(src + i * k, static_cast<gg::ActQ8*>(dst), k);
      else
        gg::quantize_act_q8k(src + i * k, static_cast<gg::ActQ8K*>(dst), k);
    }
  });
  return acts;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  const gg::BlockType& t = block_type(qtype);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "gemv takes contiguous float32 activations [M, K]");
  const int64_t nblocks = check_blocks(blocks, t, x.size(1));
  const int64_t m = x.size(0), n = blocks.size(0), row_bytes = blocks.size(1);
  int64_t act_row_bytes;
  const std::vector<uint8_t> acts = quantize_acts(t, x, &act_row_bytes);
  at::Tensor out = at::empty({m, n}, x.options());
  float* y = out.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  // Each weight row is read from memory once and dotted with every activation row while it
  // sits in L1. A grain of 16 rows still splits the narrowest layers over the threads.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      const uint8_t* row = w + r * row_bytes;
      for (int64_t i = 0; i < m; ++i)
        y[i * n + r] = t.dot(row, acts.data() + i * act_row_bytes, nblocks);
    }
  });
  return out;
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t tile) {
  const gg::BlockType& t = block_type(qtype);
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "mm takes contiguous float32 or bfloat16 activations [M, K]");
  const int64_t k = x.size(1);
  check_blocks(blocks, t, k);
  const int64_t n = blocks.size(0);
  const at::ScalarType dtype = x.scalar_type();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const at::Tensor xt = x.t();
  // out^T [N, M]: a tile of weight rows gives whole contiguous rows of it.
  at::Tensor out_t = at::empty({n, x.size(0)}, x.options());
  const int64_t tiles = (n + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor buffer = at::empty({tile, k}, x.options());
    std::vector<float> scratch(k);
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t r0 = i * tile, r1 = std::min(n, r0 + tile);
      dequantize_rows(t, w, r0, r1, k, dtype, buffer.data_ptr(), scratch.data());
      at::Tensor dst = out_t.narrow(0, r0, r1 - r0);
      at::mm_out(dst, buffer.narrow(0, 0, r1 - r0), xt);
    }
  });
  return out_t.t().contiguous();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_type", [](int64_t qtype) {
    return gg::q32_type(qtype) != nullptr || gg::kquant_type(qtype) != nullptr;
  });
  m.def("dequantize", &dequantize, "GGUF blocks [R, row bytes] to [R, cols] in dtype");
  m.def("gemv", &gemv, "x float32 [M, K] times GGUF blocks [N, row bytes]^T, via 8-bit x");
  m.def("mm", &mm, "x [M, K] times GGUF blocks^T, a dequantized tile of rows at a time",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("tile") = 64);
}
