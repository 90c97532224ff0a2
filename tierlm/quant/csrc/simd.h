// The vector primitives the kernels are written in, one set per instruction set. The build's
// -march picks one at compile time: AVX-512 (16 lanes), AVX2+FMA (8 lanes), or GCC/Clang
// vector extensions (4 lanes, whatever the target offers: SSE, NEON, ...). Kernels use only
// `Vec`, so the tile code tested on one ISA is the code the others run.
//
// Besides fp32 and int8 loads, `Vec` reads the int4 format (tierlm/quant/int4.py): `nibbles`
// widens `lanes` packed bytes to their low nibbles (columns j..) and high nibbles (columns
// 16 + j..) as fp32, and `load_half` widens fp16 (scales, offsets) with F16C where the target
// has it; `half_to_float` is the scalar conversion. `sixes` reads GGUF Q6_K's 2-bit high
// parts (crumbs) as tierlm/quant/q6k.py lays them: per 32-column chunk 8 bytes, byte i holding columns i,
// 8 + i, 16 + i and 24 + i in its bit pairs from the lowest. `fives` and `sixes` join GGUF's
// 5- and 6-bit codes from their parts as integers, converting each register once; `lowbits`
// does the same for GGUF Q2_K/Q3_K's 2-bit crumbs (sixes' layout) and Q3_K's high bits.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TIERLM_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIERLM_ISA 256
#else
#define TIERLM_ISA 0
#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif
#if defined(__F16C__)  // e.g. an AVX machine without AVX2: fp16 conversions still in hardware
#include <immintrin.h>
#endif
#endif

namespace tl {

// fp16 bits -> fp32 (exact: every fp16 value, subnormals, inf and NaN included).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

#if TIERLM_ISA >= 256
// The sum of 8 fp32 lanes.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of 8 fp32 lanes.
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif

#if TIERLM_ISA == 512
struct Vec {
  using reg = __m512;
  static constexpr int lanes = 16;
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg set1(float v) { return _mm512_set1_ps(v); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline reg load(const int8_t* p) {  // 16 int8 -> 16 fp32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline reg load_half(const uint16_t* p) {  // 16 fp16 -> 16 fp32
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 16 packed bytes -> their low nibbles (lo) and high nibbles (hi) as fp32.
  static inline void nibbles(const uint8_t* p, reg& lo, reg& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  // 16 packed bytes -> the values their low (lo) and high (hi) nibbles index in `table` (16
  // floats): GGUF IQ4's non-linear codebook.
  static inline void looked_up(const uint8_t* p, const float* table, reg& lo, reg& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const reg t = _mm512_loadu_ps(table);
    lo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), t);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
  }
  // A 32-column chunk's 5-bit codes: 16 packed bytes of nibbles as `nibbles` reads them, plus
  // `high` (a little-endian uint32, bit i column i) times 16, for columns j.. (lo) and 16 + j..
  // (hi) as fp32. The bits are or-ed in as integers under a mask: one convert per register.
  static inline void fives(const uint8_t* p, const uint8_t* high, int j, reg& lo, reg& hi) {
    uint32_t word;
    std::memcpy(&word, high, 4);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    const __m512i l = _mm512_and_si512(b, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(b, 4);
    lo = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(l, static_cast<__mmask16>(word >> j), l, sixteen));
    hi = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(h, static_cast<__mmask16>(word >> (16 + j)), h, sixteen));
  }

  // Q6_K's codes minus 32 for columns j.. (lo) and 16 + j.. (hi) as fp32: nibbles at p and
  // the 2-bit high parts at q joined as integers (nibble + 16 crumb - 32), one convert per register.
  static inline void sixes(const uint8_t* p, const uint8_t* q, int, reg& lo, reg& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i three = _mm256_set1_epi32(3);
    auto join = [&](int a, int d) {
      const __m512i low = _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi32(c, a), three));
      return _mm512_slli_epi32(_mm512_inserti64x4(low, _mm256_and_si256(_mm256_srli_epi32(c, d), three), 1), 4);
    };
    const __m512i thirty_two = _mm512_set1_epi32(32);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(15)), join(0, 2)), thirty_two));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(b, 4), join(4, 6)), thirty_two));
  }
  // Q2_K/Q3_K's codes for columns j.. (lo) and 16 + j.. (hi) as fp32: 2-bit crumbs at q (the
  // layout `sixes` reads), with HIGH the bit of `high` (bit i column i) as 4, minus `bias`.
  template <bool HIGH>
  static inline void lowbits(const uint8_t* q, uint32_t high, int32_t bias, int, reg& lo, reg& hi) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i three = _mm256_set1_epi32(3);
    auto join = [&](int a, int d) {
      const __m512i low = _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi32(c, a), three));
      return _mm512_inserti64x4(low, _mm256_and_si256(_mm256_srli_epi32(c, d), three), 1);
    };
    __m512i l = join(0, 2), h = join(4, 6);
    if (HIGH) {
      const __m512i four = _mm512_set1_epi32(4);
      l = _mm512_mask_or_epi32(l, static_cast<__mmask16>(high), l, four);
      h = _mm512_mask_or_epi32(h, static_cast<__mmask16>(high >> 16), h, four);
    }
    const __m512i b = _mm512_set1_epi32(bias);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(l, b));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(h, b));
  }
  static inline void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float sum(reg v) { return _mm512_reduce_add_ps(v); }
};
#elif TIERLM_ISA == 256
struct Vec {
  using reg = __m256;
  static constexpr int lanes = 8;
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg set1(float v) { return _mm256_set1_ps(v); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline reg load(const int8_t* p) {  // 8 int8 -> 8 fp32 (vpmovsxbd reads 8 bytes)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline reg load_half(const uint16_t* p) {  // 8 fp16 -> 8 fp32
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float v[8];
    for (int i = 0; i < 8; ++i) v[i] = half_to_float(p[i]);
    return _mm256_load_ps(v);
#endif
  }
  // 8 packed bytes -> their low nibbles (lo) and high nibbles (hi) as fp32.
  static inline void nibbles(const uint8_t* p, reg& lo, reg& hi) {
    // vpmovzxbd from memory: measured faster on Zen 3 than a broadcast and an in-lane vpshufb.
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  // 8 packed bytes -> the values their nibbles index in `table` (16 floats): two 8-entry
  // permutes and a select on the index's high bit.
  static inline void looked_up(const uint8_t* p, const float* table, reg& lo, reg& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const reg t0 = _mm256_loadu_ps(table), t1 = _mm256_loadu_ps(table + 8);
    auto lookup = [&](__m256i idx) {
      const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx), upper);
    };
    lo = lookup(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = lookup(_mm256_srli_epi32(b, 4));
  }
  // A chunk's 5-bit codes (nibbles at p, `high` bit i column i, times 16) for columns j.. (lo)
  // and 16 + j.. (hi) as fp32, combined as integers: one convert per register.
  static inline void fives(const uint8_t* p, const uint8_t* high, int j, reg& lo, reg& hi) {
    uint32_t word;
    std::memcpy(&word, high, 4);
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i w = _mm256_set1_epi32(static_cast<int>(word)), one = _mm256_set1_epi32(1);
    const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j));
    auto sixteens = [&](__m256i at) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(w, at), one), 4); };
    lo = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(15)), sixteens(shifts)));
    hi = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(b, 4), sixteens(_mm256_add_epi32(shifts, _mm256_set1_epi32(16)))));
  }

  // Q6_K's codes minus 32 (nibbles at p, 2-bit high parts at q, joined as integers) for columns j..
  // (lo) and 16 + j.. (hi) as fp32, j 0 or 8.
  static inline void sixes(const uint8_t* p, const uint8_t* q, int j, reg& lo, reg& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i three = _mm256_set1_epi32(3), thirty_two = _mm256_set1_epi32(32);
    const int shift = j / 8 * 2;
    auto crumb = [&](int at) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(c, at), three), 4); };
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(15)), crumb(shift)), thirty_two));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(b, 4), crumb(shift + 4)), thirty_two));
  }
  // Q2_K/Q3_K's codes (crumbs at q, HIGH: `high`'s bit i as 4 for column i, minus `bias`) for
  // columns j.. (lo) and 16 + j.. (hi) as fp32, j 0 or 8.
  template <bool HIGH>
  static inline void lowbits(const uint8_t* q, uint32_t high, int32_t bias, int j, reg& lo, reg& hi) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i three = _mm256_set1_epi32(3);
    const int shift = j / 8 * 2;
    __m256i l = _mm256_and_si256(_mm256_srli_epi32(c, shift), three);
    __m256i h = _mm256_and_si256(_mm256_srli_epi32(c, shift + 4), three);
    if (HIGH) {
      const __m256i w = _mm256_set1_epi32(static_cast<int>(high)), one = _mm256_set1_epi32(1);
      const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j));
      auto fours = [&](__m256i by) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(w, by), one), 2); };
      l = _mm256_or_si256(l, fours(at));
      h = _mm256_or_si256(h, fours(_mm256_add_epi32(at, _mm256_set1_epi32(16))));
    }
    const __m256i b = _mm256_set1_epi32(bias);
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(l, b));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(h, b));
  }
  static inline void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float sum(reg v) { return sum8(v); }
};
#else
// 4 lanes: the width SSE4 and NEON registers hold (8 measured 2x slower on x86-64-v2).
struct Vec {
  typedef float reg __attribute__((vector_size(16)));
  typedef int8_t bytes __attribute__((vector_size(4)));
  typedef uint8_t ubytes __attribute__((vector_size(4)));
  typedef int32_t ints __attribute__((vector_size(16)));
  static constexpr int lanes = 4;
  static inline reg zero() { return reg{}; }
  static inline reg set1(float v) { return reg{} + v; }
  static inline reg load(const float* p) {
    reg r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  static inline reg load(const int8_t* p) {
#if defined(__SSE4_1__)  // pmovsxbd: GCC's generic widening is unpack+shift chains (2x slower)
    int32_t word;
    std::memcpy(&word, p, sizeof word);
    return reinterpret_cast<reg>(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word))));
#else  // widened to int32 first: one sign-extend, one convert
    bytes b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ints), reg);
#endif
  }
  // 4 fp16 -> 4 fp32 without branches (half_to_float's cases as lane selects): normal values
  // rebias the exponent, subnormals are mant * 2^-24 (exact, and no denormal is formed).
  static inline reg load_half(const uint16_t* p) {
    typedef uint16_t halves __attribute__((vector_size(8)));
    halves raw;
    std::memcpy(&raw, p, sizeof raw);
    const ints h = __builtin_convertvector(raw, ints);
    const ints exp = (h >> 10) & 0x1f, mant = h & 0x3ff, sign = (h & 0x8000) << 16;
    const ints normal = ((exp + 112) << 23) | (mant << 13);
    const ints special = 0x7f800000 | (mant << 13);  // inf, NaN
    const reg small = __builtin_convertvector(mant, reg) * 5.9604644775390625e-8f;
    ints bits = exp == 0x1f ? special : normal;
    bits = exp == 0 ? reinterpret_cast<ints>(small) : bits;
    return reinterpret_cast<reg>(bits | sign);
  }
  // 4 packed bytes -> their low nibbles (lo) and high nibbles (hi) as fp32.
  static inline void nibbles(const uint8_t* p, reg& lo, reg& hi) {
#if defined(__SSE4_1__)
    int32_t word;
    std::memcpy(&word, p, sizeof word);
    const ints b = reinterpret_cast<ints>(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(word)));
#else
    ubytes raw;
    std::memcpy(&raw, p, sizeof raw);
    const ints b = __builtin_convertvector(raw, ints);
#endif
    lo = __builtin_convertvector(b & 15, reg);
    hi = __builtin_convertvector(b >> 4, reg);
  }
  // 4 packed bytes -> the values their nibbles index in `table` (16 floats).
  static inline void looked_up(const uint8_t* p, const float* table, reg& lo, reg& hi) {
    for (int i = 0; i < 4; ++i) {
      lo[i] = table[p[i] & 15];
      hi[i] = table[p[i] >> 4];
    }
  }
  // A chunk's 5-bit codes (nibbles at p, `high` bit i column i, times 16) for columns j.. (lo)
  // and 16 + j.. (hi) as fp32, combined as integers before the convert.
  static inline void fives(const uint8_t* p, const uint8_t* high, int j, reg& lo, reg& hi) {
    uint32_t word;
    std::memcpy(&word, high, 4);
    ubytes raw;
    std::memcpy(&raw, p, sizeof raw);
    const ints b = __builtin_convertvector(raw, ints);
    const ints w = ints{} + static_cast<int32_t>(word >> j), lanes = {0, 1, 2, 3};
    lo = __builtin_convertvector((b & 15) | (((w >> lanes) & 1) << 4), reg);
    hi = __builtin_convertvector((b >> 4) | (((w >> (lanes + 16)) & 1) << 4), reg);
  }

  // Q6_K's codes minus 32 (nibbles at p, 2-bit high parts at q, joined as integers) for columns j..
  // (lo) and 16 + j.. (hi) as fp32, j a multiple of 4.
  static inline void sixes(const uint8_t* p, const uint8_t* q, int j, reg& lo, reg& hi) {
    ubytes nib, raw;
    std::memcpy(&nib, p, sizeof nib);
    std::memcpy(&raw, q + j % 8, sizeof raw);
    const ints b = __builtin_convertvector(nib, ints), c = __builtin_convertvector(raw, ints);
    const int shift = j / 8 * 2;
    lo = __builtin_convertvector(((b & 15) | (((c >> shift) & 3) << 4)) - 32, reg);
    hi = __builtin_convertvector(((b >> 4) | (((c >> (shift + 4)) & 3) << 4)) - 32, reg);
  }
  // Q2_K/Q3_K's codes (crumbs at q, HIGH: `high`'s bit i as 4 for column i, minus `bias`) for
  // columns j.. (lo) and 16 + j.. (hi) as fp32, j a multiple of 4.
  template <bool HIGH>
  static inline void lowbits(const uint8_t* q, uint32_t high, int32_t bias, int j, reg& lo, reg& hi) {
    ubytes raw;
    std::memcpy(&raw, q + j % 8, sizeof raw);
    const ints c = __builtin_convertvector(raw, ints);
    const int shift = j / 8 * 2;
    ints l = (c >> shift) & 3, h = (c >> (shift + 4)) & 3;
    if (HIGH) {
      const ints w = ints{} + static_cast<int32_t>(high >> j), lanes = {0, 1, 2, 3};
      l |= ((w >> lanes) & 1) << 2;
      h |= ((w >> (lanes + 16)) & 1) << 2;
    }
    lo = __builtin_convertvector(l - bias, reg);
    hi = __builtin_convertvector(h - bias, reg);
  }
  static inline void store(float* p, reg v) { std::memcpy(p, &v, sizeof v); }
  static inline reg fma(reg a, reg b, reg c) { return a * b + c; }
  static inline float sum(reg v) {
    float s = 0.0f;
    for (int i = 0; i < lanes; ++i) s += v[i];
    return s;
  }
};
#endif

// A stored value as fp32: fp32 as is, fp16 (uint16_t bits) widened; `Vec` lanes of them likewise.
inline float scale_value(float s) { return s; }
inline float scale_value(uint16_t s) { return half_to_float(s); }
inline Vec::reg load_values(const float* p) { return Vec::load(p); }
inline Vec::reg load_values(const uint16_t* p) { return Vec::load_half(p); }

// The dot product of n stored values (fp32, or fp16 bits) with n fp32 values, Vec::lanes at a time.
template <typename T>
inline float dot(const T* a, const float* b, int64_t n) {
  constexpr int L = Vec::lanes;
  Vec::reg acc = Vec::zero();
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = Vec::fma(load_values(a + i), Vec::load(b + i), acc);
  float s = Vec::sum(acc);
  for (; i < n; ++i) s += scale_value(a[i]) * b[i];
  return s;
}

// 16 int16 lanes in a 256-bit register on both x86 paths (gemv_a16.h's integer dot products):
// `dot` adds each pair of adjacent products to its int32 lane (vpdpwssd with AVX512-VNNI, else
// vpmaddwd + vpaddd), `fives` and `sixes` join GGUF's 5- and 6-bit codes, `scaled` adds the
// eight int32 sums times a scale to fp32 lanes. Absent (`available` false) on the portable path.
#if TIERLM_ISA >= 256
struct Ints16 {
  using reg = __m256i;
  static constexpr bool available = true;
  static inline reg zero() { return _mm256_setzero_si256(); }
  static inline reg splat(int16_t v) { return _mm256_set1_epi16(v); }
  static inline reg sub(reg a, reg b) { return _mm256_sub_epi16(a, b); }
  static inline reg load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline void store(int16_t* p, reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static inline reg widen(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline reg widen(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline reg low_nibbles(reg v) { return _mm256_and_si256(v, _mm256_set1_epi16(15)); }
  static inline reg high_nibbles(reg v) { return _mm256_srli_epi16(v, 4); }
  static inline reg dot(reg acc, reg a, reg b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  // A 32-column chunk's 5-bit codes (GGUF Q5_0/Q5_1/Q5_K: 16 bytes of nibbles at p as int4's,
  // then a little-endian uint32, bit i column i, worth 16): columns 0..15 (lo) and 16..31 (hi).
  // Joined in int16 lanes: joining as bytes (as `sixes` does) measured slower on Zen 3, whose
  // shuffles it doubles.
  static inline void fives(const uint8_t* p, reg& lo, reg& hi) {
    const reg v = widen(p);
    uint32_t bits;
    std::memcpy(&bits, p + 16, 4);
    lo = with_sixteen(low_nibbles(v), bits & 0xffffu);
    hi = with_sixteen(high_nibbles(v), bits >> 16);
  }
  // v plus 16 in the lanes whose bit of `bits` is set (v < 16 there: the same as or-ing it in).
  static inline reg with_sixteen(reg v, uint32_t bits) {
#if TIERLM_ISA == 512
    return _mm256_mask_add_epi16(v, static_cast<__mmask16>(bits), v, _mm256_set1_epi16(16));
#else
    const __m256i lane_bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                static_cast<int16_t>(-32768));
    const __m256i set = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lane_bits);
    return _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi16(set, lane_bits), _mm256_set1_epi16(16)));
#endif
  }
  // A 32-column chunk of nibbles (int4's packing: byte k holds columns k and 16 + k) as the int8
  // values they index in `table` (16 entries: GGUF IQ4's codebook), looked up as bytes.
  static inline void codebook(const uint8_t* p, const int8_t* table, reg& lo, reg& hi) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table)), low = _mm_set1_epi8(15);
    lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(v, low)));
    hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), low)));
  }
  // Q6_K's codes minus 32 for a 32-column chunk (simd.h's `Vec::sixes` layout: 16 bytes of
  // nibbles at p, 8 bytes of 2-bit high parts at q, byte i holding columns i, 8 + i, 16 + i
  // and 24 + i from its lowest bits): columns 0..15 (lo) and 16..31 (hi).
  static inline void sixes(const uint8_t* p, const uint8_t* q, reg& lo, reg& hi) {
    // Joined as bytes, 32 columns a register, then widened: half the instructions of joining
    // in int16 lanes. Column c's nibble goes to byte c; its crumb is bits 2 (c / 8) of byte c % 8,
    // so each 64-bit quarter of the broadcast high parts is shifted by its own amount.
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    int64_t parts;
    std::memcpy(&parts, q, 8);
    const __m256i crumbs = _mm256_srlv_epi64(_mm256_set1_epi64x(parts), _mm256_setr_epi64x(0, 2, 4, 6));
    const __m256i high = _mm256_and_si256(_mm256_slli_epi16(crumbs, 4), _mm256_set1_epi8(0x30));
    const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(nibbles, high), _mm256_set1_epi8(32));
    lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes));
    hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1));
  }
  static inline __m256 scaled(reg sums, float scale, __m256 total) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), total);
  }
  static inline float sum(__m256 v) { return sum8(v); }
};
#else
struct Ints16 {
  static constexpr bool available = false;
};
#endif

}  // namespace tl
