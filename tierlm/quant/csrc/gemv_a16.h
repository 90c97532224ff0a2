// Decode GEMVs multiplied in integers: activations as int16, weights' codes as they are stored.
//
// The activation rows are quantized once per call to int16 per 32 columns (scale = the group's
// largest magnitude / 32767: each value within 1.5e-5 of that magnitude, where llama.cpp's 8-bit
// blocks lose 4e-3), and each weight row's codes are widened to int16 and multiplied by them
// with pairwise int32 dot products (vpdpwssd, or vpmaddwd + vpaddd): 16 products an
// instruction, where the fp32 tiles convert every code to float first. Each group's int32 sums
// are scaled once, by the weight's scale times the activations', so the result differs from the
// fp32 tiles only by the activations' rounding. A row is read front to back before the next:
// memory order, which the hardware prefetcher streams (the tiles' 8 interleaved rows measured
// 1.4x slower from DRAM for q5_0). Kinds: kInt8 in groups of 32 (GGUF Q8_0, int8-g32), kInt5
// (Q5_0, Q5_1), and on AVX2 kInt4 in groups of 32 (Q4_0, Q4_1) and kIQ4/kIQ4X (has_a16_path);
// the K-quants kInt4K, kInt5K and kInt6K (Q4_K, Q5_K, Q6_K) take x as int8 per 256 columns
// instead (gemv_a8.h); the others, non-finite activations and the portable build keep the fp32
// tiles.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_a8.h"
#include "simd.h"
#include "weight.h"

namespace tl {

// x [M, K] as int16 codes [M, K] and fp32 scales [M, K / 32]: x ~ code * scale per 32 columns.
// The K-quants' rows take x as int8 per 256 columns instead (gemv_a8.h: `blocks8`, codes empty).
struct Activations16 {
  std::vector<int16_t> codes;
  std::vector<float> scales;
  Blocks8 blocks8;
  // More than kA16MaxRows rows: each kA16MaxRows of them quantized as their own (codes etc. empty).
  std::vector<Activations16> parts;
  int64_t cols = 0;
  bool usable = false;  // false: the fp32 tiles run instead
};

// Activation rows the integer kernels multiply at once (their accumulators fill the registers).
constexpr int64_t kA16MaxRows = 4;
// Activation rows up to which a caller may ask for the integer path (quantize16's `max_rows`),
// kA16MaxRows at a time over each tile of kA16TileRows weight rows (read from DRAM once, then from
// L1/L2): the fused step asks for it for decode batches and speculative verification passes (9
// rows cost 3x a step here, 4x in the fp32 tiles), where each row's result is the one it gets
// alone, so a verified position's logits are a decode step's. Other callers keep kA16MaxRows: a
// prompt's rows keep the fp32 tiles (and their fp32-exact logits), whose widened weights serve every row.
constexpr int64_t kA16PartRows = 16;
constexpr int64_t kA16TileRows = 16;

// Whether W's kind has an integer path in this build.
inline bool has_a16_path(const Weight& W) {
  if (!Ints16::available || W.cols % 32 != 0) return false;
  if (W.kind == kInt8) return W.group == 32;
#if TIERLM_ISA == 256
  // AVX2 widens nibbles to fp32 a register at a time (AVX-512 a cheap 16-lane convert): the
  // fp32 tiles ran int4 and IQ4 at 13 and 6-7 GB/s here (Zen 3, 2 threads), where these rows
  // run int4 at ~2x. On AVX-512 the tiles measured faster for the embedded Q4_1 model.
  if (W.kind == kInt4 || W.kind == kIQ4) return W.group == 32;
  if (W.kind == kIQ4X) return true;
#endif
  // Q4_K's and Q5_K's tiles expand every super-block's scales per call: on a 1B-shaped Q4_K_M
  // they ran at a third of llama.cpp.
  return W.kind == kInt5 || W.kind == kInt6K || W.kind == kInt4K || W.kind == kInt5K;
}

#if TIERLM_ISA >= 256

// One group of 32 values as int16 codes and the scale they share; false when the group holds
// NaN or inf, or is so small that 32767 / its largest magnitude would overflow.
inline bool quantize_group16(const float* x, int16_t* codes, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], big = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    big = _mm256_max_ps(big, _mm256_andnot_ps(sign, v[i]));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  const float largest = max8(big);
  if (_mm256_movemask_ps(nan) || largest > FLT_MAX || (largest > 0.0f && largest < FLT_MIN * 32767.0f)) return false;
  *scale = largest / 32767.0f;
  const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
  for (int half = 0; half < 2; ++half) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * half], inverse));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * half + 1], inverse));
    // packs interleaves 128-bit halves (a0 b0 a1 b1); the permute puts them back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16 * half), packed);
  }
  return true;
}

// Weight rows [n0, n1) times the MB activation rows, finished: y[m * ldy + n - n0] is set to,
// or added, sum_g s(n, g) * a.scales[m][g] * (codes . a.codes over 32-column group g), plus
// sum_h o(n, h) * xs[m][h] over W's groups h where the kind keeps offsets apart (OFFSETS), plus
// the bias. CODES(n, g, lo, hi) yields row n's group g as int16 codes (columns 0..15, 16..31);
// SCALES(n, g0, g1, out) writes s(n, g) for g in [g0, g1) to out[g - g0]; OFFSETS_DOT(n, sums)
// is sum_h o(n, h) * sums[h].
template <int MB, bool OFFSETS, typename Codes, typename Scales, typename Offset>
inline void a16_rows(const Weight& W, const Activations16& a, const float* xs, int64_t n0, int64_t n1, float* y,
                     int64_t ldy, bool accumulate, Codes codes, Scales scales, Offset offset) {
  using I = Ints16;
  const int64_t K = W.cols, G = K / 32, H = W.groups();
  constexpr int64_t SPAN = 64;  // groups whose combined scales are formed together, on the stack
  alignas(32) float weight_scales[SPAN], combined[MB][SPAN];
  for (int64_t n = n0; n < n1; ++n) {
    // Two accumulators per activation row (even and odd groups): the FMA chain of one would
    // bound a row to one group per FMA latency.
    __m256 total[MB], other[MB];
    for (int m = 0; m < MB; ++m) total[m] = other[m] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < G; g0 += SPAN) {
      const int64_t g1 = std::min(G, g0 + SPAN);
      scales(n, g0, g1, weight_scales);
      for (int m = 0; m < MB; ++m) {  // the weight's scales times the activations', 8 a step
        const float* ax = a.scales.data() + m * G + g0;
        int64_t i = 0;
        for (; i + 8 <= g1 - g0; i += 8)
          _mm256_store_ps(combined[m] + i, _mm256_mul_ps(_mm256_load_ps(weight_scales + i), _mm256_loadu_ps(ax + i)));
        for (; i < g1 - g0; ++i) combined[m][i] = weight_scales[i] * ax[i];
      }
      auto group = [&](int64_t g, __m256* acc) __attribute__((always_inline)) {
        I::reg lo, hi;
        codes(n, g, lo, hi);
        for (int m = 0; m < MB; ++m) {
          const int16_t* x = a.codes.data() + m * K + g * 32;
          const I::reg sums = I::dot(I::dot(I::zero(), lo, I::load(x)), hi, I::load(x + 16));
          acc[m] = I::scaled(sums, combined[m][g - g0], acc[m]);
        }
      };
      int64_t g = g0;
      for (; g + 2 <= g1; g += 2) {
        group(g, total);
        group(g + 1, other);
      }
      if (g < g1) group(g, total);
    }
    for (int m = 0; m < MB; ++m) {
      float v = I::sum(_mm256_add_ps(total[m], other[m]));
      if constexpr (OFFSETS) v += offset(n, xs + m * H);
      if (W.bias) v += W.bias[n];
      float& dst = y[m * ldy + (n - n0)];
      dst = accumulate ? dst + v : v;
    }
  }
}

// Runs a16_rows with OFFSETS as W has them.
template <int MB, typename Codes, typename Scales, typename Offset>
inline void a16_rows_offsets(bool offsets, const Weight& W, const Activations16& a, const float* xs, int64_t n0,
                             int64_t n1, float* y, int64_t ldy, bool accumulate, Codes codes, Scales scales,
                             Offset offset) {
  if (offsets) a16_rows<MB, true>(W, a, xs, n0, n1, y, ldy, accumulate, codes, scales, offset);
  else a16_rows<MB, false>(W, a, xs, n0, n1, y, ldy, accumulate, codes, scales, offset);
}

// Scales stored one per group of 32 columns (fp16 or fp32) as s(n, g), 8 widened at a time.
template <typename ST>
inline auto group_scales(const Weight& W) {
  const ST* s = static_cast<const ST*>(W.scales);
  const int64_t G = W.groups();
  return [s, G](int64_t n, int64_t g0, int64_t g1, float* out) __attribute__((always_inline)) {
    const ST* row = s + n * G;
    int64_t g = g0;
    for (; g + 8 <= g1; g += 8) {
      if constexpr (sizeof(ST) == 2) _mm256_store_ps(out + (g - g0), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g))));
      else _mm256_store_ps(out + (g - g0), _mm256_loadu_ps(reinterpret_cast<const float*>(row) + g));
    }
    for (; g < g1; ++g) out[g - g0] = scale_value(row[g]);
  };
}

template <int MB>
inline void a16_rows(const Weight& W, const Activations16& a, const float* xs, int64_t n0, int64_t n1,
                     float* y, int64_t ldy, bool accumulate) {
  using I = Ints16;
  const int64_t K = W.cols, G = K / 32;
  auto none = [](int64_t, const float*) { return 0.0f; };
  const uint8_t* bytes = static_cast<const uint8_t*>(W.data);
  // int4.py's packing (int4): byte k of a group holds columns k (low nibble) and 16 + k.
  auto nibbles = [bytes, K](int64_t n, int64_t g, I::reg& lo, I::reg& hi) __attribute__((always_inline)) {
    const I::reg v = I::widen(bytes + n * (K / 2) + g * 16);
    lo = I::low_nibbles(v);
    hi = I::high_nibbles(v);
  };
  // 5-bit chunks (Q5_0, Q5_1, Q5_K): per 32 columns 16 bytes of nibbles, then the fifth bits.
  auto fives = [bytes, G](int64_t n, int64_t g, I::reg& lo, I::reg& hi) __attribute__((always_inline)) {
    I::fives(bytes + (n * G + g) * 20, lo, hi);
  };
  if (W.kind == kInt8) {
    const int8_t* w = static_cast<const int8_t*>(W.data);
    auto codes = [&](int64_t n, int64_t g, I::reg& lo, I::reg& hi) __attribute__((always_inline)) {
      lo = I::widen(w + n * K + g * 32);
      hi = I::widen(w + n * K + g * 32 + 16);
    };
    const float* o = static_cast<const float*>(W.offsets);
    auto offset = [&](int64_t n, const float* sums) { return dot(o + n * G, sums, G); };
    if (W.half) a16_rows<MB, false>(W, a, xs, n0, n1, y, ldy, accumulate, codes, group_scales<uint16_t>(W), none);
    else a16_rows_offsets<MB>(o, W, a, xs, n0, n1, y, ldy, accumulate, codes, group_scales<float>(W), offset);
  } else if (W.kind == kInt5) {
    // Q5_1 is u s + o; Q5_0's (u - 16) s is u s plus the offsets -16 s, added from x's group
    // sums as Q5_1's are (two subtractions a group fewer on a path the unpacking bounds).
    const uint16_t* o = static_cast<const uint16_t*>(W.offsets);
    const uint16_t* s = static_cast<const uint16_t*>(W.scales);
    auto offset = [&](int64_t n, const float* sums) {
      return o ? dot(o + n * G, sums, G) : -16.0f * dot(s + n * G, sums, G);
    };
    a16_rows<MB, true>(W, a, xs, n0, n1, y, ldy, accumulate, fives, group_scales<uint16_t>(W), offset);
  } else if (W.kind == kInt6K) {
    q6k_a8_rows<MB>(W, a.blocks8, n0, n1, y, ldy, accumulate);
  } else if (W.kind == kInt4K) {
    q4k_a8_rows<MB>(W, a.blocks8, n0, n1, y, ldy, accumulate);
  } else if (W.kind == kInt5K) {
    q5k_a8_rows<MB>(W, a.blocks8, n0, n1, y, ldy, accumulate);
  } else if (W.kind == kInt4) {  // u s + o or (u - 8) s per 32 columns
    const uint16_t* o = static_cast<const uint16_t*>(W.offsets);
    const uint16_t* s = static_cast<const uint16_t*>(W.scales);
    auto offset = [&](int64_t n, const float* sums) {  // symmetric: -8 s, added as Q5_0's -16 s is
      return o ? dot(o + n * G, sums, G) : -8.0f * dot(s + n * G, sums, G);
    };
    a16_rows<MB, true>(W, a, xs, n0, n1, y, ldy, accumulate, nibbles, group_scales<uint16_t>(W), offset);
  } else if (W.kind == kIQ4 || W.kind == kIQ4X) {  // nibbles indexing the codebook, times s
    auto codes = [bytes, K](int64_t n, int64_t g, I::reg& lo, I::reg& hi) __attribute__((always_inline)) {
      I::codebook(bytes + n * (K / 2) + g * 16, kIQ4Codes, lo, hi);
    };
    const uint8_t* super = static_cast<const uint8_t*>(W.scales);
    const int64_t B = K / kSuperColumns;
    // IQ4_XS: per 256 columns fp16 d, then 8 int8 sub-scales: s(n, g) = d sub[g % 8] (exact).
    auto sub_scales = [super, B](int64_t n, int64_t g0, int64_t g1, float* out) __attribute__((always_inline)) {
      for (int64_t b = g0 / 8; b < g1 / 8; ++b) {
        const uint8_t* p = super + (n * B + b) * 10;
        uint16_t d;
        std::memcpy(&d, p, 2);
        const __m256 subs = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2))));
        _mm256_store_ps(out + (b * 8 - g0), _mm256_mul_ps(subs, _mm256_set1_ps(half_to_float(d))));
      }
    };
    if (W.kind == kIQ4) a16_rows<MB, false>(W, a, xs, n0, n1, y, ldy, accumulate, codes, group_scales<uint16_t>(W), none);
    else a16_rows<MB, false>(W, a, xs, n0, n1, y, ldy, accumulate, codes, sub_scales, none);
  }
}

#endif

// y[m * ldy + n - n0] (+)= (x[m] @ W.T)[n] for rows [n0, n1) of a kind has_a16_path accepts,
// x quantized by quantize16 (xs: x summed per group, read only where W keeps offsets apart).
inline void gemv_a16(const Weight& W, const Activations16& a, const float* xs, int64_t M, int64_t n0, int64_t n1,
                     float* y, int64_t ldy, bool accumulate) {
#if TIERLM_ISA >= 256
  if (!a.parts.empty()) {  // kA16MaxRows rows at a time over each tile of weight rows
    const int64_t H = W.groups();
    for (int64_t t0 = n0; t0 < n1; t0 += kA16TileRows) {
      const int64_t t1 = std::min(n1, t0 + kA16TileRows);
      for (size_t p = 0; p < a.parts.size(); ++p) {
        const int64_t m0 = static_cast<int64_t>(p) * kA16MaxRows, rows = std::min(kA16MaxRows, M - m0);
        gemv_a16(W, a.parts[p], xs ? xs + m0 * H : nullptr, rows, t0, t1, y + m0 * ldy + (t0 - n0), ldy, accumulate);
      }
    }
    return;
  }
  switch (M) {  // M <= kA16MaxRows (quantize16)
    case 1: return a16_rows<1>(W, a, xs, n0, n1, y, ldy, accumulate);
    case 2: return a16_rows<2>(W, a, xs, n0, n1, y, ldy, accumulate);
    case 3: return a16_rows<3>(W, a, xs, n0, n1, y, ldy, accumulate);
    default: return a16_rows<4>(W, a, xs, n0, n1, y, ldy, accumulate);
  }
#else
  (void)W, (void)a, (void)xs, (void)M, (void)n0, (void)n1, (void)y, (void)ldy, (void)accumulate;
#endif
}

// x [M, K] quantized for W's integer path: unusable when W has none here, M > max_rows (at most
// kA16PartRows), or x holds a value the int16 codes cannot carry (NaN, inf), which the fp32 tiles
// carry to the outputs.
inline Activations16 quantize16(const Weight& W, const float* x, int64_t ldx, int64_t M,
                                int64_t max_rows = kA16MaxRows) {
  Activations16 a;
#if TIERLM_ISA >= 256
  if (!has_a16_path(W) || M > std::min(max_rows, kA16PartRows)) return a;
  if (M > kA16MaxRows) {
    for (int64_t m0 = 0; m0 < M; m0 += kA16MaxRows) {
      a.parts.push_back(quantize16(W, x + m0 * ldx, ldx, std::min(kA16MaxRows, M - m0)));
      if (!a.parts.back().usable) return Activations16{};
    }
    a.cols = W.cols;
    a.usable = true;
    return a;
  }
  const int64_t K = W.cols, G = K / 32;
  a.cols = K;
  if (W.kind == kInt6K || W.kind == kInt4K || W.kind == kInt5K) {
    a.usable = quantize8(x, ldx, M, K, a.blocks8);
    return a;
  }
  a.codes.resize(M * K);
  a.scales.resize(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g)
      if (!quantize_group16(x + m * ldx + g * 32, a.codes.data() + m * K + g * 32, a.scales.data() + m * G + g))
        return Activations16{};
  a.usable = true;
#else
  (void)W, (void)x, (void)ldx, (void)M, (void)max_rows;
#endif
  return a;
}

}  // namespace tl
