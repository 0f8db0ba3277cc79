// Torch ops over GGUF weight blocks (gguf_blocks.h): dequantize, the decode-row product
// (gemv: activations quantized to 8 bits per block, integer dots with the blocks as stored)
// and the prompt-chunk product (mm: a tile of rows dequantized at a time, then a GEMM).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// Floats to bf16, rounding to nearest even as Tensor.to(bfloat16) does (for all but NaNs'
// payloads; dequantized weights are finite).
void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(src + j));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
#elif defined(__AVX2__)
  const auto round = [](const float* p) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(p));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    return _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  };
  for (; j + 16 <= n; j += 16) {
    // packus interleaves the two halves' 128-bit lanes; the permute puts them back in order.
    const __m256i packed = _mm256_packus_epi32(round(src + j), round(src + j + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm256_permute4x64_epi64(packed, 0xd8));
  }
#endif
  for (; j < n; ++j) dst[j] = c10::BFloat16(src[j]).x;
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
      to_bf16(scratch, static_cast<uint16_t*>(out) + (r - r0) * cols, cols);
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
      if (t.dot_rows != nullptr && m > 1) {
        t.dot_rows(row, acts.data(), act_row_bytes, m, y + r, n, nblocks);
      } else {
        for (int64_t i = 0; i < m; ++i)
          y[i * n + r] = t.dot(row, acts.data() + i * act_row_bytes, nblocks);
      }
    }
  });
  return out;
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  const gg::BlockType& t = block_type(qtype);
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "mm takes contiguous float32 or bfloat16 activations [M, K]");
  const int64_t k = x.size(1);
  check_blocks(blocks, t, k);
  const int64_t n = blocks.size(0);
  // Each thread takes an even share of the rows and walks it in tiles of at most 256 rows
  // (~0.5-2.5 MB of bf16): it dequantizes a tile into its buffer and runs the GEMM there,
  // single-threaded (ATen's ops are, inside parallel_for). Smaller tiles lose to the GEMM's
  // per-call packing; tiles of a multiple of 32 rows keep it on whole register blocks (244
  // rows ran ~8% slower than 240 or 256).
  constexpr int64_t kMaxTile = 256, kAlign = 32;
  const int64_t units = (n + kAlign - 1) / kAlign;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  // Worker threads do not inherit the caller's inference mode, and `out` is an inference
  // tensor when the caller runs in one (the decoder's forward): writing it needs it too.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    c10::InferenceMode guard(inference);
    std::vector<float> scratch(k);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t start = units * p / parts * kAlign;
      const int64_t stop = std::min(n, units * (p + 1) / parts * kAlign);
      if (start >= stop) continue;
      const int64_t count = (stop - start + kMaxTile - 1) / kMaxTile;
      const int64_t tile = ((stop - start + count - 1) / count + kAlign - 1) / kAlign * kAlign;
      at::Tensor buffer = at::empty({std::min(tile, stop - start), k}, x.options());
      for (int64_t r0 = start; r0 < stop; r0 += tile) {
        const int64_t r1 = std::min(stop, r0 + tile);
        dequantize_rows(t, w, r0, r1, k, x.scalar_type(), buffer.data_ptr(), scratch.data());
        at::Tensor dst = out.narrow(1, r0, r1 - r0);  // out[:, r0:r1] = x @ tile^T, in place
        at::mm_out(dst, x, buffer.narrow(0, 0, r1 - r0).t());
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_type", [](int64_t qtype) {
    return gg::q32_type(qtype) != nullptr || gg::kquant_type(qtype) != nullptr;
  });
  m.def("dequantize", &dequantize, "GGUF blocks [R, row bytes] to [R, cols] in dtype");
  m.def("gemv", &gemv, "x float32 [M, K] times GGUF blocks [N, row bytes]^T, via 8-bit x");
  m.def("mm", &mm, "x [M, K] times GGUF blocks^T, a dequantized tile of rows at a time");
}
