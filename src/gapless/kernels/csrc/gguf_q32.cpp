// The 32-element GGUF block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL.
//
// Every type's block is an f16 scale d (and for Q4_1/Q5_1 an f16 minimum m) followed by 32
// codes; a weight is d * code + m, the code being centred for the types without a minimum
// (Q4_0: u - 8, Q5_0: u - 16, IQ4_NL: a table of 16 signed values). A dot with activations
// quantized per 32 values (x ~ dx * q) takes the integer sum of codes times q per block and
// scales it once: d dx sum(code q) + m s, with s = dx sum(q).
//
// The vector paths multiply unsigned bytes by signed ones (dpbusd, maddubs): they take the
// codes unsigned, u = code + centre, and fold the centre back out through s:
// d dx sum(u q) - centre d s. Built with -ffp-contract=off so that dequantize's d * code + m
// rounds twice as the `gguf` package's numpy does.
#include "gguf_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define GGUF_VNNI 1
#endif

namespace gapless_gguf {

float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {  // infinity or NaN
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24, exact in float
    float f = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

void quantize_act_q8(const float* x, ActQ8* out, int64_t n) {
  // ggml's Q8_0 of activations. Every path finds the same amax, multiplies by the same id
  // and rounds to nearest even (nearbyint, and the vector converts' default mode), so all
  // builds agree to the bit.
  for (int64_t b = 0; b < n / 32; ++b, x += 32) {
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#elif defined(__AVX2__)
    __m256 v[4], m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
#endif
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
#if defined(__AVX512F__)
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].q + 16), _mm512_cvtepi32_epi8(q1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    // |q| <= 127: the packs do not saturate; they interleave 32-bit groups, the permute
    // restores their order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
    s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4e));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
#else
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(x[j] * id));
      out[b].q[j] = static_cast<int8_t>(q);
      sum += q;
    }
#endif
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

// ggml's IQ4_NL values (kvalues_iq4nl).
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// Codes j and j + 16 share byte j: low nibble, high nibble.
inline void nibbles(const uint8_t* qs, uint8_t* u) {
  for (int j = 0; j < 16; ++j) {
    u[j] = qs[j] & 0x0f;
    u[j + 16] = qs[j] >> 4;
  }
}

// Q5's fifth bits: bit j of a little-endian uint32 for code j.
inline void fifth_bits(const uint8_t* qh, uint8_t* u) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof bits);
  for (int j = 0; j < 32; ++j) u[j] |= ((bits >> j) & 1) << 4;
}

#if defined(__AVX2__)
inline __m256i nibbles_v(const uint8_t* qs) {
  // The 16 bytes in both halves (a load, no shuffle), the upper half shifted to its nibbles.
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i b = _mm256_broadcastsi128_si256(bytes);
  const __m256i v = _mm256_srlv_epi32(b, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

// The f16 at p in every lane: a broadcast load and one conversion.
inline __m256 f16_v(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

// 0x10 in byte j where bit j of qh is set.
inline __m256i fifth_bits_v(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof bits);
#if defined(GGUF_VNNI)
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
  // Byte j takes byte j / 8 of the bits, keeps bit j % 8 and widens it to 0xff.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// acc + the 8 int32 sums of four unsigned bytes u times signed bytes q.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i q) {
#if defined(GGUF_VNNI256)
  return dpbusd256(acc, u, q);
#else
  // A pair of products fits int16 while u <= 128 (|q| <= 127): maddubs does not saturate.
  const __m256i pairs = _mm256_maddubs_epi16(u, q);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
#endif

// What a type is, per block: its scale d, minimum m (0 where none) and 32 codes such that
// a weight is d * code + m. For the vector dots: the codes as unsigned bytes u = code +
// kCentre, or for kSignedAvx2 types on AVX2 (whose u would overflow maddubs' int16 pairs)
// as signed bytes.
struct Q4_0T {
  static constexpr int64_t kCodeBytes = 16;  // interleaved: see gguf_blocks.h
  static constexpr int64_t kBytes = 18;
  static constexpr int kCentre = 8;
  static constexpr bool kHasMin = false, kSignedAvx2 = false;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float m(const uint8_t*) { return 0.0f; }
  static void codes(const uint8_t* b, int8_t* c) {
    uint8_t u[32];
    nibbles(b + 2, u);
    for (int j = 0; j < 32; ++j) c[j] = static_cast<int8_t>(u[j] - 8);
  }
#if defined(__AVX2__)
  static __m256i ucodes(const uint8_t* b) { return nibbles_v(b + 2); }
#endif
};

struct Q4_1T {
  static constexpr int64_t kCodeBytes = 16;  // interleaved: see gguf_blocks.h
  static constexpr int64_t kBytes = 20;
  static constexpr int kCentre = 0;
  static constexpr bool kHasMin = true, kSignedAvx2 = false;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float m(const uint8_t* b) { return f16_at(b + 2); }
  static void codes(const uint8_t* b, int8_t* c) { nibbles(b + 4, reinterpret_cast<uint8_t*>(c)); }
#if defined(__AVX2__)
  static __m256i ucodes(const uint8_t* b) { return nibbles_v(b + 4); }
#endif
};

struct Q5_0T {
  static constexpr int64_t kCodeBytes = 20;  // qh then qs; interleaved: see gguf_blocks.h
  static constexpr int64_t kBytes = 22;
  static constexpr int kCentre = 16;
  static constexpr bool kHasMin = false, kSignedAvx2 = false;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float m(const uint8_t*) { return 0.0f; }
  static void codes(const uint8_t* b, int8_t* c) {
    uint8_t u[32];
    nibbles(b + 6, u);
    fifth_bits(b + 2, u);
    for (int j = 0; j < 32; ++j) c[j] = static_cast<int8_t>(u[j] - 16);
  }
#if defined(__AVX2__)
  static __m256i ucodes(const uint8_t* b) {
    return _mm256_or_si256(nibbles_v(b + 6), fifth_bits_v(b + 2));
  }
#endif
};

struct Q5_1T {
  static constexpr int64_t kCodeBytes = 20;  // qh then qs; interleaved: see gguf_blocks.h
  static constexpr int64_t kBytes = 24;
  static constexpr int kCentre = 0;
  static constexpr bool kHasMin = true, kSignedAvx2 = false;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float m(const uint8_t* b) { return f16_at(b + 2); }
  static void codes(const uint8_t* b, int8_t* c) {
    uint8_t* u = reinterpret_cast<uint8_t*>(c);
    nibbles(b + 8, u);
    fifth_bits(b + 4, u);
  }
#if defined(__AVX2__)
  static __m256i ucodes(const uint8_t* b) {
    return _mm256_or_si256(nibbles_v(b + 8), fifth_bits_v(b + 4));
  }
#endif
};

struct Q8_0T {
  static constexpr int64_t kCodeBytes = 32;  // interleaved: see gguf_blocks.h
  static constexpr int64_t kBytes = 34;
  static constexpr int kCentre = 128;
  static constexpr bool kHasMin = false, kSignedAvx2 = true;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float m(const uint8_t*) { return 0.0f; }
  static void codes(const uint8_t* b, int8_t* c) { std::memcpy(c, b + 2, 32); }
#if defined(__AVX2__)
  static __m256i scodes(const uint8_t* b) { return load32(b + 2); }
  static __m256i ucodes(const uint8_t* b) {
    return _mm256_xor_si256(scodes(b), _mm256_set1_epi8(static_cast<char>(0x80)));
  }
#endif
};

struct Iq4nlT {
  static constexpr int64_t kCodeBytes = 0;  // interleaved: see gguf_blocks.h
  static constexpr int64_t kBytes = 18;
  static constexpr int kCentre = 128;
  static constexpr bool kHasMin = false, kSignedAvx2 = true;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float m(const uint8_t*) { return 0.0f; }
  static void codes(const uint8_t* b, int8_t* c) {
    uint8_t u[32];
    nibbles(b + 2, u);
    for (int j = 0; j < 32; ++j) c[j] = kIq4nlValues[u[j]];
  }
#if defined(__AVX2__)
  static __m256i lookup(const uint8_t* b, __m128i table) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles_v(b + 2));
  }
  static __m256i scodes(const uint8_t* b) {
    return lookup(b, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  }
  static __m256i ucodes(const uint8_t* b) {
    return lookup(b, _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)),
                                   _mm_set1_epi8(static_cast<char>(0x80))));
  }
#endif
};

#if defined(__AVX2__)
// The 32 codes as signed bytes: the weights are d * code + m.
template <class T>
inline __m256i codes_v(const uint8_t* b) {
  if constexpr (T::kSignedAvx2)
    return T::scodes(b);
  else if constexpr (T::kCentre != 0)
    return _mm256_sub_epi8(T::ucodes(b), _mm256_set1_epi8(T::kCentre));
  else
    return T::ucodes(b);
}
#endif

template <class T>
void dequantize(const uint8_t* row, float* out, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, row += T::kBytes, out += 32) {
    const float d = T::d(row), m = T::m(row);
#if defined(__AVX512F__)
    const __m256i c = codes_v<T>(row);
    for (int half = 0; half < 2; ++half) {
      const __m128i c16 = half ? _mm256_extracti128_si256(c, 1) : _mm256_castsi256_si128(c);
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c16)), _mm512_set1_ps(d));
      if constexpr (T::kHasMin) v = _mm512_add_ps(v, _mm512_set1_ps(m));
      _mm512_storeu_ps(out + 16 * half, v);
    }
#elif defined(__AVX2__)
    const __m256i c = codes_v<T>(row);
    for (int quarter = 0; quarter < 4; ++quarter) {
      const __m128i c16 = quarter < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
      const __m128i c8 = quarter & 1 ? _mm_srli_si128(c16, 8) : c16;
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)), _mm256_set1_ps(d));
      if constexpr (T::kHasMin) v = _mm256_add_ps(v, _mm256_set1_ps(m));
      _mm256_storeu_ps(out + 8 * quarter, v);
    }
#else
    int8_t c[32];
    T::codes(row, c);
    for (int j = 0; j < 32; ++j) {
      out[j] = d * static_cast<float>(c[j]);
      if constexpr (T::kHasMin) out[j] += m;  // not for the others: -0 + 0 would be +0
    }
#endif
  }
}

#if defined(__AVX2__)
#if defined(GGUF_VNNI256)
template <class T>
constexpr bool kSigned = false;  // dpbusd sums four products in int32: any u fits
#else
template <class T>
constexpr bool kSigned = T::kSignedAvx2;
#endif

// One block into acc (8 partial sums, scaled) and folded (s d for the centre, or s m for the
// minimum, in every lane, to take out or add once at the end). Every type has d at byte 0
// and its minimum, if any, at byte 2.
template <class T>
inline __attribute__((always_inline)) void dot_block(const uint8_t* w, const ActQ8& a,
                                                     __m256& acc, __m256& folded) {
  const __m256i q = load32(a.q);
  const __m256 d = f16_v(w);
  __m256i sums;
  if constexpr (kSigned<T>) {
    const __m256i c = T::scodes(w);
    sums = dot_u8s8(_mm256_setzero_si256(), _mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
  } else {
    sums = dot_u8s8(_mm256_setzero_si256(), T::ucodes(w), q);
    folded = _mm256_fmadd_ps(T::kHasMin ? f16_v(w + 2) : d, _mm256_set1_ps(a.s), folded);
  }
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc);
}
#endif

template <class T>
inline float finish(float sum, float folded) {
#if defined(__AVX2__)
  if constexpr (kSigned<T>) return sum;
#endif
  if constexpr (T::kHasMin) return sum + folded;
  return sum - static_cast<float>(T::kCentre) * folded;
}

template <class T>
float dot(const uint8_t* row, const void* act, int64_t nblocks) {
  const ActQ8* a = static_cast<const ActQ8*>(act);
#if defined(__AVX2__)
  // Two chains of accumulators: a block's work is short next to an FMA's latency.
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m256 folded0 = _mm256_setzero_ps(), folded1 = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nblocks; b += 2) {
    dot_block<T>(row + b * T::kBytes, a[b], acc0, folded0);
    dot_block<T>(row + (b + 1) * T::kBytes, a[b + 1], acc1, folded1);
  }
  if (b < nblocks) dot_block<T>(row + b * T::kBytes, a[b], acc0, folded0);
  return finish<T>(hsum(_mm256_add_ps(acc0, acc1)),
                   _mm256_cvtss_f32(_mm256_add_ps(folded0, folded1)));
#else
  float total = 0.0f;
  for (int64_t b = 0; b < nblocks; ++b, row += T::kBytes) {
    int8_t c[32];
    T::codes(row, c);
    int sum = 0;
    if constexpr (T::kHasMin) {
      for (int j = 0; j < 32; ++j) sum += static_cast<uint8_t>(c[j]) * a[b].q[j];
    } else {
      for (int j = 0; j < 32; ++j) sum += c[j] * a[b].q[j];
    }
    total += T::d(row) * a[b].d * static_cast<float>(sum) + T::m(row) * a[b].s;
  }
  return total;
#endif
}

#if defined(__AVX2__)
// R activation rows at once: each weight block is unpacked once for all of them.
template <class T, int R>
void dot_rows_fixed(const uint8_t* row, const ActQ8* a, int64_t act_stride, float* out,
                    int64_t out_stride, int64_t nblocks) {
  __m256 acc[R], folded[R];
  for (int r = 0; r < R; ++r) acc[r] = folded[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b, row += T::kBytes) {
    const __m256 d = f16_v(row);
    __m256i w, w_abs;
    if constexpr (kSigned<T>)
      w = T::scodes(row), w_abs = _mm256_abs_epi8(w);
    else
      w = T::ucodes(row);
    const __m256 fold_scale = T::kHasMin ? f16_v(row + 2) : d;
    for (int r = 0; r < R; ++r) {
      const ActQ8& x = a[r * act_stride + b];
      const __m256i q = load32(x.q);
      __m256i sums;
      if constexpr (kSigned<T>) {
        sums = dot_u8s8(_mm256_setzero_si256(), w_abs, _mm256_sign_epi8(q, w));
      } else {
        sums = dot_u8s8(_mm256_setzero_si256(), w, q);
        folded[r] = _mm256_fmadd_ps(fold_scale, _mm256_set1_ps(x.s), folded[r]);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(x.d)),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r * out_stride] = finish<T>(hsum(acc[r]), _mm256_cvtss_f32(folded[r]));
}
#endif

template <class T>
void dot_rows(const uint8_t* row, const void* act, int64_t act_row_bytes, int64_t m, float* out,
              int64_t out_stride, int64_t nblocks) {
  const uint8_t* a = static_cast<const uint8_t*>(act);
  int64_t i = 0;
#if defined(__AVX2__)
  const int64_t stride = act_row_bytes / static_cast<int64_t>(sizeof(ActQ8));
  for (; i + 4 <= m; i += 4)
    dot_rows_fixed<T, 4>(row, reinterpret_cast<const ActQ8*>(a + i * act_row_bytes), stride,
                         out + i * out_stride, out_stride, nblocks);
  if (m - i >= 2) {
    const auto* x = reinterpret_cast<const ActQ8*>(a + i * act_row_bytes);
    if (m - i == 3)
      dot_rows_fixed<T, 3>(row, x, stride, out + i * out_stride, out_stride, nblocks);
    else
      dot_rows_fixed<T, 2>(row, x, stride, out + i * out_stride, out_stride, nblocks);
    return;
  }
#endif
  for (; i < m; ++i) out[i * out_stride] = dot<T>(row, a + i * act_row_bytes, nblocks);
}

#if defined(__AVX2__)
// Interleaved groups (gguf_blocks.h) of the types whose codes are 4 or 8 bits, unsigned or
// centred: Q4_0, Q4_1, Q8_0. Code vector j (of 8) holds, in row r's lane, the row's codes
// 4j .. 4j + 3 as unsigned bytes u: Q4's nibbles (low ones for j < 4, high for j >= 4),
// Q8_0's bytes. They meet activation bytes 4j .. 4j + 3, broadcast to every lane.
template <class T>
constexpr int64_t kGroupBlockBytes = kGroupRows * T::kBytes;

#if defined(GGUF_VNNI)
// Q5's fifth bits: which bytes of u[j] (codes 4j .. 4j + 3 of each row's lane) have theirs
// set: bits 4j .. 4j + 3 of the lane's 32 qh bits, byte j / 2 of it, spread to the lane's 4
// bytes.
inline __mmask64 fifth_bits_group(__m512i qh, int j) {
  const __m512i lane_base = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  const __m512i bytes = _mm512_shuffle_epi8(qh, _mm512_add_epi8(lane_base, _mm512_set1_epi8(j / 2)));
  const uint32_t bit = 0x08040201u << (4 * (j % 2));  // byte k: bit 4 (j % 2) + k
  return _mm512_test_epi8_mask(bytes, _mm512_set1_epi32(static_cast<int32_t>(bit)));
}

// All 16 rows in one vector. Q8_0's codes are taken unsigned (code + 128), its centre folded
// out through s like Q4_0's 8: d (dx sum(u q) - centre s), or for Q4_1 d dx sum(u q) + m s.
template <class T>
inline void group_codes(const uint8_t* codes, __m512i* u) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  if constexpr (T::kCodeBytes == 16 || T::kCodeBytes == 20) {
    const uint8_t* qs = codes + (T::kCodeBytes - 16) * kGroupRows;  // after Q5's qh
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(qs + 64 * c);
      u[c] = _mm512_and_si512(w, low);
      u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
    }
    if constexpr (T::kCodeBytes == 20) {
      const __m512i qh = _mm512_loadu_si512(codes), sixteen = _mm512_set1_epi8(16);
      for (int j = 0; j < 8; ++j)
        u[j] = _mm512_mask_add_epi8(u[j], fifth_bits_group(qh, j), u[j], sixteen);
    }
  } else {
    for (int c = 0; c < 8; ++c)
      u[c] = _mm512_xor_si512(_mm512_loadu_si512(codes + 64 * c),
                              _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

template <class T, int R>
void dot_group_fixed(const uint8_t* group, const ActQ8* a, int64_t act_stride, float* out,
                     int64_t out_stride, int64_t nblocks) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * kGroupBlockBytes<T>;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const uint8_t* codes = p + kGroupRows * (T::kBytes - T::kCodeBytes);
    __m512i u[8];
    group_codes<T>(codes, u);
    __m512 mins = _mm512_setzero_ps();
    if constexpr (T::kHasMin)
      mins = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * kGroupRows)));
    for (int r = 0; r < R; ++r) {
      const ActQ8& x = a[r * act_stride + b];
      __m512i sums = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t q4;
        std::memcpy(&q4, x.q + 4 * j, sizeof q4);
        sums = _mm512_dpbusd_epi32(sums, u[j], _mm512_set1_epi32(q4));
      }
      const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x.d));
      if constexpr (T::kHasMin) {
        acc[r] = _mm512_fmadd_ps(d, dot, _mm512_fmadd_ps(mins, _mm512_set1_ps(x.s), acc[r]));
      } else {
        const __m512 centred = _mm512_sub_ps(dot, _mm512_set1_ps(T::kCentre * x.s));
        acc[r] = _mm512_fmadd_ps(d, centred, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}
#else
// fifth_bits_group for 8 rows: 16 in each byte of u[j] whose code has its fifth bit set.
inline __m256i fifth_bits_half(__m256i qh, int j) {
  const __m256i lane_base = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0,
                                              0x04040404, 0x08080808, 0x0C0C0C0C);
  const __m256i bytes =
      _mm256_shuffle_epi8(qh, _mm256_add_epi8(lane_base, _mm256_set1_epi8(j / 2)));
  const __m256i bit = _mm256_set1_epi32(static_cast<int32_t>(0x08040201u << (4 * (j % 2))));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// Two vectors of 8 rows. Without VNNI, maddubs sums pairs in int16: Q4's u (at most 15)
// fit, Q8_0's codes go signed (|code| times sign-adjusted q), with no centre. With AVX-VNNI
// they go unsigned (code + 128) and centred, as on AVX512-VNNI.
template <class T, int R>
void dot_group_fixed(const uint8_t* group, const ActQ8* a, int64_t act_stride, float* out,
                     int64_t out_stride, int64_t nblocks) {
  constexpr int kHalf = kGroupRows / 2;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * kGroupBlockBytes<T>;
    const uint8_t* codes = p + kGroupRows * (T::kBytes - T::kCodeBytes);
    for (int h = 0; h < 2; ++h) {
      const auto f16x8 = [&](int64_t at) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)));
      };
      const __m256 d = f16x8(2 * kHalf * h);
      __m256i u[8];
      if constexpr (T::kCodeBytes != 32) {
        const uint8_t* qs = codes + (T::kCodeBytes - 16) * kGroupRows;  // after Q5's qh
        for (int c = 0; c < 4; ++c) {
          const __m256i w = load32(qs + 64 * c + 32 * h);
          u[c] = _mm256_and_si256(w, low);
          u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        }
        if constexpr (T::kCodeBytes == 20) {
          const __m256i qh = load32(codes + 32 * h);
          for (int j = 0; j < 8; ++j) u[j] = _mm256_or_si256(u[j], fifth_bits_half(qh, j));
        }
      } else {
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(kSigned<T> ? 0 : 0x80));
        for (int c = 0; c < 8; ++c) u[c] = _mm256_xor_si256(load32(codes + 64 * c + 32 * h), flip);
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8& x = a[r * act_stride + b];
        __m256i sums = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          int32_t q4;
          std::memcpy(&q4, x.q + 4 * j, sizeof q4);
          const __m256i q = _mm256_set1_epi32(q4);
          if constexpr (kSigned<T>)
            sums = dot_u8s8(sums, _mm256_abs_epi8(u[j]), _mm256_sign_epi8(q, u[j]));
          else  // u at most 31, or dpbusd's int32 sums
            sums = dot_u8s8(sums, u[j], q);
        }
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(x.d));
        if constexpr (T::kHasMin) {
          const __m256 m = f16x8(2 * kGroupRows + 2 * kHalf * h);
          acc[r][h] = _mm256_fmadd_ps(d, dot, _mm256_fmadd_ps(m, _mm256_set1_ps(x.s), acc[r][h]));
        } else if constexpr (!kSigned<T>) {
          const __m256 centred = _mm256_sub_ps(dot, _mm256_set1_ps(T::kCentre * x.s));
          acc[r][h] = _mm256_fmadd_ps(d, centred, acc[r][h]);
        } else {
          acc[r][h] = _mm256_fmadd_ps(d, dot, acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * out_stride + kHalf * h, acc[r][h]);
}
#endif

template <class T>
void dot_group(const uint8_t* group, const void* act, int64_t act_row_bytes, int64_t m,
               float* out, int64_t out_stride, int64_t nblocks) {
  const uint8_t* a = static_cast<const uint8_t*>(act);
  const int64_t stride = act_row_bytes / static_cast<int64_t>(sizeof(ActQ8));
  for (int64_t i = 0; i < m;) {
    const auto* x = reinterpret_cast<const ActQ8*>(a + i * act_row_bytes);
    float* o = out + i * out_stride;
    switch (std::min<int64_t>(m - i, 4)) {
      case 4: dot_group_fixed<T, 4>(group, x, stride, o, out_stride, nblocks); i += 4; break;
      case 3: dot_group_fixed<T, 3>(group, x, stride, o, out_stride, nblocks); i += 3; break;
      case 2: dot_group_fixed<T, 2>(group, x, stride, o, out_stride, nblocks); i += 2; break;
      default: dot_group_fixed<T, 1>(group, x, stride, o, out_stride, nblocks); i += 1;
    }
  }
}
#endif

template <class T>
constexpr BlockType entry(const char* name) {
  BlockType t{name, 32, T::kBytes, ActFormat::Q8, &dequantize<T>, &dot<T>, &dot_rows<T>};
  t.code_bytes = T::kCodeBytes;
#if defined(__AVX2__)
  if constexpr (T::kCodeBytes > 0) t.dot_group = &dot_group<T>;
#endif
  return t;
}

constexpr BlockType kQ4_0 = entry<Q4_0T>("Q4_0");
constexpr BlockType kQ4_1 = entry<Q4_1T>("Q4_1");
constexpr BlockType kQ5_0 = entry<Q5_0T>("Q5_0");
constexpr BlockType kQ5_1 = entry<Q5_1T>("Q5_1");
constexpr BlockType kQ8_0 = entry<Q8_0T>("Q8_0");
constexpr BlockType kIq4nl = entry<Iq4nlT>("IQ4_NL");

}  // namespace

const BlockType* q32_type(int64_t ggml_type) {
  switch (ggml_type) {
    case Q4_0: return &kQ4_0;
    case Q4_1: return &kQ4_1;
    case Q5_0: return &kQ5_0;
    case Q5_1: return &kQ5_1;
    case Q8_0: return &kQ8_0;
    case IQ4_NL: return &kIq4nl;
    default: return nullptr;
  }
}

}  // namespace gapless_gguf
