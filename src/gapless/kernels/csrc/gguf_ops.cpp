// Torch ops over GGUF weight blocks (gguf_blocks.h): dequantize, the decode-row product
// (gemv: activations quantized to 8 bits per block, integer dots with the blocks as stored)
// and the prompt-chunk product (mm: a tile of rows dequantized at a time, then a GEMM).
#include "gguf_weight.h"

namespace {

namespace gg = gapless_gguf;
using gg::block_type;
using gg::to_bf16;
using gg::Weight;

// Rows r0..r1 of the weight as floats (or bf16) at out, `cols` a row; `scratch` holds a row
// of floats, `bytes` a group of rows. Interleaved: r0 and r1 multiples of kGroupRows.
void dequantize_rows(const Weight& w, int64_t r0, int64_t r1, int64_t cols, at::ScalarType dtype,
                     void* out, float* scratch, std::vector<uint8_t>& bytes) {
  for (int64_t g = r0; g < r1; g += gg::kGroupRows) {
    const uint8_t* rows = w.group(g, bytes);
    for (int64_t r = g; r < std::min(r1, g + gg::kGroupRows); ++r) {
      const uint8_t* row = rows + (r - g) * w.row_bytes;
      if (dtype == at::kFloat) {
        w.t.dequantize(row, static_cast<float*>(out) + (r - r0) * cols, w.nblocks);
      } else {
        w.t.dequantize(row, scratch, w.nblocks);
        to_bf16(scratch, static_cast<uint16_t*>(out) + (r - r0) * cols, cols);
      }
    }
  }
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t cols, at::ScalarType dtype,
                      bool interleaved) {
  const Weight w(block_type(qtype), blocks, cols, interleaved);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize gives float32 or bfloat16");
  const int64_t rows = blocks.size(0), groups = (rows + gg::kGroupRows - 1) / gg::kGroupRows;
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(dtype));
  const size_t elem = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> scratch(cols);
    std::vector<uint8_t> bytes;
    const int64_t r0 = g0 * gg::kGroupRows, r1 = std::min(rows, g1 * gg::kGroupRows);
    dequantize_rows(w, r0, r1, cols, dtype, dst + r0 * cols * elem, scratch.data(), bytes);
  });
  return out;
}

// The blocks [R, row bytes] in the interleaved layout: the same bytes, permuted.
at::Tensor interleave(const at::Tensor& blocks, int64_t qtype, int64_t cols) {
  const Weight w(block_type(qtype), blocks, cols, true);  // checks that the type and rows can
  at::Tensor out = at::empty_like(blocks);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks.size(0) / gg::kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t offset = g * gg::kGroupRows * w.row_bytes;
      Weight::permute_group<true>(w.t, dst + offset, const_cast<uint8_t*>(w.data) + offset,
                                  w.row_bytes, w.nblocks);
    }
  });
  return out;
}

// Rows `index` [n] of the blocks, in the file's layout: an embedding lookup's.
at::Tensor take_rows(const at::Tensor& blocks, int64_t qtype, int64_t cols, const at::Tensor& index,
                     bool interleaved) {
  const Weight w(block_type(qtype), blocks, cols, interleaved);
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "index must be int64 [n]");
  const at::Tensor idx = index.contiguous();
  const int64_t n = idx.size(0), rows = blocks.size(0);
  at::Tensor out = at::empty({n, w.row_bytes}, blocks.options());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = idx.data_ptr<int64_t>()[i];
    TORCH_CHECK(r >= 0 && r < rows, "row ", r, " is outside the ", rows, " rows");
    uint8_t* dst = out.data_ptr<uint8_t>() + i * w.row_bytes;
    if (!interleaved) {
      std::memcpy(dst, w.data + r * w.row_bytes, w.row_bytes);
    } else {
      const int64_t first = r / gg::kGroupRows * gg::kGroupRows;  // of its group
      uint8_t* group = const_cast<uint8_t*>(w.data) + first * w.row_bytes;
      Weight::permute_row<false>(w.t, group, dst, r - first, w.nblocks);
    }
  }
  return out;
}

at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype,
                bool interleaved) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "gemv takes float32 activations [M, K]");
  const at::Tensor x = x_in.contiguous();  // here, not in Python: a dispatch less a call
  const Weight w(block_type(qtype), blocks, x.size(1), interleaved);
  const int64_t m = x.size(0), n = blocks.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  gg::gemv_rows(x.data_ptr<float>(), m, x.size(1), w, n, out.data_ptr<float>(), n);
  return out;
}

// The MLP's epilogues, applied to each tile's output columns while they are in cache, as the
// dense oneDNN linear fuses them: silu(y), or y * times.
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, bool interleaved,
              bool silu, const std::optional<at::Tensor>& times) {
  TORCH_CHECK((x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                  x_in.dim() == 2,
              "mm takes float32 or bfloat16 activations [M, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t k = x.size(1);
  const Weight w(block_type(qtype), blocks, k, interleaved);
  const int64_t n = blocks.size(0);
  TORCH_CHECK(!times || (times->size(0) == x.size(0) && times->size(1) == n),
              "mm's times must be [M, N]");
  // Each thread takes an even share of the rows and walks it in tiles of at most 256 rows
  // (~0.5-2.5 MB of bf16): it dequantizes a tile into its buffer and runs the GEMM there,
  // single-threaded (ATen's ops are, inside parallel_for). Smaller tiles lose to the GEMM's
  // per-call packing; tiles of a multiple of 32 rows keep it on whole register blocks (244
  // rows ran ~8% slower than 240 or 256).
  constexpr int64_t kMaxTile = 256, kAlign = 32;
  const int64_t units = (n + kAlign - 1) / kAlign;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  // Worker threads do not inherit the caller's inference mode, and `out` is an inference
  // tensor when the caller runs in one (the decoder's forward): writing it needs it too.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    c10::InferenceMode guard(inference);
    std::vector<float> scratch(k);
    std::vector<uint8_t> bytes;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t start = units * p / parts * kAlign;
      const int64_t stop = std::min(n, units * (p + 1) / parts * kAlign);
      if (start >= stop) continue;
      const int64_t count = (stop - start + kMaxTile - 1) / kMaxTile;
      const int64_t tile = ((stop - start + count - 1) / count + kAlign - 1) / kAlign * kAlign;
      at::Tensor buffer = at::empty({std::min(tile, stop - start), k}, x.options());
      for (int64_t r0 = start; r0 < stop; r0 += tile) {
        const int64_t r1 = std::min(stop, r0 + tile);
        dequantize_rows(w, r0, r1, k, x.scalar_type(), buffer.data_ptr(), scratch.data(), bytes);
        at::Tensor dst = out.narrow(1, r0, r1 - r0);  // out[:, r0:r1] = x @ tile^T, in place
        at::mm_out(dst, x, buffer.narrow(0, 0, r1 - r0).t());
        if (silu) at::silu_(dst);
        if (times) dst.mul_(times->narrow(1, r0, r1 - r0));
      }
    }
  });
  return out;
}

}  // namespace

void register_step_ops(pybind11::module_& m);    // step_ops.cpp
void register_expert_ops(pybind11::module_& m);  // expert_ops.cpp
void register_decode_layers(pybind11::module_& m);  // decode_layers.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_type", [](int64_t qtype) {
    return gg::q32_type(qtype) != nullptr || gg::kquant_type(qtype) != nullptr;
  });
  m.def("can_interleave", [](int64_t qtype) {
    const gg::BlockType* t = gg::q32_type(qtype);
    return t != nullptr && t->code_bytes > 0;
  });
  m.def("interleave", &interleave, "GGUF blocks [R, row bytes] with rows interleaved by 16");
  m.def("take_rows", &take_rows, "rows of GGUF blocks, interleaved or not, in the file's layout");
  using pybind11::arg;
  m.def("dequantize", &dequantize, "GGUF blocks [R, row bytes] to [R, cols] in dtype",
        arg("blocks"), arg("qtype"), arg("cols"), arg("dtype"), arg("interleaved") = false);
  m.def("gemv", &gemv, "x float32 [M, K] times GGUF blocks [N, row bytes]^T, via 8-bit x",
        arg("x"), arg("blocks"), arg("qtype"), arg("interleaved") = false);
  m.def("mm", &mm, "x [M, K] times GGUF blocks^T, a dequantized tile of rows at a time",
        arg("x"), arg("blocks"), arg("qtype"), arg("interleaved") = false, arg("silu") = false,
        arg("times") = pybind11::none());
  register_step_ops(m);
  register_expert_ops(m);
  register_decode_layers(m);
}
