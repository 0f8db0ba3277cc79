// GGUF weight blocks as the files store them, and what our kernels need of each type.
//
// A quantized [rows, cols] weight is held as the file's own bytes: each row is cols /
// block_elems blocks of block_bytes, in ggml's layout. A kernel never unpacks a whole weight:
// decode rows (few activation rows) quantize the activations to 8 bits per block and take
// integer dot products with the weight blocks, as llama.cpp does; prompt chunks dequantize a
// tile of rows at a time into a small buffer and multiply there (gguf_ops.cpp).
//
// Each block type lives in one file of functions (gguf_q32.cpp: the 32-element types,
// gguf_kquants.cpp: the 256-element super-block types) and is found through block_type().
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gapless_gguf {

// ggml's type numbers (GGMLQuantizationType in the `gguf` package).
enum GgmlType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23,
};

// Activations quantized per 32 values for the 32-element weight types: x ~ d * q.
// s = d * sum(q), which the types with an offset (Q4_1, Q5_1) and the ones centred on a
// code (Q4_0: q - 8, Q5_0: q - 16) fold in without touching every value again.
struct ActQ8 {
  float d;
  float s;
  int8_t q[32];
};

// Activations quantized per 256 values for the K-quant types (ggml's Q8_K): x ~ d * q, and
// bsums[j] = sum of q[16 j .. 16 j + 15], for the types' per-16 minimums and offsets.
struct ActQ8K {
  float d;
  int16_t bsums[16];
  int8_t q[256];
};

enum class ActFormat { Q8, Q8K };

struct BlockType {
  const char* name;
  int64_t block_elems;  // 32 or 256
  int64_t block_bytes;
  ActFormat act;
  // One row of nblocks blocks to block_elems * nblocks floats, exactly as gguf.quants does.
  void (*dequantize)(const uint8_t* row, float* out, int64_t nblocks);
  // The dot product of one row of nblocks weight blocks with one activation row quantized
  // in `act` (nblocks ActQ8 per 32-element block, or nblocks ActQ8K per 256).
  float (*dot)(const uint8_t* row, const void* act, int64_t nblocks);
  // Optional (nullptr: gemv calls dot per activation row): the dots of one row with m
  // activation rows act_row_bytes apart, into out[i * out_stride]. A type that unpacks each
  // weight block once for several rows spares decode batches most of their unpacking.
  void (*dot_rows)(const uint8_t* row, const void* act, int64_t act_row_bytes, int64_t m,
                   float* out, int64_t out_stride, int64_t nblocks) = nullptr;
  // Where > 0, the type's rows can be interleaved (below): its blocks end in this many code
  // bytes, after 2-byte fields (d, and m where it has one).
  int64_t code_bytes = 0;
  // Optional (nullptr: gemv unpacks each group and takes dot_rows): the dots of one group of
  // kGroupRows interleaved rows with m activation rows, row r of the group and activation
  // row i into out[i * out_stride + r].
  void (*dot_group)(const uint8_t* group, const void* act, int64_t act_row_bytes, int64_t m,
                    float* out, int64_t out_stride, int64_t nblocks) = nullptr;
};

// Interleaved rows, the layout decode reads fastest (what llama.cpp calls repacking): rows in
// groups of kGroupRows, and per group and block column the group's blocks rearranged so that
// one 512-bit vector holds the same four code bytes of every row, each row's in its own lane:
//   each 2-byte field (d, then m) of the group's rows in turn, kGroupRows * 2 bytes a field;
//   then for c = 0, 1, ...: code bytes 4c .. 4c + 3 of each row in turn, 4 * kGroupRows bytes.
// A dot then unpacks and scales 16 rows per instruction, and sums no lanes. The same bytes as
// the file's, permuted (interleave_group / deinterleave_group, gguf_ops.cpp).
constexpr int64_t kGroupRows = 16;

// The 32-element types (gguf_q32.cpp) and the K-quant types (gguf_kquants.cpp): the type's
// entry, or nullptr where that file does not have it.
const BlockType* q32_type(int64_t ggml_type);
const BlockType* kquant_type(int64_t ggml_type);

// Activation quantizers (gguf_q32.cpp, gguf_kquants.cpp): x has n values, n a multiple of
// 32 (ActQ8) or 256 (ActQ8K).
void quantize_act_q8(const float* x, ActQ8* out, int64_t n);
void quantize_act_q8k(const float* x, ActQ8K* out, int64_t n);

// IEEE half to float, for the blocks' scales (F16C where built with it).
float half_to_float(uint16_t h);

#if defined(__AVX2__)
// The sum of v's 8 lanes (the vector paths' last step, both files).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// 256-bit integer dot products in one instruction each: AVX512-VNNI's (with VL), or on CPUs
// without AVX-512 (Alder Lake and later Intel cores) AVX-VNNI's VEX forms of the same ops.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define GGUF_VNNI256 1
// acc + the 8 int32 sums of four unsigned u times signed q bytes.
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i q) {
  return _mm256_dpbusd_epi32(acc, u, q);
}
// acc + the 8 int32 sums of two int16 a times b.
inline __m256i dpwssd256(__m256i acc, __m256i a, __m256i b) {
  return _mm256_dpwssd_epi32(acc, a, b);
}
#elif defined(__AVXVNNI__)
#define GGUF_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i q) {
  return _mm256_dpbusd_avx_epi32(acc, u, q);
}
inline __m256i dpwssd256(__m256i acc, __m256i a, __m256i b) {
  return _mm256_dpwssd_avx_epi32(acc, a, b);
}
#endif

}  // namespace gapless_gguf
