// Decode rows for GGUF's K-quants Q4_K, Q5_K and Q6_K multiplied as llama.cpp multiplies them:
// activations as int8 per 256 columns, the weight's codes as bytes, products summed by
// vpmaddubsw and scaled by the integer sub-scales with vpmaddwd, all in int32 across a
// super-block, then one or two float scales.
//
// Why not the int16 rows (gemv_a16.h): a Q6_K group of 32 there costs ~26 instructions (codes
// widened to int16, two dot products and two fp32 scalings per 32 columns) against ~12 here; it
// ran at 0.56x llama.cpp's Q6_K (AVX2 Zen 3, one thread), Q5_K at 0.74x, Q4_K at 1.0x, and these
// are a Q4_K_M or Q5_K_M file's bytes. Here Q6_K runs at 1.1-1.2x llama.cpp, Q4_K at 1.5x. The
// price is llama.cpp's rounding of x: each value within (largest |x| of its 256 columns) / 254
// of itself, where the int16 rows' 32-column groups keep it within 1.5e-5 of their largest.
//
// Column order: a pair of 32-column groups (A, B) unpacks as two registers, [A 0..15, B 0..15]
// and [A 16..31, B 16..31] (the nibbles of both groups loaded at once), so the activations are
// stored in that order (`quantize_blocks8`), each 64 columns' middle quarters swapped.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "weight.h"

namespace tl {

// x [M, K] (K a multiple of 256) as int8 codes per 256 columns: x ~ code * scale.
struct Blocks8 {
  std::vector<int8_t> codes;  // [M, K], each 64 columns in the order the rows unpack (above)
  std::vector<float> scales;  // [M, K / 256]
  std::vector<int16_t> sums;  // [M, K / 16]: each 16 columns' codes summed, in column order
};

#if TIERLM_ISA >= 256

// Where 16-column chunk j of a super-block goes in the unpacking order: within each 64 columns
// the second and third chunks trade places.
constexpr int64_t unpacked_chunk(int64_t j) { return (j & ~3) | ((j & 1) << 1) | ((j & 2) >> 1); }

// One row of K columns quantized per 256 into `codes`, `scales` and `sums` (layout above); false
// when x holds NaN or inf, or a block so small that 127 / its largest magnitude would overflow.
inline bool quantize_blocks8(const float* x, int64_t K, int8_t* codes, float* scales, int16_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kSuperColumns; ++b) {
    const float* v = x + b * kSuperColumns;
    __m256 big = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) {
      const __m256 value = _mm256_loadu_ps(v + 8 * i);
      big = _mm256_max_ps(big, _mm256_andnot_ps(sign, value));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    }
    const float largest = max8(big);
    if (_mm256_movemask_ps(nan) || largest > FLT_MAX || (largest > 0.0f && largest < FLT_MIN * 127.0f)) return false;
    scales[b] = largest / 127.0f;
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    for (int64_t j = 0; j < 16; ++j) {
      const float* chunk = v + 16 * j;
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(chunk), inverse));
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(chunk + 8), inverse));
      // packs interleaves 128-bit halves (a0 c0 a1 c1); the permute puts them back in order.
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
      const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kSuperColumns + 16 * unpacked_chunk(j)), bytes);
      const __m256i pairs = _mm256_madd_epi16(words, _mm256_set1_epi16(1));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      sums[b * 16 + j] = static_cast<int16_t>(_mm_cvtsi128_si32(s));
    }
  }
  return true;
}

// A register of 16 int16 lanes: lanes 0..7 sub-scale i, lanes 8..15 sub-scale j (of 16 bytes).
template <int i, int j>
inline __m256i two_scales(__m128i subs) {
  const __m128i pick = _mm_set_epi64x(static_cast<int64_t>(0x0101010101010101ull * j),
                                      static_cast<int64_t>(0x0101010101010101ull * i));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(subs, pick));
}

// A pair of Q6_K groups (64 columns: nibbles at v, 32 bytes; high parts at c, 16 bytes) as
// unsigned 6-bit codes in the unpacking order: lo [A 0..15, B 0..15], hi [A 16..31, B 16..31].
inline void six_bit_pair(const uint8_t* v, const uint8_t* c, __m256i& lo, __m256i& hi) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
  // Each group's 8 bytes of high parts twice, [A A B B]: byte i holds columns i, 8 + i, 16 + i
  // and 24 + i from its lowest bits, so each 64-bit quarter shifts its crumb to bits 4..5.
  const __m256i parts = _mm256_permute4x64_epi64(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), 0x50);
  const __m256i low = _mm256_sllv_epi64(parts, _mm256_setr_epi64x(4, 2, 4, 2));
  const __m256i high = _mm256_srlv_epi64(parts, _mm256_setr_epi64x(0, 2, 0, 2));
  lo = _mm256_or_si256(_mm256_and_si256(nibbles, low4), _mm256_and_si256(low, bits45));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4), _mm256_and_si256(high, bits45));
}

// y[m * ldy + n - n0] (+)= sum_b d(n, b) a.scales[m][b] (sum_j sc(n, b, j) (codes - 32) . a.codes
// over 16-column chunk j): every sum exact in int32 (at most 3.4e7 a lane), one rounding a
// super-block.
template <int MB>
inline void q6k_a8_rows(const Weight& W, const Blocks8& a, int64_t n0, int64_t n1, float* y, int64_t ldy,
                        bool accumulate) {
  const int64_t K = W.cols, B = K / kSuperColumns;
  const uint8_t* nibbles = static_cast<const uint8_t*>(W.data);
  const uint8_t* parts = static_cast<const uint8_t*>(W.offsets);
  const uint8_t* super = static_cast<const uint8_t*>(W.scales);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 total[MB];
    for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* p = super + (n * B + b) * 18;
      const __m128i subs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2));
      const uint8_t* v = nibbles + n * (K / 2) + b * 128;
      const uint8_t* c = parts + n * (K / 4) + b * 64;
      __m256i acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
      auto pair = [&](auto index, __m256i lo_scales, __m256i hi_scales) __attribute__((always_inline)) {
        constexpr int q = decltype(index)::value;
        __m256i lo, hi;
        six_bit_pair(v + 32 * q, c + 16 * q, lo, hi);
        for (int m = 0; m < MB; ++m) {
          const int8_t* x = a.codes.data() + m * K + b * kSuperColumns + 64 * q;
          const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
          const __m256i sl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), lo_scales);
          const __m256i sh = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), hi_scales);
          acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(sl, sh));
        }
      };
      pair(std::integral_constant<int, 0>{}, two_scales<0, 2>(subs), two_scales<1, 3>(subs));
      pair(std::integral_constant<int, 1>{}, two_scales<4, 6>(subs), two_scales<5, 7>(subs));
      pair(std::integral_constant<int, 2>{}, two_scales<8, 10>(subs), two_scales<9, 11>(subs));
      pair(std::integral_constant<int, 3>{}, two_scales<12, 14>(subs), two_scales<13, 15>(subs));
      uint16_t d;
      std::memcpy(&d, p, 2);
      const __m256i subs16 = _mm256_cvtepi8_epi16(subs);
      for (int m = 0; m < MB; ++m) {  // the codes' -32: 32 sum_j sc[j] (x's codes summed over j)
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums.data() + (m * B + b) * 16));
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sums, subs16), 5);
        const float scale = half_to_float(d) * a.scales[m * B + b];
        total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m], offset)), _mm256_set1_ps(scale), total[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      float value = sum8(total[m]);
      if (W.bias) value += W.bias[n];
      float& dst = y[m * ldy + (n - n0)];
      dst = accumulate ? dst + value : value;
    }
  }
}

// The 32 bits of `bits` as 32 bytes: byte i is 16 where bit i is set, else 0.
inline __m256i sixteens(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// y[m * ldy + n - n0] (+)= sum_b a.scales[m][b] (d(n, b) sum_j sc(n, b, j) codes . a.codes - dmin(n, b)
// sum_j m(n, b, j) sum(a.codes over j)) over 32-column groups j: Q4_K and Q5_K (u (d sc[j]) -
// dmin m[j]), their super-blocks kInt4K's. PAIR(n, b, q, lo, hi) yields row n's groups 2q and
// 2q + 1 of super-block b as unsigned codes in the unpacking order. Sums exact in int32 (at most
// 8e6 a lane), two roundings a super-block.
template <int MB, typename Pair>
inline void k_a8_rows(const Weight& W, const Blocks8& a, int64_t n0, int64_t n1, float* y, int64_t ldy,
                      bool accumulate, Pair pair_codes) {
  const int64_t K = W.cols, B = K / kSuperColumns;
  const uint8_t* super = static_cast<const uint8_t*>(W.scales);
  // Each sub-min twice, beside the two 16-column sums of its group.
  const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 total[MB];
    for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* p = super + (n * B + b) * kSuperBytes;
      const __m128i subs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 4));
      __m256i acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
      auto pair = [&](auto index, __m256i scales) __attribute__((always_inline)) {
        constexpr int q = decltype(index)::value;
        __m256i lo, hi;
        pair_codes(n, b, q, lo, hi);
        for (int m = 0; m < MB; ++m) {
          const int8_t* x = a.codes.data() + m * K + b * kSuperColumns + 64 * q;
          const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
          // Each int16 pair sum is at most 2 * 31 * 127: two of them still fit before the scale.
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs, scales));
        }
      };
      pair(std::integral_constant<int, 0>{}, two_scales<0, 1>(subs));
      pair(std::integral_constant<int, 1>{}, two_scales<2, 3>(subs));
      pair(std::integral_constant<int, 2>{}, two_scales<4, 5>(subs));
      pair(std::integral_constant<int, 3>{}, two_scales<6, 7>(subs));
      uint16_t d, dmin;
      std::memcpy(&d, p, 2);
      std::memcpy(&dmin, p + 2, 2);
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 12)), twice));
      for (int m = 0; m < MB; ++m) {
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums.data() + (m * B + b) * 16));
        const float scale = a.scales[m * B + b];
        total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(half_to_float(d) * scale), total[m]);
        total[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, mins)),
                                    _mm256_set1_ps(half_to_float(dmin) * scale), total[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      float value = sum8(total[m]);
      if (W.bias) value += W.bias[n];
      float& dst = y[m * ldy + (n - n0)];
      dst = accumulate ? dst + value : value;
    }
  }
}

// Q4_K: its nibbles packed as int4.py packs them (16 bytes a group), so a pair loads as 32 bytes.
template <int MB>
inline void q4k_a8_rows(const Weight& W, const Blocks8& a, int64_t n0, int64_t n1, float* y, int64_t ldy,
                        bool accumulate) {
  const uint8_t* nibbles = static_cast<const uint8_t*>(W.data);
  const int64_t K = W.cols;
  k_a8_rows<MB>(W, a, n0, n1, y, ldy, accumulate,
                [nibbles, K](int64_t n, int64_t b, int q, __m256i& lo, __m256i& hi) __attribute__((always_inline)) {
                  const __m256i low4 = _mm256_set1_epi8(15);
                  const __m256i packed = _mm256_loadu_si256(
                      reinterpret_cast<const __m256i*>(nibbles + n * (K / 2) + b * 128 + 32 * q));
                  lo = _mm256_and_si256(packed, low4);
                  hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                });
}

// Q5_K: 20 bytes a group (kInt5's chunks: 16 bytes of nibbles, then a uint32 of fifth bits, bit i
// column i), the fifth bits of a pair regrouped as the unpacking order wants them.
template <int MB>
inline void q5k_a8_rows(const Weight& W, const Blocks8& a, int64_t n0, int64_t n1, float* y, int64_t ldy,
                        bool accumulate) {
  const uint8_t* chunks = static_cast<const uint8_t*>(W.data);
  const int64_t G = W.cols / 32;
  k_a8_rows<MB>(W, a, n0, n1, y, ldy, accumulate,
                [chunks, G](int64_t n, int64_t b, int q, __m256i& lo, __m256i& hi) __attribute__((always_inline)) {
                  const __m256i low4 = _mm256_set1_epi8(15);
                  const uint8_t* c = chunks + (n * G + b * 8 + 2 * q) * 20;
                  const __m256i packed = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(c + 20),
                                                             reinterpret_cast<const __m128i*>(c));
                  uint32_t first, second;
                  std::memcpy(&first, c + 16, 4);
                  std::memcpy(&second, c + 36, 4);
                  lo = _mm256_or_si256(_mm256_and_si256(packed, low4), sixteens((first & 0xffffu) | (second << 16)));
                  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),
                                       sixteens((first >> 16) | (second & 0xffff0000u)));
                });
}

#endif

// x [M, K] quantized per 256 columns for the rows above; false (Blocks8 unusable) as quantize_blocks8.
inline bool quantize8(const float* x, int64_t ldx, int64_t M, int64_t K, Blocks8& a) {
#if TIERLM_ISA >= 256
  const int64_t B = K / kSuperColumns;
  a.codes.resize(M * K);
  a.scales.resize(M * B);
  a.sums.resize(M * B * 16);
  for (int64_t m = 0; m < M; ++m)
    if (!quantize_blocks8(x + m * ldx, K, a.codes.data() + m * K, a.scales.data() + m * B, a.sums.data() + m * B * 16))
      return false;
  return true;
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)a;
  return false;
#endif
}

}  // namespace tl
