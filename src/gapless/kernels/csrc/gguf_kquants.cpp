// The K-quant GGUF block types: 256 values a super-block, in sub-blocks of 16 or 32 that
// each carry a small integer scale (and for Q2_K/Q4_K/Q5_K a minimum) under the block's f16
// d (and dmin). A weight is d * sc_j * code - dmin * m_j.
//
// Dots against Q8_K activations (x ~ dx * q per 256) keep everything integer inside a block:
// sum_j sc_j * sum(code q) over its sub-blocks, then one float multiply by d * dx. The
// minimums need no pass over the values: sum_j m_j * bsum_j from the activations' sums per
// 16. The vector paths multiply unsigned bytes by signed ones (maddubs), so they take the
// codes unsigned (Q6_K: 0..63 for code + 32, Q3_K: 0..7 for code + 4) and fold the centre
// back out the same way, through the bsums. The sub-block scale is applied to maddubs' int16
// pairs by madd (AVX2) or dpwssd (AVX512-VNNI, AVX-VNNI), which multiplies and accumulates in
// one instruction; dpbusd would leave the scale for a separate integer multiply. A decode
// batch's rows (dot_rows) share each unpacked block, 4 rows at a time.
//
// dequantize computes each value in float32 as the `gguf` package's numpy does, operation
// for operation (d * sc first, then times the code, then minus dmin * m): the build's
// -ffp-contract=off (blocks.py) keeps the compiler from fusing the last two, as it keeps
// quantize_act_q8k's rounding (a multiply, then an add) in two steps.
//
// Multi-byte fields are read little-endian, as GGUF stores them and x86 runs.
#include "gguf_blocks.h"

#include <cmath>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gapless_gguf {

namespace {

// The first of 256 values with the largest magnitude, or -1 where all are zero.
int top_index(const float* x) {
#if defined(__AVX2__)
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 256; j += 8)  // max(v, m): a NaN v leaves m, as the scalar loop does
    m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  if (amax == 0.0f) return -1;
  const __m256 target = _mm256_set1_ps(amax);
  for (int j = 0; j < 256; j += 8) {
    const __m256 ax = _mm256_and_ps(_mm256_loadu_ps(x + j), abs);
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(ax, target, _CMP_EQ_OQ));
    if (hits != 0) return j + __builtin_ctz(static_cast<unsigned>(hits));
  }
  return -1;  // not reached: amax is one of them
#else
  float amax = 0.0f;
  int top = -1;
  for (int j = 0; j < 256; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) amax = ax, top = j;
  }
  return top;
#endif
}

}  // namespace

void quantize_act_q8k(const float* x, ActQ8K* out, int64_t n) {
  // ggml's Q8_K: the value of largest magnitude maps to -127 (its sign flips the scale), so
  // every q lies in -127..127 and maddubs' pairs never overflow. Rounds to nearest even.
  for (int64_t b = 0; b < n / 256; ++b, x += 256) {
    ActQ8K& o = out[b];
    const int top = top_index(x);
    if (top < 0) {
      std::memset(&o, 0, sizeof o);
      continue;
    }
    const float iscale = -127.0f / x[top];
    for (int j = 0; j < 256; ++j) {
      // To nearest even as nearbyint, for |v| <= 128, by adding and taking off 1.5 * 2^23
      // (whose ulp is 1); unlike nearbyint it vectorizes without SSE4.1's round.
      const float v = (iscale * x[j] + 12582912.0f) - 12582912.0f;
      o.q[j] = static_cast<int8_t>(v < 127.0f ? v : 127.0f);
    }
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += o.q[16 * j + i];
      o.bsums[j] = static_cast<int16_t>(s);
    }
    o.d = 1.0f / iscale;
  }
}

namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // inline: the dots read two a block
#else
  return half_to_float(h);
#endif
}

// Q4_K/Q5_K's 12 bytes of packed 6-bit scales and minimums: bytes 0..3 hold sc 0..3 (low 6
// bits) and the top 2 bits of sc 4..7, bytes 4..7 the same for the minimums, bytes 8..11
// the low 4 bits of sc 4..7 (low nibble) and of m 4..7 (high nibble). Out: sc[0..7] then
// m[0..7]. Whole words: four lanes at once.
inline void q4k_words(const uint8_t* packed, uint32_t u[4]) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  u[0] = w[0] & 0x3f3f3f3f;
  u[1] = (w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030);
  u[2] = w[1] & 0x3f3f3f3f;
  u[3] = ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030);
}

inline void q4k_scales(const uint8_t* packed, uint8_t out[16]) {
  uint32_t u[4];
  q4k_words(packed, u);
  std::memcpy(out, u, 16);
}

// Q3_K's 12 bytes of 16 6-bit scales: bytes 0..7 the low 4 bits (sc j in byte j % 8, low
// nibble for j < 8), bytes 8..11 the top 2 bits (sc j at bits 2 (j / 4) of byte j % 4).
// Out: the scales as 0..63, to be centred (- 32).
inline void q3k_words(const uint8_t* packed, uint32_t u[4]) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  for (int k = 0; k < 4; ++k) {
    const uint32_t low = (k & 2 ? w[k & 1] >> 4 : w[k & 1]) & 0x0f0f0f0f;
    u[k] = low | (((w[2] >> (2 * k)) & 0x03030303) << 4);
  }
}

inline void q3k_scales(const uint8_t* packed, int8_t out[16]) {
  uint32_t u[4];
  q3k_words(packed, u);
  std::memcpy(out, u, 16);
  for (int j = 0; j < 16; ++j) out[j] = static_cast<int8_t>(out[j] - 32);
}

// IQ4_XS's 8 6-bit scales: a uint16 of the top 2 bits each, then 4 bytes of low nibbles.
// Centred, -32..31.
inline void iq4xs_scales(const uint8_t* b, int8_t out[8]) {
  uint16_t high;
  std::memcpy(&high, b + 2, sizeof high);
  for (int j = 0; j < 8; ++j) {
    const int low = (b[4 + j / 2] >> (4 * (j & 1))) & 0x0f;
    out[j] = static_cast<int8_t>((low | (((high >> (2 * j)) & 3) << 4)) - 32);
  }
}

// ggml's IQ4_NL values, which IQ4_XS codes index.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// Block layouts (bytes), in ggml's field order.
//   Q2_K  84: scales[16] (sc low nibble, m high), qs[64] (2 bits), d, dmin
//   Q3_K 110: hmask[32], qs[64] (2 bits), scales[12], d
//   Q4_K 144: d, dmin, scales[12], qs[128]
//   Q5_K 176: d, dmin, scales[12], qh[32], qs[128]
//   Q6_K 210: ql[128], qh[64], scales[16] (int8), d
//   IQ4_XS 136: d, scales_h (uint16), scales_l[4], qs[128]
// The 2-bit types take 32 bytes of qs for 128 values: value 32 s + i of that half is bits
// 2 s of byte i. Q4_K/Q5_K: 32 bytes of qs for 64 values, low nibbles then high. Q6_K: 64
// bytes of ql for 128 values (low nibbles of all 64, then high), and 32 bytes of qh whose
// bits 2 s give the top bits of value 32 s + i. A "group" below is 32 consecutive values.

#if defined(__AVX2__)
// ---------------------------------------------------------------------------------------
// Vector paths. Each type unpacks a block as 8 groups of 32 codes, one byte each, in a
// register (its `groups`); the dot multiplies them with the activations, dequantize turns
// them into floats. The codes are unsigned for the dots (Q3_K and Q6_K stored + centre);
// IQ4_XS's are its signed values. Each type's `Block` holds what the dot needs of a block
// besides its codes, in registers: d (and dmin), group g's int16 scales (scale(g)), the
// block's integer sum before any code (start: minus the centre's share) and the int32
// lanes that dmin multiplies (mins).

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m128i load16(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

inline __m256i bsums(const ActQ8K& a) { return load32(a.bsums); }

// Scales are unpacked in registers, never through memory: a block's scale work is as long
// as its dot products.
inline __m128i words_v(const uint32_t u[4]) {
  return _mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]), static_cast<int>(u[1]),
                       static_cast<int>(u[0]));
}

// Types with a scale per 32 values (Q4_K, Q5_K, IQ4_XS) hold their 8 scales as int16 in both
// 128-bit halves; sub-block j's scale in every lane is then one shuffle, where a broadcast
// from memory or a general register takes two or three instructions.
inline __m256i sub_scale(__m256i sc16, int j) {
  return _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<short>(0x0100 + 0x0202 * j)));
}

// Types with a scale per 16 values (Q2_K, Q3_K, Q6_K) hold their 16 as int16 [16]. Group g
// of 32 values (sub-blocks 2g, 2g + 1) takes lane 2g's scale in the low 128 bits, 2g + 1's
// in the high: from lanes 8h..8h+7 in both halves (h = g / 4), bytes (4 (g % 4), + 1)
// repeated low, (4 (g % 4) + 2, + 3) high.
struct GroupScales {
  __m256i half[2];
  explicit GroupScales(__m256i sc16)
      : half{_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xee)} {}
  __m256i operator()(int g) const {
    const __m256i pick = _mm256_add_epi8(
        _mm256_set_epi64x(0x0302030203020302, 0x0302030203020302, 0x0100010001000100,
                          0x0100010001000100),
        bytes(4 * (g % 4)));
    return _mm256_shuffle_epi8(half[g / 4], pick);
  }
};

// Q4_K/Q5_K's scales (bytes 0..7) and minimums (8..15).
inline __m128i q4k_scales_v(const uint8_t* packed) {
  uint32_t u[4];
  q4k_words(packed, u);
  return words_v(u);
}

// Q3_K's 16 scales, centred, as int16.
inline __m256i q3k_scales16(const uint8_t* packed) {
  uint32_t u[4];
  q3k_words(packed, u);
  return _mm256_cvtepi8_epi16(_mm_sub_epi8(words_v(u), _mm_set1_epi8(32)));
}

// IQ4_XS's 8 scales, centred, as int16 in both 128-bit halves. Scale j's top bits are bits
// 2j of a uint16: a multiply by 2^(14 - 2j) brings them to the top of lane j.
inline __m256i iq4xs_scales16(const uint8_t* b) {
  uint16_t high;
  uint32_t low;
  std::memcpy(&high, b + 2, sizeof high);
  std::memcpy(&low, b + 4, sizeof low);
  const __m128i l = _mm_cvtsi32_si128(static_cast<int>(low)), nib = _mm_set1_epi8(0x0f);
  const __m128i low8 =
      _mm_unpacklo_epi8(_mm_and_si128(l, nib), _mm_and_si128(_mm_srli_epi16(l, 4), nib));
  const __m128i top = _mm_srli_epi16(
      _mm_mullo_epi16(_mm_set1_epi16(static_cast<short>(high)),
                      _mm_set_epi16(1, 4, 16, 64, 256, 1024, 4096, 16384)),
      14);
  const __m128i sc = _mm_or_si128(_mm_cvtepu8_epi16(low8), _mm_slli_epi16(top, 4));
  return _mm256_broadcastsi128_si256(_mm_sub_epi16(sc, _mm_set1_epi16(32)));
}

// The centre's share of a block's sum, for codes taken unsigned (code + centre):
// -centre * sum_j sc_j bsum_j.
inline __m256i centred_start(__m256i sc16, const ActQ8K& a, int centre) {
  const __m256i share = _mm256_madd_epi16(bsums(a), sc16);
  return _mm256_mullo_epi32(share, _mm256_set1_epi32(-centre));
}

struct Q2K {
  static constexpr int64_t kBytes = 84;
  static constexpr bool kHasMin = true, kSigned = false;
  template <class F>
  static void groups(const uint8_t* b, F f) {
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 16 + 32 * h);
      for (int s = 0; s < 4; ++s)
        f(4 * h + s, _mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), bytes(3)));
    }
  }
  struct Block {
    float d, dmin;
    __m256i m16;
    GroupScales scale;
    explicit Block(const uint8_t* b)
        : d(f16_at(b + 80)), dmin(f16_at(b + 82)),
          m16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(load16(b), 4), _mm_set1_epi8(15)))),
          scale(_mm256_cvtepu8_epi16(_mm_and_si128(load16(b), _mm_set1_epi8(15)))) {}
    __m256i start(const ActQ8K&) const { return _mm256_setzero_si256(); }
    __m256i mins(const ActQ8K& a) const { return _mm256_madd_epi16(bsums(a), m16); }
  };
};

struct Q3K {
  static constexpr int64_t kBytes = 110;
  static constexpr int kCentre = 4;
  static constexpr bool kHasMin = false, kSigned = false;
  // 2 low bits from qs, and 4 where hmask's bit is set (code + 4). Group g's hmask bit is
  // bit g of each byte: shifted down one a group (16-bit shifts: a byte's low bit stays its
  // own for 8 shifts).
  template <class F>
  static void groups(const uint8_t* b, F f) {
    __m256i hm = load32(b);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 32 + 32 * h);
      for (int s = 0; s < 4; ++s) {
        f(4 * h + s, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), bytes(3)),
                                     _mm256_and_si256(_mm256_slli_epi16(hm, 2), bytes(4))));
        hm = _mm256_srli_epi16(hm, 1);
      }
    }
  }
  struct Block {
    float d, dmin = 0.0f;
    __m256i sc16;
    GroupScales scale;
    explicit Block(const uint8_t* b)
        : d(f16_at(b + 108)), sc16(q3k_scales16(b + 96)), scale(sc16) {}
    __m256i start(const ActQ8K& a) const { return centred_start(sc16, a, kCentre); }
    __m256i mins(const ActQ8K&) const { return _mm256_setzero_si256(); }
  };
};

// Q4_K/Q5_K's scales and minimums per 32 values.
struct Q45Block {
  float d, dmin;
  __m256i sc16, m16;
  explicit Q45Block(const uint8_t* b) : d(f16_at(b)), dmin(f16_at(b + 2)) {
    const __m128i sm = q4k_scales_v(b + 4);
    sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    m16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  // m_j for bsums 2j and 2j + 1
  }
  __m256i scale(int g) const { return sub_scale(sc16, g); }
  __m256i start(const ActQ8K&) const { return _mm256_setzero_si256(); }
  __m256i mins(const ActQ8K& a) const { return _mm256_madd_epi16(bsums(a), m16); }
};

struct Q4K {
  static constexpr int64_t kBytes = 144;
  static constexpr bool kHasMin = true, kSigned = false;
  template <class F>
  static void groups(const uint8_t* b, F f) {
    for (int c = 0; c < 4; ++c) {
      const __m256i qs = load32(b + 16 + 32 * c);
      f(2 * c, _mm256_and_si256(qs, bytes(0x0f)));
      f(2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(qs, 4), bytes(0x0f)));
    }
  }
  using Block = Q45Block;
};

struct Q5K {
  static constexpr int64_t kBytes = 176;
  static constexpr bool kHasMin = true, kSigned = false;
  // Group g's fifth bits are bit g of qh's bytes: shifted down two a chunk, bits 0 and 1 of
  // every byte are the chunk's.
  template <class F>
  static void groups(const uint8_t* b, F f) {
    __m256i qh = load32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m256i qs = load32(b + 48 + 32 * c);
      f(2 * c, _mm256_or_si256(_mm256_and_si256(qs, bytes(0x0f)),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), bytes(0x10))));
      f(2 * c + 1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), bytes(0x0f)),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 3), bytes(0x10))));
      qh = _mm256_srli_epi16(qh, 2);
    }
  }
  using Block = Q45Block;
};

struct Q6K {
  static constexpr int64_t kBytes = 210;
  static constexpr int kCentre = 32;
  static constexpr bool kHasMin = false, kSigned = false;
  template <class F>
  static void groups(const uint8_t* b, F f) {
    const __m256i low4 = bytes(0x0f), high2 = bytes(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32);
      const __m256i qh = load32(b + 128 + 32 * h);
      f(4 * h, _mm256_or_si256(_mm256_and_si256(l0, low4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2)));
      f(4 * h + 1, _mm256_or_si256(_mm256_and_si256(l1, low4),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2)));
      f(4 * h + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                   _mm256_and_si256(qh, high2)));
      f(4 * h + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2)));
    }
  }
  struct Block {
    float d, dmin = 0.0f;
    __m256i sc16;
    GroupScales scale;
    explicit Block(const uint8_t* b)
        : d(f16_at(b + 208)), sc16(_mm256_cvtepi8_epi16(load16(b + 192))), scale(sc16) {}
    __m256i start(const ActQ8K& a) const { return centred_start(sc16, a, kCentre); }
    __m256i mins(const ActQ8K&) const { return _mm256_setzero_si256(); }
  };
};

struct Iq4Xs {
  static constexpr int64_t kBytes = 136;
  static constexpr bool kHasMin = false, kSigned = true;
  // Sub-block j's codes: low nibbles of its 16 bytes, then high, looked up as signed values.
  template <class F>
  static void groups(const uint8_t* b, F f) {
    const __m256i table = _mm256_broadcastsi128_si256(load16(kIq4Values));
    for (int j = 0; j < 8; ++j) {
      const __m128i q = load16(b + 8 + 16 * j);
      const __m256i codes = _mm256_and_si256(
          _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
          bytes(0x0f));
      f(j, _mm256_shuffle_epi8(table, codes));
    }
  }
  struct Block {
    float d, dmin = 0.0f;
    __m256i sc16;
    explicit Block(const uint8_t* b) : d(f16_at(b)), sc16(iq4xs_scales16(b)) {}
    __m256i scale(int g) const { return sub_scale(sc16, g); }
    __m256i start(const ActQ8K&) const { return _mm256_setzero_si256(); }
    __m256i mins(const ActQ8K&) const { return _mm256_setzero_si256(); }
  };
};

// --- dequantize: the codes to floats, d * sc and dmin * m computed first, as scalars, and
// each value then rounded twice (a multiply, then a subtract), as the reference rounds it.

// out[i] = dl * code i (- ml) for 16 signed byte codes.
template <bool kMin>
inline void put16(float* out, __m128i codes, float dl, float ml) {
#if defined(__AVX512F__)
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(dl));
  if constexpr (kMin) v = _mm512_sub_ps(v, _mm512_set1_ps(ml));
  _mm512_storeu_ps(out, v);
#else
  for (int h = 0; h < 2; ++h) {
    const __m128i c = h ? _mm_srli_si128(codes, 8) : codes;
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), _mm256_set1_ps(dl));
    if constexpr (kMin) v = _mm256_sub_ps(v, _mm256_set1_ps(ml));
    _mm256_storeu_ps(out + 8 * h, v);
  }
#endif
}

inline __m128i low128(__m256i v) { return _mm256_castsi256_si128(v); }
inline __m128i high128(__m256i v) { return _mm256_extracti128_si256(v, 1); }

// Q4_K/Q5_K: a scale and minimum per 32 values.
template <class T>
void dequantize_q45k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += T::kBytes, out += 256) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    uint8_t sm[16];
    q4k_scales(b + 4, sm);
    float dl[8], ml[8];
    for (int j = 0; j < 8; ++j) {
      dl[j] = d * static_cast<float>(sm[j]);
      ml[j] = dmin * static_cast<float>(sm[8 + j]);
    }
    T::groups(b, [&](int g, __m256i u) {
      put16<true>(out + 32 * g, low128(u), dl[g], ml[g]);
      put16<true>(out + 32 * g + 16, high128(u), dl[g], ml[g]);
    });
  }
}

void dequantize_q4k(const uint8_t* b, float* out, int64_t nblocks) {
  dequantize_q45k<Q4K>(b, out, nblocks);
}

void dequantize_q5k(const uint8_t* b, float* out, int64_t nblocks) {
  dequantize_q45k<Q5K>(b, out, nblocks);
}

void dequantize_q2k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 84, out += 256) {
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    float dl[16], ml[16];
    for (int j = 0; j < 16; ++j) {
      dl[j] = d * static_cast<float>(b[j] & 0x0f);
      ml[j] = dmin * static_cast<float>(b[j] >> 4);
    }
    Q2K::groups(b, [&](int g, __m256i u) {
      put16<true>(out + 32 * g, low128(u), dl[2 * g], ml[2 * g]);
      put16<true>(out + 32 * g + 16, high128(u), dl[2 * g + 1], ml[2 * g + 1]);
    });
  }
}

// Q3_K/Q6_K: a signed scale per 16 values, codes centred.
template <class T>
inline void put_centred(float* out, const float* dl, int g, __m256i u) {
  const __m256i c = _mm256_sub_epi8(u, bytes(T::kCentre));
  put16<false>(out + 32 * g, low128(c), dl[2 * g], 0.0f);
  put16<false>(out + 32 * g + 16, high128(c), dl[2 * g + 1], 0.0f);
}

void dequantize_q3k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 110, out += 256) {
    const float d = f16_at(b + 108);
    int8_t sc[16];
    q3k_scales(b + 96, sc);
    float dl[16];
    for (int j = 0; j < 16; ++j) dl[j] = d * static_cast<float>(sc[j]);
    Q3K::groups(b, [&](int g, __m256i u) { put_centred<Q3K>(out, dl, g, u); });
  }
}

void dequantize_q6k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 210, out += 256) {
    const float d = f16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    float dl[16];
    for (int j = 0; j < 16; ++j) dl[j] = d * static_cast<float>(sc[j]);
    Q6K::groups(b, [&](int g, __m256i u) { put_centred<Q6K>(out, dl, g, u); });
  }
}

void dequantize_iq4xs(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 136, out += 256) {
    const float d = f16_at(b);
    int8_t sc[8];
    iq4xs_scales(b, sc);
    float dl[8];
    for (int j = 0; j < 8; ++j) dl[j] = d * static_cast<float>(sc[j]);
    Iq4Xs::groups(b, [&](int j, __m256i w) {
      put16<false>(out + 32 * j, low128(w), dl[j], 0.0f);
      put16<false>(out + 32 * j + 16, high128(w), dl[j], 0.0f);
    });
  }
}

// --- dots

// acc + the 8 int32 sums of four u * q products, each pair of int16 lanes of maddubs' times
// its scale lane. maddubs cannot saturate: u <= 63 and |q| <= 127.
inline __m256i dot_scaled(__m256i acc, __m256i u, __m256i q, __m256i scales16) {
  const __m256i pairs = _mm256_maddubs_epi16(u, q);
#if defined(GGUF_VNNI256)
  return dpwssd256(acc, pairs, scales16);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales16));
#endif
}

// One weight row against R activation rows (act_row_bytes apart), each block unpacked once
// for all of them: out[r * out_stride].
template <class T, int R>
void dot_fixed(const uint8_t* row, const uint8_t* act, int64_t act_row_bytes, float* out,
               int64_t out_stride, int64_t nblocks) {
  // One row alone keeps two chains of accumulators: a block is too short for one chain to
  // hide dpwssd's latency. Several rows are chains enough.
  constexpr int kChains = R == 1 ? 2 : 1;
  const ActQ8K* a[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    a[r] = reinterpret_cast<const ActQ8K*>(act + r * act_row_bytes);
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t n = 0; n < nblocks; ++n, row += T::kBytes) {
    // The weights 2 KB ahead (on into the next rows, which gemv reads next): several
    // activation rows slow the stream down enough that the hardware prefetcher lets it
    // wait on DRAM (Q4_K, 4 rows of 4864: 5.7 GB/s without, 8.9 with; 10 from cache).
    for (int64_t o = 0; o < T::kBytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + 2048 + o, _MM_HINT_T0);
    const typename T::Block block(row);
    __m256i sumi[R][kChains];
    for (int r = 0; r < R; ++r) {
      sumi[r][0] = block.start(a[r][n]);
      if constexpr (kChains == 2) sumi[r][1] = _mm256_setzero_si256();
    }
    T::groups(row, [&](int g, __m256i u) {
      const __m256i scale = block.scale(g);
      if constexpr (T::kSigned) {
        // Signed values w: maddubs takes |w| and moves w's sign onto q.
        const __m256i w_abs = _mm256_abs_epi8(u);
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_sign_epi8(load32(a[r][n].q + 32 * g), u);
          sumi[r][g % kChains] = dot_scaled(sumi[r][g % kChains], w_abs, q, scale);
        }
      } else {
        for (int r = 0; r < R; ++r)
          sumi[r][g % kChains] =
              dot_scaled(sumi[r][g % kChains], u, load32(a[r][n].q + 32 * g), scale);
      }
    });
    for (int r = 0; r < R; ++r) {
      __m256i total = sumi[r][0];
      if constexpr (kChains == 2) total = _mm256_add_epi32(total, sumi[r][1]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(block.d * a[r][n].d), _mm256_cvtepi32_ps(total),
                               acc[r]);
      if constexpr (T::kHasMin)
        acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(block.dmin * a[r][n].d),
                                  _mm256_cvtepi32_ps(block.mins(a[r][n])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
}

template <class T>
float dot(const uint8_t* row, const void* act, int64_t nblocks) {
  float out;
  dot_fixed<T, 1>(row, static_cast<const uint8_t*>(act), 0, &out, 0, nblocks);
  return out;
}

// Up to 4 activation rows at a time: 4 rows' accumulators and the unpacked codes fit
// AVX2's 16 registers.
template <class T>
void dot_rows(const uint8_t* row, const void* act, int64_t act_row_bytes, int64_t m, float* out,
              int64_t out_stride, int64_t nblocks) {
  const uint8_t* a = static_cast<const uint8_t*>(act);
  for (int64_t i = 0; i < m;) {
    const uint8_t* x = a + i * act_row_bytes;
    float* y = out + i * out_stride;
    switch (m - i) {
      case 1: dot_fixed<T, 1>(row, x, act_row_bytes, y, out_stride, nblocks); i += 1; break;
      case 2: dot_fixed<T, 2>(row, x, act_row_bytes, y, out_stride, nblocks); i += 2; break;
      case 3: dot_fixed<T, 3>(row, x, act_row_bytes, y, out_stride, nblocks); i += 3; break;
      default: dot_fixed<T, 4>(row, x, act_row_bytes, y, out_stride, nblocks); i += 4; break;
    }
  }
}

template <class T>
constexpr BlockType entry(const char* name, void (*dequantize)(const uint8_t*, float*, int64_t)) {
  return {name, 256, T::kBytes, ActFormat::Q8K, dequantize, &dot<T>, &dot_rows<T>};
}

constexpr BlockType kQ2K = entry<Q2K>("Q2_K", &dequantize_q2k);
constexpr BlockType kQ3K = entry<Q3K>("Q3_K", &dequantize_q3k);
constexpr BlockType kQ4K = entry<Q4K>("Q4_K", &dequantize_q4k);
constexpr BlockType kQ5K = entry<Q5K>("Q5_K", &dequantize_q5k);
constexpr BlockType kQ6K = entry<Q6K>("Q6_K", &dequantize_q6k);
constexpr BlockType kIq4Xs = entry<Iq4Xs>("IQ4_XS", &dequantize_iq4xs);

#else
// ---------------------------------------------------------------------------------------
// Portable dequantize: each value as the reference computes it.

void dequantize_q2k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 84, out += 256) {
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int g = 0; g < 8; ++g) {
      const uint8_t* qs = b + 16 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      for (int h = 0; h < 2; ++h) {
        const uint8_t s = b[2 * g + h];
        const float dl = d * static_cast<float>(s & 0x0f), ml = dmin * static_cast<float>(s >> 4);
        float* o = out + 32 * g + 16 * h;
        for (int i = 0; i < 16; ++i)
          o[i] = dl * static_cast<float>((qs[16 * h + i] >> shift) & 3) - ml;
      }
    }
  }
}

void dequantize_q3k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 110, out += 256) {
    const float d = f16_at(b + 108);
    int8_t sc[16];
    q3k_scales(b + 96, sc);
    for (int g = 0; g < 8; ++g) {
      const uint8_t* qs = b + 32 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      for (int h = 0; h < 2; ++h) {
        const float dl = d * static_cast<float>(sc[2 * g + h]);
        float* o = out + 32 * g + 16 * h;
        for (int i = 0; i < 16; ++i) {
          const int k = 16 * h + i;
          // A clear hmask bit subtracts 4.
          const int q = ((qs[k] >> shift) & 3) - (((b[k] >> g) & 1) ? 0 : 4);
          o[i] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

void dequantize_q4k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 144, out += 256) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    uint8_t sm[16];
    q4k_scales(b + 4, sm);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(sm[j]), ml = dmin * static_cast<float>(sm[8 + j]);
      const uint8_t* qs = b + 16 + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int i = 0; i < 32; ++i)
        out[32 * j + i] = dl * static_cast<float>((qs[i] >> shift) & 0x0f) - ml;
    }
  }
}

void dequantize_q5k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 176, out += 256) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    uint8_t sm[16];
    q4k_scales(b + 4, sm);
    const uint8_t* qh = b + 16;
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(sm[j]), ml = dmin * static_cast<float>(sm[8 + j]);
      const uint8_t* qs = b + 48 + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int i = 0; i < 32; ++i) {
        const int q = ((qs[i] >> shift) & 0x0f) | (((qh[i] >> j) & 1) << 4);
        out[32 * j + i] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

void dequantize_q6k(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 210, out += 256) {
    const float d = f16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 8; ++g) {
      const int half = g / 4, s = g % 4;
      const uint8_t* ql = b + 64 * half + 32 * (s % 2);
      const uint8_t* qh = b + 128 + 32 * half;
      const int lshift = 4 * (s / 2), hshift = 2 * s;
      for (int h = 0; h < 2; ++h) {
        const float dl = d * static_cast<float>(sc[2 * g + h]);
        float* o = out + 32 * g + 16 * h;
        for (int i = 0; i < 16; ++i) {
          const int k = 16 * h + i;
          const int q = (((ql[k] >> lshift) & 0x0f) | (((qh[k] >> hshift) & 3) << 4)) - 32;
          o[i] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

void dequantize_iq4xs(const uint8_t* b, float* out, int64_t nblocks) {
  for (int64_t n = 0; n < nblocks; ++n, b += 136, out += 256) {
    const float d = f16_at(b);
    int8_t sc[8];
    iq4xs_scales(b, sc);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(sc[j]);
      const uint8_t* qs = b + 8 + 16 * j;
      for (int i = 0; i < 16; ++i) {
        out[32 * j + i] = dl * static_cast<float>(kIq4Values[qs[i] & 0x0f]);
        out[32 * j + 16 + i] = dl * static_cast<float>(kIq4Values[qs[i] >> 4]);
      }
    }
  }
}

// Portable dots: the same integer sums, a value at a time.

// sum over a sub-block of `len` values of code * q, codes given by `code(i)`.
template <class Code>
inline int sub_dot(const int8_t* q, int len, Code code) {
  int s = 0;
  for (int i = 0; i < len; ++i) s += code(i) * q[i];
  return s;
}

float dot_q2k(const uint8_t* row, const void* act, int64_t nblocks) {
  const ActQ8K* a = static_cast<const ActQ8K*>(act);
  float total = 0.0f;
  for (int64_t n = 0; n < nblocks; ++n, row += 84) {
    int sumi = 0, summ = 0;
    for (int j = 0; j < 16; ++j) {
      const int g = j / 2;
      const uint8_t* qs = row + 16 + 32 * (g / 4) + 16 * (j % 2);
      const int shift = 2 * (g % 4);
      const int dot = sub_dot(a[n].q + 16 * j, 16, [&](int i) { return (qs[i] >> shift) & 3; });
      sumi += (row[j] & 0x0f) * dot;
      summ += (row[j] >> 4) * a[n].bsums[j];
    }
    total += f16_at(row + 80) * a[n].d * static_cast<float>(sumi) -
             f16_at(row + 82) * a[n].d * static_cast<float>(summ);
  }
  return total;
}

float dot_q3k(const uint8_t* row, const void* act, int64_t nblocks) {
  const ActQ8K* a = static_cast<const ActQ8K*>(act);
  float total = 0.0f;
  for (int64_t n = 0; n < nblocks; ++n, row += 110) {
    int8_t sc[16];
    q3k_scales(row + 96, sc);
    int sumi = 0;
    for (int j = 0; j < 16; ++j) {
      const int g = j / 2, k0 = 16 * (j % 2);
      const uint8_t* qs = row + 32 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      const int dot = sub_dot(a[n].q + 16 * j, 16, [&](int i) {
        return ((qs[k0 + i] >> shift) & 3) - (((row[k0 + i] >> g) & 1) ? 0 : 4);
      });
      sumi += sc[j] * dot;
    }
    total += f16_at(row + 108) * a[n].d * static_cast<float>(sumi);
  }
  return total;
}

template <bool kFive>
float dot_q45k(const uint8_t* row, const void* act, int64_t nblocks) {
  const ActQ8K* a = static_cast<const ActQ8K*>(act);
  constexpr int64_t kBytes = kFive ? 176 : 144;
  constexpr int kQs = kFive ? 48 : 16;
  float total = 0.0f;
  for (int64_t n = 0; n < nblocks; ++n, row += kBytes) {
    uint8_t sm[16];
    q4k_scales(row + 4, sm);
    int sumi = 0, summ = 0;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qs = row + kQs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      const int dot = sub_dot(a[n].q + 32 * j, 32, [&](int i) {
        const int high = kFive ? ((row[16 + i] >> j) & 1) << 4 : 0;
        return ((qs[i] >> shift) & 0x0f) | high;
      });
      sumi += sm[j] * dot;
      summ += sm[8 + j] * (a[n].bsums[2 * j] + a[n].bsums[2 * j + 1]);
    }
    total += f16_at(row) * a[n].d * static_cast<float>(sumi) -
             f16_at(row + 2) * a[n].d * static_cast<float>(summ);
  }
  return total;
}

float dot_q4k(const uint8_t* row, const void* act, int64_t nblocks) {
  return dot_q45k<false>(row, act, nblocks);
}

float dot_q5k(const uint8_t* row, const void* act, int64_t nblocks) {
  return dot_q45k<true>(row, act, nblocks);
}

float dot_q6k(const uint8_t* row, const void* act, int64_t nblocks) {
  const ActQ8K* a = static_cast<const ActQ8K*>(act);
  float total = 0.0f;
  for (int64_t n = 0; n < nblocks; ++n, row += 210) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    int sumi = 0;
    for (int j = 0; j < 16; ++j) {
      const int g = j / 2, half = g / 4, s = g % 4, k0 = 16 * (j % 2);
      const uint8_t* ql = row + 64 * half + 32 * (s % 2) + k0;
      const uint8_t* qh = row + 128 + 32 * half + k0;
      const int lshift = 4 * (s / 2), hshift = 2 * s;
      const int dot = sub_dot(a[n].q + 16 * j, 16, [&](int i) {
        return (((ql[i] >> lshift) & 0x0f) | (((qh[i] >> hshift) & 3) << 4)) - 32;
      });
      sumi += sc[j] * dot;
    }
    total += f16_at(row + 208) * a[n].d * static_cast<float>(sumi);
  }
  return total;
}

float dot_iq4xs(const uint8_t* row, const void* act, int64_t nblocks) {
  const ActQ8K* a = static_cast<const ActQ8K*>(act);
  float total = 0.0f;
  for (int64_t n = 0; n < nblocks; ++n, row += 136) {
    int8_t sc[8];
    iq4xs_scales(row, sc);
    int sumi = 0;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qs = row + 8 + 16 * j;
      const int8_t* q = a[n].q + 32 * j;
      const int dot = sub_dot(q, 16, [&](int i) { return kIq4Values[qs[i] & 0x0f]; }) +
                      sub_dot(q + 16, 16, [&](int i) { return kIq4Values[qs[i] >> 4]; });
      sumi += sc[j] * dot;
    }
    total += f16_at(row) * a[n].d * static_cast<float>(sumi);
  }
  return total;
}

constexpr BlockType kQ2K{"Q2_K", 256, 84, ActFormat::Q8K, &dequantize_q2k, &dot_q2k};
constexpr BlockType kQ3K{"Q3_K", 256, 110, ActFormat::Q8K, &dequantize_q3k, &dot_q3k};
constexpr BlockType kQ4K{"Q4_K", 256, 144, ActFormat::Q8K, &dequantize_q4k, &dot_q4k};
constexpr BlockType kQ5K{"Q5_K", 256, 176, ActFormat::Q8K, &dequantize_q5k, &dot_q5k};
constexpr BlockType kQ6K{"Q6_K", 256, 210, ActFormat::Q8K, &dequantize_q6k, &dot_q6k};
constexpr BlockType kIq4Xs{"IQ4_XS", 256, 136, ActFormat::Q8K, &dequantize_iq4xs, &dot_iq4xs};
#endif


}  // namespace

const BlockType* kquant_type(int64_t ggml_type) {
  switch (ggml_type) {
    case Q2_K: return &kQ2K;
    case Q3_K: return &kQ3K;
    case Q4_K: return &kQ4K;
    case Q5_K: return &kQ5K;
    case Q6_K: return &kQ6K;
    case IQ4_XS: return &kIq4Xs;
    default: return nullptr;
  }
}

}  // namespace gapless_gguf
