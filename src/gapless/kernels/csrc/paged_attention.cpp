// Attention straight from the paged KV cache: each sequence's keys are found through its
// block table. No gather of the history, no padding, no mask tensor.
//
// Decodes (one query per sequence): work items are (sequence, KV head) pairs; each reads that
// head's keys and values once for all the query heads that share it (GQA), so a step streams
// the cache once. Prompt chunks (n queries per sequence, causal against everything before, or
// up to a later last key per query): items are (sequence, KV head, tile of queries), each
// walking its keys 32 at a time with an online softmax, as flash attention does. Scores and
// sums in float32 whatever the dtypes.
//
// With AMX, the build for it runs both products of a prompt chunk on the tile unit (see
// prefill_amx); its decodes are the AVX-512 code's.
//
// The cache has its own storage type, whatever the query's (float32 or bf16): float32, bf16,
// f16, or int8 rows (kernels/kv_format.py: a head's D codes, then its D / 32 f16 scales).
// Each is read in place and converted a vector at a time as it is used: no dequantized copy.
#include "paged_entry.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr float kMasked = -1e30f;  // finite: -ffast-math assumes no infinities

// The int8 cache's type, as the templates name it; its elements are the rows' bytes.
struct Int8 {};
constexpr int kQ8Group = 32;  // values per f16 scale (kv_format.Q8_GROUP)

// How a cache type lays out one token's row of one head, D values.
template <typename C>
struct Stored {
  using Elem = C;
  static constexpr int64_t row(int64_t d) { return d; }
};
template <>
struct Stored<Int8> {
  using Elem = uint8_t;
  static constexpr int64_t row(int64_t d) { return d + 2 * (d / kQ8Group); }
};
template <typename C>
using Elem = typename Stored<C>::Elem;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The f16 scale of the int8 values [dim, dim + 32) of a row.
inline uint16_t q8_scale_bits(const uint8_t* row, int64_t d, int64_t dim) {
  uint16_t bits;
  std::memcpy(&bits, row + d + 2 * (dim / kQ8Group), sizeof bits);
  return bits;
}

// One head's row of the cache as float32 (the portable kernel's reads).
template <typename C, int D>
void row_to_float(const Elem<C>* row, float* out) {
  if constexpr (std::is_same_v<C, Int8>) {
    for (int g = 0; g < D; g += kQ8Group) {
      const float scale = static_cast<float>(c10::Half(q8_scale_bits(row, D, g), c10::Half::from_bits()));
      for (int i = g; i < g + kQ8Group; ++i) out[i] = static_cast<float>(static_cast<int8_t>(row[i])) * scale;
    }
  } else {
    for (int d = 0; d < D; ++d) out[d] = to_float(row[d]);
  }
}

// What both kernels read of their tensors: pointers, and the sizes that index them.
template <typename Q, typename C>
struct PagedArgs {
  const Q* q;
  const Elem<C>* keys;
  const Elem<C>* values;
  Q* out;
  const int64_t* tables;
  const int64_t* lengths;
  int64_t heads, block_size, kv_heads, group, table_width;
  int64_t head_stride;   // elements of one head's row in the cache
  int64_t token_stride;  // elements between two slots of a head

  PagedArgs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& num_keys, at::Tensor& result)
      : q(reinterpret_cast<const Q*>(query.data_ptr())),
        keys(reinterpret_cast<const Elem<C>*>(k_cache.data_ptr())),
        values(reinterpret_cast<const Elem<C>*>(v_cache.data_ptr())),
        out(reinterpret_cast<Q*>(result.data_ptr())),
        tables(block_tables.data_ptr<int64_t>()),
        lengths(num_keys.data_ptr<int64_t>()),
        heads(query.size(1)),
        block_size(k_cache.size(1)),
        kv_heads(k_cache.size(2)),
        group(heads / kv_heads),
        table_width(block_tables.size(1)),
        head_stride(Stored<C>::row(query.size(2))),
        token_stride(kv_heads * head_stride) {}
};

#if defined(__AVX2__)
// The vectors the decode kernel is written in: 16 float32 lanes on AVX-512, 8 on AVX2 (with
// FMA and F16C), the same algorithm on both.
#if defined(__AVX512F__)
struct Vec {
  using F = __m512;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* x) { return _mm512_loadu_ps(x); }
  static void store(float* x, F v) { _mm512_storeu_ps(x, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static float top(F v) { return _mm512_reduce_max_ps(v); }
  static F keep_first(F v, int64_t count) {  // lanes from `count` on zeroed
    return count >= W ? v : _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << count) - 1), v);
  }
  // 2^n for whole n in [-126, 127]
  static F exp2_whole(F n) { return _mm512_scalef_ps(set1(1.0f), n); }
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  static F from(const float* x) { return _mm512_loadu_ps(x); }
  static F from(const c10::BFloat16* x) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F from(const c10::Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
  static F from_codes(const uint8_t* codes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  }

  // Lane j of the result is the sum of the lanes of v[kSumOrder[j]]: a tree of 15 adds
  // instead of 16 separate horizontal sums.
  static constexpr int kSumOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  static F sum_each(const F* v) {
    F a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; ++i)
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  }
};
#else
struct Vec {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* x) { return _mm256_loadu_ps(x); }
  static void store(float* x, F v) { _mm256_storeu_ps(x, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float top(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static F keep_first(F v, int64_t count) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, W))), lanes);
    return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
  }
  static F exp2_whole(F n) {  // the exponent field of the float directly
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
  }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  static F from(const float* x) { return _mm256_loadu_ps(x); }
  static F from(const c10::BFloat16* x) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F from(const c10::Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
  static F from_codes(const uint8_t* codes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
  }

  // Lane j of the result is the sum of the lanes of v[j]: horizontal adds in a tree.
  static constexpr int kSumOrder[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  static F sum_each(const F* v) {
    const F a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const F a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const F b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // [v0..3 low, v0..3 high]
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  }
};
#endif
using F = Vec::F;
constexpr int W = Vec::W;

// exp(x) for x <= 0 (scores minus their running max): exp(f) * 2^n with x = f + n ln 2,
// |f| <= ln 2 / 2; Cephes' expf constants (ln 2 split in two, degree-6 polynomial).
inline F exp_nonpositive(F x) {
  x = Vec::max(x, Vec::set1(-87.0f));
  const F n = Vec::round(Vec::mul(x, Vec::set1(1.44269504f)));
  F f = Vec::fmadd(n, Vec::set1(-0.693359375f), x);
  f = Vec::fmadd(n, Vec::set1(2.12194440e-4f), f);
  F p = Vec::set1(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = Vec::fmadd(p, f, Vec::set1(c));
  p = Vec::fmadd(p, Vec::mul(f, f), Vec::add(f, Vec::set1(1.0f)));
  return Vec::mul(p, Vec::exp2_whole(n));
}

// Dims [dim, dim + W) of one head's row of the cache, as float32. An int8 row's W codes
// share one scale (W divides 32).
template <typename C, int D>
inline F load_dims(const Elem<C>* row, int dim) {
  if constexpr (std::is_same_v<C, Int8>)
    return Vec::mul(Vec::from_codes(row + dim), Vec::set1(_cvtsh_ss(q8_scale_bits(row, D, dim))));
  else
    return Vec::from(row + dim);
}

// One query head against one key: W partial sums of their dot product, in float32 FMAs; a
// bf16 query against a bf16 cache on the bf16 dot-product instruction, two dims per lane. A
// Key is one head's row of a key, converted once for all the query heads that share it.
template <typename Q, typename C, int D, typename = void>
struct QueryHead {
  struct Key {
    F dims[D / W];
    void load(const Elem<C>* k) {
      for (int c = 0; c < D / W; ++c) dims[c] = load_dims<C, D>(k, W * c);
    }
  };
  F dims[D / W];
  void load(const Q* q) {
    for (int c = 0; c < D / W; ++c) dims[c] = Vec::from(q + W * c);
  }
  F partial_dot(const Key& k) const {
    F s = Vec::mul(dims[0], k.dims[0]);
    for (int c = 1; c < D / W; ++c) s = Vec::fmadd(dims[c], k.dims[c], s);
    return s;
  }
};
#if defined(__AVX512BF16__)
template <int D>
struct QueryHead<c10::BFloat16, c10::BFloat16, D, std::enable_if_t<D % 32 == 0>> {
  struct Key {
    const c10::BFloat16* row;  // read as the instruction's operand: nothing to convert
    void load(const c10::BFloat16* k) { row = k; }
  };
  __m512bh pairs[D / 32];
  void load(const c10::BFloat16* q) {
    for (int c = 0; c < D / 32; ++c) pairs[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  }
  __m512 partial_dot(const Key& k) const {
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c) s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(k.row + 32 * c), pairs[c]);
    return s;
  }
};
#endif

// acc[g] += weights[g] @ values for W keys (the weights of head g at weights + g * stride).
// A chunk's padding repeats a real key with weight 0: fixed trip counts, no branches. A
// float32 cache's rows are read in place; another type's are converted once into a tile
// that every head of the group reads (in place, f32 decodes took 12-16% less time).
template <typename C, int D, typename = void>
struct ValueSum {
  static void add(const Elem<C>* values, const int64_t* slots, int64_t token_stride,
                  const float* weights, int64_t stride, int64_t group, float* acc, bool first) {
    constexpr bool kInPlace = std::is_same_v<C, float>;
    alignas(64) float tile[kInPlace ? 1 : W][D];
    const float* rows[W];
    for (int j = 0; j < W; ++j) {
      const Elem<C>* row = values + slots[j] * token_stride;
      if constexpr (kInPlace) {
        rows[j] = row;
      } else {
        for (int c = 0; c < D / W; ++c) Vec::store(tile[j] + W * c, load_dims<C, D>(row, W * c));
        rows[j] = tile[j];
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      F o[D / W];
      float* ag = acc + g * D;
      for (int c = 0; c < D / W; ++c) o[c] = first ? Vec::zero() : Vec::load(ag + W * c);
      const float* w = weights + g * stride;
      for (int j = 0; j < W; ++j) {
        const F wj = Vec::set1(w[j]);
        for (int c = 0; c < D / W; ++c) o[c] = Vec::fmadd(wj, Vec::load(rows[j] + W * c), o[c]);
      }
      for (int c = 0; c < D / W; ++c) Vec::store(ag + W * c, o[c]);
    }
  }
  static void finish(int64_t, float*) {}
};
#if defined(__AVX512BF16__)
// In bf16, two keys per lane on the dot-product instruction: each pair of value rows is
// interleaved once (unpacklo/hi_epi16), and the weights are rounded to bf16, as the prefill
// kernel does. The interleave leaves acc's lanes in a fixed order of dims, undone by finish.
template <int D>
struct ValueSum<c10::BFloat16, D, std::enable_if_t<D % 32 == 0>> {
  static constexpr int kVectors = D / 16;  // of acc per head: lo and hi of each 32 dims

  static void add(const c10::BFloat16* values, const int64_t* slots, int64_t token_stride,
                  const float* weights, int64_t stride, int64_t group, float* acc, bool first) {
    __m512i pairs[8][kVectors];
    for (int t = 0; t < 8; ++t) {
      const c10::BFloat16* even = values + slots[2 * t] * token_stride;
      const c10::BFloat16* odd = values + slots[2 * t + 1] * token_stride;
      for (int c = 0; c < D / 32; ++c) {
        const __m512i a = _mm512_loadu_si512(even + 32 * c);
        const __m512i b = _mm512_loadu_si512(odd + 32 * c);
        pairs[t][2 * c] = _mm512_unpacklo_epi16(a, b);
        pairs[t][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      alignas(32) uint32_t w[8];  // word t: the weights of keys 2t and 2t + 1, as bf16
      _mm256_store_si256(reinterpret_cast<__m256i*>(w),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights + g * stride)));
      __m512 o[kVectors];
      float* ag = acc + g * D;
      for (int c = 0; c < kVectors; ++c) o[c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ag + 16 * c);
      for (int t = 0; t < 8; ++t) {
        const __m512bh wt = (__m512bh)_mm512_set1_epi32(w[t]);
        for (int c = 0; c < kVectors; ++c) o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)pairs[t][c], wt);
      }
      for (int c = 0; c < kVectors; ++c) _mm512_storeu_ps(ag + 16 * c, o[c]);
    }
  }

  // Lane l of vector 2c (lo) holds dim 32c + 8 (l / 4) + l % 4; of vector 2c + 1 (hi), 4 more.
  static void finish(int64_t group, float* acc) {
    float dims[D];
    for (int64_t g = 0; g < group; ++g) {
      float* ag = acc + g * D;
      for (int v = 0; v < kVectors; ++v)
        for (int l = 0; l < 16; ++l) dims[32 * (v / 2) + 8 * (l / 4) + 4 * (v % 2) + l % 4] = ag[16 * v + l];
      std::copy(dims, dims + D, ag);
    }
  }
};
#endif

// Keys [first, n) of one sequence for all its query heads (kv_heads groups of `group`),
// vectorized: scores W keys at a time, then the softmax, then values W keys at a time. A
// key's row holds every KV head side by side, so the history is read as one stream; read a
// head at a time, a strided half or third of it, it came from memory at half the rate.
// Returns each head's unnormalized output in acc, its peak score and its sum of weights.
template <typename Q, typename C, int D>
void attend(const Q* query, float scale, const Elem<C>* __restrict keys,
            const Elem<C>* __restrict values, const int64_t* table, int64_t block_size,
            int64_t kv_heads, int64_t first, int64_t n, int64_t group, float* __restrict scores,
            float* __restrict peak, float* __restrict total, float* __restrict acc) {
  const int64_t len = n - first, padded = (len + W - 1) / W * W;
  const int64_t heads = kv_heads * group, row = Stored<C>::row(D), stride = kv_heads * row;
  std::vector<QueryHead<Q, C, D>> q(heads);
  for (int64_t i = 0; i < heads; ++i) q[i].load(query + i * D);
  std::vector<F> partial(heads * W);
  int64_t slots[W];
  // The slots of keys i0 .. i0 + W - 1, one division per W keys; past the last key, its slot
  // again (a real key, whose weight the softmax sets to 0). Keys of one block are consecutive
  // slots, so most tiles take no per-key bookkeeping.
  auto slots_of = [&](int64_t i0, int64_t* out) {
    int64_t block = (first + i0) / block_size, offset = (first + i0) % block_size;
    const int count = static_cast<int>(std::min<int64_t>(W, len - i0));
    if (offset + count <= block_size) {
      const int64_t slot = table[block] * block_size + offset;
      for (int j = 0; j < count; ++j) out[j] = slot + j;
    } else {
      for (int j = 0; j < count; ++j) {
        out[j] = table[block] * block_size + offset;
        if (++offset == block_size) offset = 0, ++block;
      }
    }
    std::fill(out + count, out + W, out[count - 1]);
  };
  // Each key's row of the tile two on is asked into L2 as the key of this tile at the same
  // place is used. Without it a tile's misses were taken only as its arithmetic reached them,
  // and reading a history went at a third of a streaming read; with it, 1.25-1.5x faster
  // (docs/benchmarks.md). Into L1 it did not help; nor did all of a tile's rows asked for at
  // once before it (10% slower from memory where the arithmetic was faster: SmolLM2's bf16).
  int64_t later[W];
  const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(Elem<C>));
  auto prefetch_row = [&](const Elem<C>* rows, int64_t slot) {
    const char* p = reinterpret_cast<const char*>(rows + slot * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  };
  // Whether the tile two on from i0 has keys; if it has, their slots are in `later`.
  auto look_ahead = [&](int64_t i0) {
    const bool ahead = i0 + 2 * W < len;
    if (ahead) slots_of(i0 + 2 * W, later);
    return ahead;
  };
  for (int64_t i0 = 0; i0 < len; i0 += W) {
    slots_of(i0, slots);
    const bool ahead = look_ahead(i0);
    for (int j = 0; j < W; ++j) {
      if (ahead) prefetch_row(keys, later[j]);
      const Elem<C>* key = keys + slots[j] * stride;
      for (int64_t h = 0; h < kv_heads; ++h) {
        typename QueryHead<Q, C, D>::Key k;
        k.load(key + h * row);
        for (int64_t g = 0; g < group; ++g)
          partial[(h * group + g) * W + Vec::kSumOrder[j]] = q[h * group + g].partial_dot(k);
      }
    }
    for (int64_t i = 0; i < heads; ++i)
      Vec::store(scores + i * padded + i0, Vec::mul(Vec::sum_each(&partial[i * W]), Vec::set1(scale)));
  }
  for (int64_t i = 0; i < heads; ++i) {
    float* si = scores + i * padded;
    for (int64_t k = len; k < padded; ++k) si[k] = kMasked;
    F top_lanes = Vec::load(si);
    for (int64_t k = W; k < padded; k += W) top_lanes = Vec::max(top_lanes, Vec::load(si + k));
    peak[i] = Vec::top(top_lanes);
    const F top = Vec::set1(peak[i]);
    F sum = Vec::zero();
    for (int64_t k = 0; k < padded; k += W) {
      const F w = Vec::keep_first(exp_nonpositive(Vec::sub(Vec::load(si + k), top)), len - k);
      Vec::store(si + k, w);
      sum = Vec::add(sum, w);
    }
    total[i] = Vec::sum(sum);
  }
  for (int64_t i0 = 0; i0 < len; i0 += W) {
    slots_of(i0, slots);
    const bool ahead = look_ahead(i0);
    for (int64_t h = 0; h < kv_heads; ++h) {  // the rows just read for head 0 are in cache
      for (int64_t j = h * W / kv_heads; ahead && j < (h + 1) * W / kv_heads; ++j)
        prefetch_row(values, later[j]);
      ValueSum<C, D>::add(values + h * row, slots, stride, scores + h * group * padded + i0, padded,
                          group, acc + h * group * D, i0 == 0);
    }
  }
  ValueSum<C, D>::finish(heads, acc);
}
#else
// Portable: one KV head at a time, scores key by key, the compiler vectorizing over dims.
template <typename Q, typename C, int D>
void attend_kv_head(const Q* query, float scale, const Elem<C>* __restrict keys,
                    const Elem<C>* __restrict values, const int64_t* table, int64_t block_size,
                    int64_t token_stride, int64_t first, int64_t n, int64_t group,
                    float* __restrict scores, float* __restrict peak, float* __restrict total,
                    float* __restrict acc) {
  const int64_t len = n - first;
  float row[D];
  std::vector<float> q(group * D);
  for (int64_t i = 0; i < group * D; ++i) q[i] = to_float(query[i]) * scale;
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
    row_to_float<C, D>(keys + slot * token_stride, row);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q.data() + g * D;
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
    peak[g] = sg[0];
    for (int64_t i = 1; i < len; ++i) peak[g] = std::max(peak[g], sg[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < len; ++i) {
      sg[i] = std::exp(sg[i] - peak[g]);
      sum += sg[i];
    }
    total[g] = sum;
  }
  std::fill(acc, acc + group * D, 0.0f);
  for_each_slot([&](int64_t i, int64_t slot) {
    row_to_float<C, D>(values + slot * token_stride, row);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * len + i];
      float* ag = acc + g * D;
      for (int d = 0; d < D; ++d) ag[d] += w * row[d];
    }
  });
}

template <typename Q, typename C, int D>
void attend(const Q* query, float scale, const Elem<C>* __restrict keys,
            const Elem<C>* __restrict values, const int64_t* table, int64_t block_size,
            int64_t kv_heads, int64_t first, int64_t n, int64_t group, float* __restrict scores,
            float* __restrict peak, float* __restrict total, float* __restrict acc) {
  const int64_t row = Stored<C>::row(D);
  for (int64_t h = 0; h < kv_heads; ++h)
    attend_kv_head<Q, C, D>(query + h * group * D, scale, keys + h * row, values + h * row, table,
                            block_size, kv_heads * row, first, n, group, scores, peak + h * group,
                            total + h * group, acc + h * group * D);
}
#endif

// Decodes: items are parts of a sequence's keys, each attended by all its heads. Sequences
// longer than a thread's fair share (half of it: about two items per thread) are cut into
// parts of that many keys, at least kMinPart, and the parts' softmaxes merged after: one
// long sequence alone, or beside short ones, keeps every thread busy.
template <typename Q, typename C, int D>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& num_keys, int64_t window,
            double scale, at::Tensor& out) {
  const PagedArgs<Q, C> a(q, k_cache, v_cache, block_tables, num_keys, out);
  const int64_t batch = q.size(0);
  constexpr int64_t kMinPart = 256;  // keys: below this a part costs more than it spreads
  auto first_key = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, a.lengths[b] - window) : 0; };
  int64_t all_keys = 0;
  for (int64_t b = 0; b < batch; ++b) all_keys += a.lengths[b] - first_key(b);
  const int64_t share = (all_keys + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  const int64_t part_keys = std::max(kMinPart, share);
  std::vector<int64_t> item_seq, first_item(batch + 1);  // items of sequence b: from first_item[b]
  for (int64_t b = 0; b < batch; ++b) {
    first_item[b] = static_cast<int64_t>(item_seq.size());
    const int64_t parts = (a.lengths[b] - first_key(b) + part_keys - 1) / part_keys;
    item_seq.insert(item_seq.end(), parts, b);
  }
  const int64_t items = first_item[batch] = static_cast<int64_t>(item_seq.size());
  // Per (item, query head): its peak score, sum of weights and unnormalized output.
  std::vector<float> peaks(items * a.heads), totals(items * a.heads), outs(items * a.heads * D);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item_seq[item];
      const int64_t from = first_key(b) + (item - first_item[b]) * part_keys;
      const int64_t to = std::min(a.lengths[b], from + part_keys);
      scores.resize(a.heads * ((to - from + 15) / 16 * 16));
      const int64_t at = item * a.heads;
      attend<Q, C, D>(a.q + b * a.heads * D, static_cast<float>(scale), a.keys, a.values,
                      a.tables + b * a.table_width, a.block_size, a.kv_heads, from, to, a.group,
                      scores.data(), &peaks[at], &totals[at], &outs[at * D]);
    }
  });
  at::parallel_for(0, batch * a.heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row: (sequence, query head)
      const int64_t b = row / a.heads, i = row % a.heads;
      float top = kMasked, total = 0.0f, merged[D] = {0};
      for (int64_t item = first_item[b]; item < first_item[b + 1]; ++item)
        top = std::max(top, peaks[item * a.heads + i]);
      for (int64_t item = first_item[b]; item < first_item[b + 1]; ++item) {
        const int64_t at = item * a.heads + i;
        const float weight = std::exp(peaks[at] - top);
        total += weight * totals[at];
        for (int d = 0; d < D; ++d) merged[d] += weight * outs[at * D + d];
      }
      Q* dst = a.out + row * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<Q>(merged[d] / total);
    }
  });
}

#if defined(__AVX512BF16__)
constexpr int kTileKeys = 32;  // two 512-bit vectors of float32 scores
constexpr int kTileQueries = 32;
constexpr int kBlockRows = 4;  // query rows multiplied together, sharing each load of the tile

inline __m512bh bf16_pairs(const uint32_t* words) {
  return (__m512bh)_mm512_load_si512(words);
}

// 2^x for x <= 0: 2^n p(f), n = round(x), f = x - n in [-1/2, 1/2], p of degree 3 fitted to
// 2^f (relative error 1e-4, a twentieth of the bf16 rounding the weights then get; degree 5
// cost a fifth more of the AMX kernel's time) with p(0) = 1 exactly, so that 2^0 is 1: a
// row whose peak did not move is not rescaled. Far below -126 (a masked score) it is 0.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.05500893f);
  for (float c : {0.242211f, 0.69328293f, 1.0f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// One head's row of the cache as D bf16 values: in place for a bf16 cache, else converted
// into `buffer` 32 dims at a time (rounded to nearest even, as torch's casts round).
template <typename C, int D>
const uint16_t* bf16_row(const Elem<C>* row, uint16_t* buffer) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    return reinterpret_cast<const uint16_t*>(row);
  } else {
    for (int c = 0; c < D; c += 32)
      _mm512_store_si512(buffer + c, (__m512i)_mm512_cvtne2ps_pbh(load_dims<C, D>(row, c + 16), load_dims<C, D>(row, c)));
    return buffer;
  }
}

// 16 vectors of 16 words, rows to columns: r[i] word j becomes r[j] word i.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + k]: in each 128-bit lane L, word 4L + k of rows 4g .. 4g + 3
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  // Word 4L + k of every row: lane L of u[k], u[4 + k], u[8 + k], u[12 + k].
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// kTileKeys keys and values of one KV head, laid out for vdpbf16ps, which multiplies two bf16
// pairs per float32 lane and adds them in float32, at over twice the float32 FMA rate here.
// Keys as pairs of dims (word p of key j: dims 2p, 2p+1), so a query's scores are vectors
// over the keys; values as pairs of keys (word d of pair t: dim d of keys 2t and 2t + 1).
template <int D>
struct Tile {
  alignas(64) uint32_t keys[D / 2][kTileKeys];
  alignas(64) uint32_t values[kTileKeys / 2][D];
  alignas(64) uint16_t converted[kTileKeys][D];  // rows of a cache of another type, as bf16

  // The tile's keys and values from the cache rows at `slots` (each converted to bf16 as it
  // is read, where the cache holds another type), 16 x 16 words at a time. Zeros past the
  // last key: its softmax weight is 0, and 0 * garbage may be NaN.
  template <typename C>
  void load(const Elem<C>* k, const Elem<C>* v, const int64_t* slots, int count, int64_t stride) {
    const uint16_t* rows[kTileKeys];
    auto row = [&](int j, int word) { return j < count ? _mm512_loadu_si512(rows[j] + 2 * word) : _mm512_setzero_si512(); };
    for (int j = 0; j < kTileKeys; ++j) rows[j] = bf16_row<C, D>(k + slots[j] * stride, converted[j]);
    for (int j0 = 0; j0 < kTileKeys; j0 += 16)
      for (int p0 = 0; p0 < D / 2; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = row(j0 + i, p0);
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(keys[p0 + i] + j0, r[i]);
      }
    // Word i of pair t: dim i of key 2t in its low half, of key 2t + 1 in its high half.
    static const __m512i kLow = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i kHigh = _mm512_add_epi16(kLow, _mm512_set1_epi16(16));
    for (int j = 0; j < kTileKeys; ++j) rows[j] = bf16_row<C, D>(v + slots[j] * stride, converted[j]);
    for (int t = 0; t < kTileKeys / 2; ++t)
      for (int d = 0; d < D; d += 32) {
        const __m512i even = row(2 * t, d / 2), odd = row(2 * t + 1, d / 2);
        _mm512_store_si512(values[t] + d, _mm512_permutex2var_epi16(even, kLow, odd));
        _mm512_store_si512(values[t] + d + 16, _mm512_permutex2var_epi16(even, kHigh, odd));
      }
  }

  // Keys k0 .. k0 + count - 1 of KV head h of a sequence whose block table is `table`, as
  // `load` lays them out; padding past the last repeats a real slot.
  template <typename Q, typename C>
  void load_keys(const PagedArgs<Q, C>& a, const int64_t* table, int64_t h, int64_t k0, int count) {
    int64_t slots[kTileKeys];
    for (int j = 0; j < kTileKeys; ++j) {
      const int64_t key = k0 + std::min(j, count - 1);
      slots[j] = table[key / a.block_size] * a.block_size + key % a.block_size;
    }
    load<C>(a.keys + h * a.head_stride, a.values + h * a.head_stride, slots, count, a.token_stride);
  }
};

// The running softmax of R query rows over one tile: scores, masks (none where every row sees
// every key of the tile), then out = out * shrink + weights @ values. Peaks are in units of
// raw scores, `log2_scale` turns them into powers of 2; totals are 16 partial sums a row,
// added up at the end. The weights are rounded to bf16 for that product, as flash attention
// does on GPUs (the output is rounded to bf16 anyway).
template <int D, int R, bool Masked>
void attend_rows(const Tile<D>& tile, const uint32_t* const* query, const __mmask32* valid,
                 float log2_scale, float* peak, float* total, float* out) {
  __m512 s[R][2];
  for (int u = 0; u < R; ++u) s[u][0] = s[u][1] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh lo = bf16_pairs(tile.keys[p]), hi = bf16_pairs(tile.keys[p] + 16);
    for (int u = 0; u < R; ++u) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(query[u][p]);
      s[u][0] = _mm512_dpbf16_ps(s[u][0], lo, q);
      s[u][1] = _mm512_dpbf16_ps(s[u][1], hi, q);
    }
  }
  alignas(64) uint32_t pairs[R][kTileKeys / 2];
  alignas(64) float moved[16] = {};  // each row's peak before minus after, in powers of 2
  __m512 sums[R];
  const __m512 factor = _mm512_set1_ps(log2_scale);
  for (int u = 0; u < R; ++u) {
    if constexpr (Masked) {
      const __m512 masked = _mm512_set1_ps(kMasked);
      s[u][0] = _mm512_mask_mov_ps(masked, static_cast<__mmask16>(valid[u]), s[u][0]);
      s[u][1] = _mm512_mask_mov_ps(masked, static_cast<__mmask16>(valid[u] >> 16), s[u][1]);
    }
    const float best = std::max(peak[u], _mm512_reduce_max_ps(_mm512_max_ps(s[u][0], s[u][1])));
    moved[u] = (peak[u] - best) * log2_scale;
    peak[u] = best;
    const __m512 top = _mm512_set1_ps(best * log2_scale);
    const __m512 w0 = exp2_nonpositive(_mm512_fmsub_ps(s[u][0], factor, top));
    const __m512 w1 = exp2_nonpositive(_mm512_fmsub_ps(s[u][1], factor, top));
    sums[u] = _mm512_add_ps(w0, w1);
    _mm512_store_si512(pairs[u], (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
  const __m512 shrink = exp2_nonpositive(_mm512_load_ps(moved));
  const bool rescale = _mm512_cmpneq_ps_mask(shrink, _mm512_set1_ps(1.0f)) != 0;
  auto shrink_of = [&](int u) { return _mm512_permutexvar_ps(_mm512_set1_epi32(u), shrink); };
  for (int u = 0; u < R; ++u)
    _mm512_storeu_ps(total + 16 * u, _mm512_fmadd_ps(_mm512_loadu_ps(total + 16 * u), shrink_of(u), sums[u]));
  constexpr int C = D < 64 ? D / 16 : 4;  // vectors of each row's output per pass
  for (int c = 0; c < D; c += 16 * C) {
    __m512 o[R][C];
    for (int u = 0; u < R; ++u)
      for (int i = 0; i < C; ++i) {
        o[u][i] = _mm512_loadu_ps(out + u * D + c + 16 * i);
        if (rescale) o[u][i] = _mm512_mul_ps(o[u][i], shrink_of(u));
      }
    for (int t = 0; t < kTileKeys / 2; ++t) {
      __m512bh v[C];
      for (int i = 0; i < C; ++i) v[i] = bf16_pairs(tile.values[t] + c + 16 * i);
      for (int u = 0; u < R; ++u) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[u][t]);
        for (int i = 0; i < C; ++i) o[u][i] = _mm512_dpbf16_ps(o[u][i], v[i], w);
      }
    }
    for (int u = 0; u < R; ++u)
      for (int i = 0; i < C; ++i) _mm512_storeu_ps(out + u * D + c + 16 * i, o[u][i]);
  }
}

template <typename C, int D>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& num_keys, int64_t n,
             int64_t window, double scale, const int64_t* last_keys, at::Tensor& out) {
  using T = c10::BFloat16;
  const PagedArgs<T, C> a(q, k_cache, v_cache, block_tables, num_keys, out);
  const int64_t batch = q.size(0) / n, tiles = (n + kTileQueries - 1) / kTileQueries;
  const float log2_scale = static_cast<float>(scale * M_LOG2E);

  // Items are (sequence, KV head, tile of queries); an item's rows are its queries' heads
  // that share the KV head, and it walks its keys once, a tile at a time.
  at::parallel_for(0, batch * a.kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    auto tile = std::make_unique<Tile<D>>();
    std::vector<float> acc(kTileQueries * a.group * D), peak(kTileQueries * a.group),
        total(kTileQueries * a.group * 16);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (a.kv_heads * tiles), h = item / tiles % a.kv_heads;
      const int64_t q0 = item % tiles * kTileQueries, q1 = std::min(n, q0 + kTileQueries);
      const int64_t first_pos = a.lengths[b] - n;  // the key position of query 0
      // The last key query i sees: its own, or the one last_keys gives it.
      auto last_of = [&](int64_t i) { return last_keys ? last_keys[b * n + i] : first_pos + i; };
      const int64_t* table = a.tables + b * a.table_width;
      const int64_t rows = (q1 - q0) * a.group;
      std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
      std::fill(peak.begin(), peak.begin() + rows, kMasked);
      std::fill(total.begin(), total.begin() + rows * 16, 0.0f);
      int64_t last_key = 0;
      for (int64_t i = q0; i < q1; ++i) last_key = std::max(last_key, last_of(i));
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos + q0 - window + 1) : 0;
      for (int64_t k0 = first_key; k0 <= last_key; k0 += kTileKeys) {
        const int count = static_cast<int>(std::min<int64_t>(kTileKeys, last_key + 1 - k0));
        tile->load_keys(a, table, h, k0, count);
        // The rows whose query sees some key of the tile, kBlockRows consecutive ones at a time.
        const uint32_t* query[kBlockRows];
        __mmask32 valid[kBlockRows];
        int64_t first_row = 0;
        int ready = 0;
        auto flush = [&] {
          float* pk = peak.data() + first_row;
          float* tt = total.data() + first_row * 16;
          float* o = acc.data() + first_row * D;
          const bool full = std::all_of(valid, valid + ready, [](__mmask32 m) { return m == 0xffffffffu; });
          auto run = [&](auto rows, auto masked) {
            attend_rows<D, decltype(rows)::value, decltype(masked)::value>(*tile, query, valid, log2_scale, pk, tt, o);
          };
          using std::integral_constant;
          switch (ready * 2 + full) {
            case 2: run(integral_constant<int, 1>(), std::true_type()); break;
            case 3: run(integral_constant<int, 1>(), std::false_type()); break;
            case 4: run(integral_constant<int, 2>(), std::true_type()); break;
            case 5: run(integral_constant<int, 2>(), std::false_type()); break;
            case 6: run(integral_constant<int, 3>(), std::true_type()); break;
            case 7: run(integral_constant<int, 3>(), std::false_type()); break;
            case 8: run(integral_constant<int, 4>(), std::true_type()); break;
            case 9: run(integral_constant<int, 4>(), std::false_type()); break;
          }
          ready = 0;
        };
        for (int64_t i = q0; i < q1; ++i) {
          const int64_t pos = first_pos + i, last = last_of(i);
          const int64_t low = window > 0 ? pos - window + 1 : 0;  // its first key in window
          if (last < k0 || k0 + count - 1 < low) {
            if (ready) flush();  // the next row is not consecutive with these
            continue;
          }
          // Keys it attends: from `low` up to its last, not past the tile's last key.
          const int64_t from = std::max<int64_t>(low - k0, 0);
          const int64_t to = std::min<int64_t>(last - k0, count - 1);
          const __mmask32 mask = static_cast<__mmask32>(((uint64_t(2) << to) - 1) & ~((uint64_t(1) << from) - 1));
          for (int64_t g = 0; g < a.group; ++g) {
            if (ready == 0) first_row = (i - q0) * a.group + g;
            query[ready] = reinterpret_cast<const uint32_t*>(a.q + ((b * n + i) * a.heads + h * a.group + g) * D);
            valid[ready] = mask;
            if (++ready == kBlockRows) flush();
          }
        }
        if (ready) flush();
      }
      for (int64_t i = q0; i < q1; ++i)
        for (int64_t g = 0; g < a.group; ++g) {
          const int64_t r = (i - q0) * a.group + g;
          const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(total.data() + r * 16));
          T* dst = a.out + ((b * n + i) * a.heads + h * a.group + g) * D;
          for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] / sum);
        }
    }
  });
}
#endif

#if defined(__AMX_BF16__)
// Prompt chunks on AMX (Sapphire Rapids and later): `prefill`'s walk, with both products on
// the tile unit. TDPBF16PS adds a 16 x 32 bf16 block times a 32 x 16 one into 16 x 16
// float32, as one instruction: 16 query rows by a half-tile of keys (Tile's keys, pairs of
// dims, are its right operand as they are), and their weights by the tile's values (pairs of
// keys, likewise). The online softmax between the two runs on AVX-512 over the scores as the
// unit stores them, and the rows' outputs stay in memory, where the unit adds into them.
constexpr int kAmxRows = 16;  // query rows per product

// Linux gives a process the tile registers' state only once it asks for it (arch_prctl).
bool amx_permitted() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// The tiles' shapes (palette 1): all eight 16 rows of 64 bytes, whether they hold float32
// sums (16 x 16), bf16 rows (16 x 32) or pairs (16 x 16 words).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The two products. gcc's intrinsics take a tile's number as a literal: tiles 0-4 hold the
// scores' operands, 5-7 the values', so that the unit can score one block of rows while the
// values of the one before are added (see prefill_amx).
// Scores of 16 query rows (bf16, row stride D) against Tile's 32 keys, into tiles 0 and 1:
// 32 dims at a time, queries in tile 2, keys in 3 and 4. Issued, not waited for.
template <int D>
void issue_scores(const c10::BFloat16* queries, const uint32_t (*keys)[kTileKeys]) {
  _tile_zero(0);
  _tile_zero(1);
  for (int c = 0; c < D; c += 32) {
    _tile_loadd(2, queries + c, D * 2);
    _tile_loadd(3, keys[c / 2], kTileKeys * 4);
    _tile_loadd(4, keys[c / 2] + 16, kTileKeys * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
}

// out [16][D] (float32, in memory) += weights [16][kTileKeys] (bf16) times Tile's values,
// 16 dims at a time: weights in tile 5, sums in 6, values in 7.
template <int D>
void add_values(float* out, const uint16_t (*weights)[kTileKeys], const uint32_t (*values)[D]) {
  _tile_loadd(5, weights[0], kTileKeys * 2);
  for (int d = 0; d < D; d += 16) {
    _tile_loadd(6, out + d, D * 4);
    _tile_loadd(7, values[0] + d, D * 4);
    _tile_dpbf16ps(6, 5, 7);
    _tile_stored(6, out + d, D * 4);
  }
}

// Lane u: the largest of m[u]'s 16 lanes. Halving rounds across the 16 vectors at once: 46
// instructions, where one horizontal reduction per row took ~8 each.
inline __m512 lane_maxima(const __m512* m) {
  __m512 z[8], w[4];
  for (int i = 0; i < 8; ++i)  // z[i]: rows 2i, 2i + 1, each as two 128-bit lanes
    z[i] = _mm512_max_ps(_mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], 0x44), _mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // w[i]: 128-bit lane L holds four of row 4i + L
    w[i] = _mm512_max_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88), _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xDD));
  const __m512 v01 = _mm512_max_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
  const __m512 v23 = _mm512_max_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
  const __m512 r = _mm512_max_ps((__m512)_mm512_unpacklo_pd((__m512d)v01, (__m512d)v23),
                                 (__m512)_mm512_unpackhi_pd((__m512d)v01, (__m512d)v23));
  // Element 4L + i of r is row 4i + L.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// The running softmax of 16 rows over one tile's scores [16][kTileKeys] (raw; none of a row
// with no key of the tile), as attend_rows does it: peaks and 16 partial sums a row updated,
// the weights written as bf16 [16][kTileKeys] (zeros for a row that sees no key), the rows'
// outputs `out` [16][D] shrunk where their peak moved. The peaks move as one vector.
template <int D>
void softmax_rows(const float (*scores)[kTileKeys], const __mmask32* valid, bool full,
                  float log2_scale, float* peak, float* total, uint16_t (*weights)[kTileKeys],
                  float* out) {
  const __m512 masked = _mm512_set1_ps(kMasked);
  auto row = [&](int u, int half) {
    const __m512 s = _mm512_load_ps(scores[u] + 16 * half);
    return full ? s : _mm512_mask_mov_ps(masked, static_cast<__mmask16>(valid[u] >> (16 * half)), s);
  };
  __m512 maxima[kAmxRows];
  for (int u = 0; u < kAmxRows; ++u) maxima[u] = _mm512_max_ps(row(u, 0), row(u, 1));
  const __m512 before = _mm512_loadu_ps(peak), factor = _mm512_set1_ps(log2_scale);
  const __m512 after = _mm512_max_ps(before, lane_maxima(maxima));
  _mm512_storeu_ps(peak, after);
  alignas(64) float shrink[kAmxRows], top[kAmxRows];  // top: each row's peak in powers of 2
  _mm512_store_ps(shrink, exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(before, after), factor)));
  _mm512_store_ps(top, _mm512_mul_ps(after, factor));
  for (int u = 0; u < kAmxRows; ++u) {
    const __m512 by = _mm512_set1_ps(shrink[u]);
    __m512 sum = _mm512_setzero_ps();
    if (full || valid[u] != 0) {
      const __m512 w0 = exp2_nonpositive(_mm512_fmsub_ps(row(u, 0), factor, _mm512_set1_ps(top[u])));
      const __m512 w1 = exp2_nonpositive(_mm512_fmsub_ps(row(u, 1), factor, _mm512_set1_ps(top[u])));
      sum = _mm512_add_ps(w0, w1);
      _mm512_store_si512(weights[u], (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    } else {
      _mm512_store_si512(weights[u], _mm512_setzero_si512());
    }
    _mm512_storeu_ps(total + 16 * u, _mm512_fmadd_ps(_mm512_loadu_ps(total + 16 * u), by, sum));
    if (shrink[u] != 1.0f)
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(out + u * D + d, _mm512_mul_ps(_mm512_loadu_ps(out + u * D + d), by));
  }
}

template <typename C, int D>
void prefill_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& num_keys, int64_t n,
                 int64_t window, double scale, const int64_t* last_keys, at::Tensor& out) {
  TORCH_CHECK(amx_permitted(), "paged_attention: Linux did not give this process AMX's tile registers");
  using T = c10::BFloat16;
  const PagedArgs<T, C> a(q, k_cache, v_cache, block_tables, num_keys, out);
  const int64_t batch = q.size(0) / n;
  // Queries per item: each lays out every tile of its keys once for all its rows, so the most
  // that still leaves each thread four items (128 took 15% less time than 32 per 512-token
  // chunk after 7,680 keys; a Sapphire Rapids, 2 threads).
  int64_t queries_per_item = 128;
  while (queries_per_item > 32 && batch * a.kv_heads * ((n + queries_per_item - 1) / queries_per_item) < 4 * at::get_num_threads())
    queries_per_item /= 2;
  const int64_t tiles = (n + queries_per_item - 1) / queries_per_item;
  const float log2_scale = static_cast<float>(scale * M_LOG2E);
  const int64_t max_rows = (queries_per_item * a.group + kAmxRows - 1) / kAmxRows * kAmxRows;

  // Items as `prefill`'s: (sequence, KV head, tile of queries); row r of an item is head
  // r % group of its query r / group, and the rows are walked 16 at a time.
  at::parallel_for(0, batch * a.kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    static const TileConfig config;
    _tile_loadconfig(&config);
    auto tile = std::make_unique<Tile<D>>();
    std::vector<T> queries(max_rows * D);
    std::vector<float> acc(max_rows * D), peak(max_rows), total(max_rows * 16);
    std::vector<int64_t> low(max_rows), high(max_rows);  // each row's first and last key
    std::vector<int64_t> latest_first(max_rows / kAmxRows), earliest_last(max_rows / kAmxRows);  // a block's
    alignas(64) float scores[2][kAmxRows][kTileKeys];  // a block's, and the next's
    std::vector<int64_t> blocks(max_rows / kAmxRows);  // the first rows of a tile's blocks
    std::vector<std::array<__mmask32, kAmxRows>> valid(max_rows / kAmxRows);
    std::vector<char> full(max_rows / kAmxRows);
    alignas(64) uint16_t weights[kAmxRows][kTileKeys];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (a.kv_heads * tiles), h = item / tiles % a.kv_heads;
      const int64_t q0 = item % tiles * queries_per_item, q1 = std::min(n, q0 + queries_per_item);
      const int64_t first_pos = a.lengths[b] - n;  // the key position of query 0
      const int64_t* table = a.tables + b * a.table_width;
      const int64_t rows = (q1 - q0) * a.group;
      const int64_t padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
      for (int64_t r = 0; r < padded; ++r) {
        if (r >= rows) {  // padding: sees no key, and its zeros are never written out
          low[r] = 1, high[r] = 0;
          std::fill_n(queries.begin() + r * D, D, T(0.0f));
          continue;
        }
        const int64_t i = q0 + r / a.group, pos = first_pos + i;
        low[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        high[r] = last_keys ? last_keys[b * n + i] : pos;
        const T* row = a.q + ((b * n + i) * a.heads + h * a.group + r % a.group) * D;
        std::copy_n(row, D, queries.begin() + r * D);
      }
      for (int64_t r0 = 0; r0 < padded; r0 += kAmxRows) {
        latest_first[r0 / kAmxRows] = *std::max_element(low.begin() + r0, low.begin() + r0 + kAmxRows);
        earliest_last[r0 / kAmxRows] = *std::min_element(high.begin() + r0, high.begin() + r0 + kAmxRows);
      }
      std::fill_n(acc.begin(), padded * D, 0.0f);
      std::fill_n(peak.begin(), padded, kMasked);
      std::fill_n(total.begin(), padded * 16, 0.0f);
      const int64_t first_key = *std::min_element(low.begin(), low.begin() + rows);
      const int64_t last_key = *std::max_element(high.begin(), high.begin() + rows);
      for (int64_t k0 = first_key; k0 <= last_key; k0 += kTileKeys) {
        const int count = static_cast<int>(std::min<int64_t>(kTileKeys, last_key + 1 - k0));
        tile->load_keys(a, table, h, k0, count);
        // The blocks of 16 rows that see some key of the tile, with their masks (none
        // where every row sees every key of it).
        int64_t active = 0;
        for (int64_t r0 = 0; r0 < padded; r0 += kAmxRows) {
          const int64_t block = r0 / kAmxRows;
          full[active] = k0 >= latest_first[block] && k0 + kTileKeys - 1 <= earliest_last[block];
          bool any = full[active];
          for (int u = 0; u < kAmxRows && !full[active]; ++u) {
            const int64_t from = std::max<int64_t>(low[r0 + u] - k0, 0);
            const int64_t to = std::min<int64_t>(high[r0 + u] - k0, count - 1);
            valid[active][u] = to < from ? 0 : static_cast<__mmask32>(((uint64_t(2) << to) - 1) & ~((uint64_t(1) << from) - 1));
            any |= valid[active][u] != 0;
          }
          if (any) blocks[active++] = r0;
        }
        // A pipeline: the unit scores block j + 1 while the vector units run block j's
        // softmax; alone, each waited on the other (the unit's results take tens of cycles).
        for (int64_t j = 0; j < active; ++j) {
          if (j == 0) issue_scores<D>(queries.data() + blocks[0] * D, tile->keys);
          _tile_stored(0, scores[j % 2][0], kTileKeys * 4);
          _tile_stored(1, scores[j % 2][0] + 16, kTileKeys * 4);
          if (j + 1 < active) issue_scores<D>(queries.data() + blocks[j + 1] * D, tile->keys);
          const int64_t r0 = blocks[j];
          float* o = acc.data() + r0 * D;
          softmax_rows<D>(scores[j % 2], valid[j].data(), full[j], log2_scale, peak.data() + r0, total.data() + r0 * 16, weights, o);
          add_values<D>(o, weights, tile->values);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(total.data() + r * 16));
        T* dst = a.out + ((b * n + q0 + r / a.group) * a.heads + h * a.group + r % a.group) * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] / sum);
      }
    }
    _tile_release();
  });
}
#endif


// Prompt chunks on the bf16 kernel above, where it was compiled; else the caller's fallback.
template <typename Q, typename C, int D>
void prefill_dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& num_keys, int64_t n,
                      int64_t window, double scale, const int64_t* last_keys, at::Tensor& out) {
#if defined(__AMX_BF16__)
  if constexpr (std::is_same_v<Q, c10::BFloat16> && D % 32 == 0)
    return prefill_amx<C, D>(q, k_cache, v_cache, block_tables, num_keys, n, window, scale, last_keys, out);
#elif defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, c10::BFloat16> && D % 32 == 0)
    return prefill<C, D>(q, k_cache, v_cache, block_tables, num_keys, n, window, scale, last_keys, out);
#endif
  TORCH_CHECK(false, "paged_attention: prompt chunks need bf16 queries, a head size that is a"
                     " multiple of 32, and a CPU with AVX512-BF16");
}

// q [B * n, H, D] (float32 or bf16): n new queries per sequence, the last n of its keys
// (already in the cache); k_cache, v_cache [blocks, block_size, Hkv, D] in float32, bf16 or
// f16, or uint8 [blocks, block_size, Hkv, D + D / 16] int8 rows; block_tables [B, width]
// int64; num_keys [B] int64: sequence b has keys 0 .. num_keys[b] - 1 of its table. Query i of
// sequence b, at key position p = num_keys[b] - n + i, attends the keys up to its own, or for a
// prompt chunk given last_keys [B * n] int64, up to last_keys[b * n + i] (>= p, < num_keys[b]);
// from key p - window + 1 when window > 0. Returns [B * n, H, D] in q's dtype.
void paged_attention_into(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& num_keys, int64_t n, int64_t window, double scale,
                          const c10::optional<at::Tensor>& last_keys, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: k and v caches differ in dtype");
  const bool int8 = k_cache.scalar_type() == at::kByte;
  const int64_t dim = q.size(2);
  TORCH_CHECK(!int8 || dim % kQ8Group == 0, "paged_attention: an int8 cache needs a head size that is a multiple of 32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && k_cache.size(3) == (int8 ? Stored<Int8>::row(dim) : dim));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && num_keys.scalar_type() == at::kLong);
  TORCH_CHECK(n >= 1 && q.size(0) == n * block_tables.size(0) && num_keys.size(0) == block_tables.size(0));
  auto tables = block_tables.contiguous();
  auto lengths = num_keys.contiguous();
  at::Tensor lasts;
  if (last_keys.has_value()) {
    TORCH_CHECK(n > 1, "paged_attention: last_keys are for prompt chunks");
    TORCH_CHECK(last_keys->scalar_type() == at::kLong && last_keys->numel() == q.size(0));
    lasts = last_keys->contiguous();
  }
  const int64_t* lasts_data = lasts.defined() ? lasts.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous());
  // The head size is a template argument, so the loops over it unroll and vectorize.
  auto by_head_size = [&](auto query_type, auto cache_type) {
    using Q = decltype(query_type);
    using C = decltype(cache_type);
    auto run = [&](auto head_dim) {
      constexpr int D = decltype(head_dim)::value;
      if constexpr (std::is_same_v<C, Int8> && D % kQ8Group != 0) {
        return;  // refused above
      } else if (n == 1) {
        decode<Q, C, D>(q, k_cache, v_cache, tables, lengths, window, scale, out);
      } else {
        prefill_dispatch<Q, C, D>(q, k_cache, v_cache, tables, lengths, n, window, scale, lasts_data, out);
      }
    };
    switch (dim) {
      case 16: return run(std::integral_constant<int, 16>());
      case 32: return run(std::integral_constant<int, 32>());
      case 64: return run(std::integral_constant<int, 64>());
      case 128: return run(std::integral_constant<int, 128>());
      case 256: return run(std::integral_constant<int, 256>());
      default: TORCH_CHECK(false, "paged_attention: head size ", dim, " is not 16, 32, 64, 128 or 256");
    }
  };
  auto by_cache = [&](auto query_type) {
    switch (k_cache.scalar_type()) {
      case at::kFloat: return by_head_size(query_type, float());
      case at::kBFloat16: return by_head_size(query_type, c10::BFloat16());
      case at::kHalf: return by_head_size(query_type, c10::Half());
      case at::kByte: return by_head_size(query_type, Int8());
      default: TORCH_CHECK(false, "paged_attention: a ", k_cache.scalar_type(), " cache is not float32, bfloat16, float16 or int8 (uint8 rows)");
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: by_cache(float()); break;
    case at::kBFloat16: by_cache(c10::BFloat16()); break;
    default: TORCH_CHECK(false, "paged_attention: ", q.scalar_type(), " queries are not float32 or bfloat16");
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& num_keys, int64_t n, int64_t window, double scale,
                           const c10::optional<at::Tensor>& last_keys) {
  at::Tensor out = at::empty_like(q);
  paged_attention_into(q, k_cache, v_cache, block_tables, num_keys, n, window, scale, last_keys, out);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
  m.def("paged_attention_entry", [] {
    const PagedAttentionInto entry = &paged_attention_into;
    return reinterpret_cast<intptr_t>(entry);
  }, "the address of paged_attention's C++ entry with its output given (paged_entry.h)");
}
