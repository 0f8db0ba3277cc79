// A GGUF weight's blocks as our kernels hold them (Weight), and the decode-row product on
// them (gemv_rows): gguf_ops.cpp wraps it as a torch op, and decode_layers.cpp calls it inside
// its one call a step.
#pragma once

#include "torch_api.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"

namespace gapless_gguf {

inline const BlockType& block_type(int64_t qtype) {
  const BlockType* t = q32_type(qtype);
  if (t == nullptr) t = kquant_type(qtype);
  TORCH_CHECK(t != nullptr, "GGUF block type ", qtype,
              " has no kernel here (have Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and the K-quants)");
  return *t;
}

// Blocks [rows, nblocks * block_bytes] holding `cols` values a row: the number of blocks.
inline int64_t check_blocks(const at::Tensor& blocks, const BlockType& t, int64_t cols) {
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
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
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

// A weight's blocks: rows of row_bytes, in the file's layout or interleaved (gguf_blocks.h).
struct Weight {
  const BlockType& t;
  int64_t nblocks;  // before data: its check says what is wrong with the blocks
  const uint8_t* data;
  int64_t row_bytes;
  bool interleaved;

  Weight(const BlockType& type, const at::Tensor& blocks, int64_t cols, bool interleaved)
      : t(type),
        nblocks(check_blocks(blocks, type, cols)),
        data(blocks.data_ptr<uint8_t>()),
        row_bytes(blocks.size(1)),
        interleaved(interleaved) {
    TORCH_CHECK(!interleaved || (t.code_bytes > 0 && blocks.size(0) % kGroupRows == 0),
                t.name, " blocks cannot be interleaved (or not in ", blocks.size(0), " rows)");
  }

  // Rows r .. r + kGroupRows - 1 (r a multiple of it where interleaved), in the file's
  // layout: where they lie, or unpacked into scratch.
  const uint8_t* group(int64_t r, std::vector<uint8_t>& scratch) const {
    if (!interleaved) return data + r * row_bytes;
    scratch.resize(kGroupRows * row_bytes);
    permute_group<false>(t, const_cast<uint8_t*>(data) + r * row_bytes, scratch.data(),
                         row_bytes, nblocks);
    return scratch.data();
  }

  // The group's rows, from the file's layout at `rows` into the interleaved one at `group`
  // (kToGroup), or back.
  template <bool kToGroup>
  static void permute_group(const BlockType& t, uint8_t* group, uint8_t* rows,
                            int64_t row_bytes, int64_t nblocks) {
    for (int64_t r = 0; r < kGroupRows; ++r)
      permute_row<kToGroup>(t, group, rows + r * row_bytes, r, nblocks);
  }

  // One row, `lane` of its group, likewise.
  template <bool kToGroup>
  static void permute_row(const BlockType& t, uint8_t* group, uint8_t* row, int64_t lane,
                          int64_t nblocks) {
    const int64_t g = kGroupRows, fields = t.block_bytes - t.code_bytes;
    const auto move = [](uint8_t* in_group, uint8_t* in_row, size_t n) {
      if constexpr (kToGroup)
        std::memcpy(in_group, in_row, n);
      else
        std::memcpy(in_row, in_group, n);
    };
    for (int64_t b = 0; b < nblocks; ++b) {
      uint8_t* dst = group + b * g * t.block_bytes;
      uint8_t* block = row + b * t.block_bytes;
      for (int64_t i = 0; i < fields; i += 2) move(dst + i * g + 2 * lane, block + i, 2);
      for (int64_t i = 0; i < t.code_bytes; i += 4)
        move(dst + (fields + i) * g + 4 * lane, block + fields + i, 4);
    }
  }
};

// Activation rows x [m, k] quantized in the type's format, act_row_bytes apart, into acts.
inline void quantize_acts(const BlockType& t, const float* x, int64_t m, int64_t k,
                          std::vector<uint8_t>& acts, int64_t* act_row_bytes) {
  const int64_t nblocks = k / t.block_elems;
  const bool q8 = t.act == ActFormat::Q8;
  *act_row_bytes = nblocks * (q8 ? sizeof(ActQ8) : sizeof(ActQ8K));
  acts.resize(m * *act_row_bytes);
  at::parallel_for(0, m, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      void* dst = acts.data() + i * *act_row_bytes;
      if (q8)
        quantize_act_q8(x + i * k, static_cast<ActQ8*>(dst), k);
      else
        quantize_act_q8k(x + i * k, static_cast<ActQ8K*>(dst), k);
    }
  });
}

// x float32 [m, k] (contiguous) times the weight's n rows, transposed: y[i * y_stride + r] for
// row r. The activations are quantized to 8 bits per block, then dotted with the blocks as
// stored; each weight row is read from memory once and dotted with every activation row while
// it sits in L1. A grain of 16 rows still splits the narrowest layers over the threads.
inline void gemv_rows(const float* x, int64_t m, int64_t k, const Weight& w, int64_t n, float* y,
                      int64_t y_stride) {
  const BlockType& t = w.t;
  const int64_t nblocks = w.nblocks;
  int64_t act_row_bytes;
  std::vector<uint8_t> acts;
  quantize_acts(t, x, m, k, acts, &act_row_bytes);
  const auto dot_row = [&](const uint8_t* row, int64_t r) {
    if (t.dot_rows != nullptr && m > 1) {
      t.dot_rows(row, acts.data(), act_row_bytes, m, y + r, y_stride, nblocks);
    } else {
      for (int64_t i = 0; i < m; ++i)
        y[i * y_stride + r] = t.dot(row, acts.data() + i * act_row_bytes, nblocks);
    }
  };
  if (!w.interleaved) {
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t r = n0; r < n1; ++r) dot_row(w.data + r * w.row_bytes, r);
    });
    return;
  }
  at::parallel_for(0, n / kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> bytes;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * kGroupRows;
      if (t.dot_group != nullptr) {
        t.dot_group(w.data + r0 * w.row_bytes, acts.data(), act_row_bytes, m, y + r0, y_stride,
                    nblocks);
      } else {  // the portable build: each group unpacked, its rows dotted as they are
        const uint8_t* rows = w.group(r0, bytes);
        for (int64_t r = 0; r < kGroupRows; ++r) dot_row(rows + r * w.row_bytes, r0 + r);
      }
    }
  });
}

}  // namespace gapless_gguf
