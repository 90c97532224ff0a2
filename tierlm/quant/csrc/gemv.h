// W8A16, W4A16 (and fp32) matrix-vector products for few activation rows, written once over `Vec`.
//
// A tile is R weight rows x MB activation rows: each step widens R x lanes weights to fp32 and
// FMAs them with MB activation rows, so each weight byte is read from memory once per call.
// Grouped int8 keeps each group's partial dot in its own accumulator and scales it once per
// group (one FMA per row per group) instead of multiplying every widened weight by its scale;
// per channel the scale multiplies the finished sum. Each cache line of a row also prefetches
// the same line of the next tile's rows, which keeps enough misses in flight per core.
//
// Int4 (tierlm/quant/int4.py's packing) runs the same tiles on nibbles: a 32-column chunk is
// 16 bytes whose low nibbles are columns 0..15 and high nibbles 16..31, so `Vec::nibbles`
// yields both halves from one load with an and and a shift. Each group's dot with the
// unsigned nibbles u is scaled once by its fp16 scale s; the offset o (-8 s when symmetric)
// adds o * (x summed over the group), one dot over the groups per output: W = u * s + o.
//
// Decode-sized calls (up to four activation rows) of int8 in groups of 32 (Q8_0), of Q5_0/Q5_1,
// the K-quants Q4_K/Q5_K/Q6_K (gemv_a8.h) and on AVX2 of int4 and IQ4 multiply in integers
// instead (gemv_a16.h); everything else runs the tiles below: Q2_K/Q3_K like Q6_K (tile16), 2-bit
// crumbs (and Q3_K's high bits) widened per group of 16.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv_a16.h"
#include "pool.h"
#include "simd.h"
#include "weight.h"

#ifndef TL_PREFETCH
#define TL_PREFETCH 1
#endif

namespace tl {

// out[m][r] = sum_k x[m * ldx + k] * w[r * K + k] * s[r * G + k / group] (s null: unscaled).
// GS > 0: groups of exactly GS columns (K a multiple of GS), stepped with a compile-time count.
template <int R, int MB, bool GROUPED, int GS, typename WT, typename ST = float>
inline void tile(const float* x, int64_t ldx, const WT* w, int64_t K, const ST* s, int64_t G,
                 int64_t group, float (&out)[MB][R]) {
  using reg = Vec::reg;
  constexpr int L = Vec::lanes;
  constexpr int64_t LINE = 64 / sizeof(WT);  // elements per cache line
  static_assert(GS % L == 0, "a fixed group is whole vectors");
  reg acc[R][MB] = {};
  reg total[GROUPED ? R : 1][GROUPED ? MB : 1] = {};
  float tail[R][MB] = {};
  float tail_total[R][MB] = {};
  // Scalar tails only where a group (or K) is not whole vectors: none in the common modes.
  const bool ragged = GS == 0 && (group % L != 0 || K % L != 0);
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    reg wf[R];
    for (int r = 0; r < R; ++r) wf[r] = Vec::load(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const reg xv = Vec::load(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][m] = Vec::fma(wf[r], xv, acc[r][m]);
    }
  };
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = Vec::zero();
    if constexpr (GS > 0) {
      const int64_t k0 = g * GS;
      if (TL_PREFETCH && (k0 & (LINE - 1)) == 0)
        for (int r = 0; r < R; ++r) prefetch(w + (r + R) * K + k0);
      for (int u = 0; u < GS; u += L) step(k0 + u);
    } else {
      const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
      int64_t k = k0;
      for (; k + LINE <= k1; k += LINE) {  // one cache line per row per iteration
        if (TL_PREFETCH)
          for (int r = 0; r < R; ++r) prefetch(w + (r + R) * K + k);
        for (int u = 0; u < LINE; u += L) step(k + u);
      }
      for (; k + L <= k1; k += L) {  // groups shorter than a line still prefetch
        if (TL_PREFETCH && (k & (LINE - 1)) == 0)
          for (int r = 0; r < R; ++r) prefetch(w + (r + R) * K + k);
        step(k);
      }
      if (ragged)
        for (; k < k1; ++k)  // ragged end of a group (or of K)
          for (int r = 0; r < R; ++r)
            for (int m = 0; m < MB; ++m) tail[r][m] += static_cast<float>(w[r * K + k]) * x[m * ldx + k];
    }
    if constexpr (GROUPED) {
      for (int r = 0; r < R; ++r) {
        const float sg = scale_value(s[r * G + g]);
        const reg sv = Vec::set1(sg);
        for (int m = 0; m < MB; ++m) total[r][m] = Vec::fma(acc[r][m], sv, total[r][m]);
        if (ragged)
          for (int m = 0; m < MB; ++m) {
            tail_total[r][m] += tail[r][m] * sg;
            tail[r][m] = 0.0f;
          }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      if constexpr (GROUPED) {
        out[m][r] = Vec::sum(total[r][m]) + tail_total[r][m];
      } else {
        const float v = Vec::sum(acc[r][m]) + tail[r][m];
        out[m][r] = s ? v * scale_value(s[r]) : v;
      }
    }
}

// Int4: out[m][r] = sum_g s[r * G + g] * sum_{k in g} u[r][k] * x[m * ldx + k], u the nibbles of
// rows of K / 2 packed bytes (the offsets' share is the caller's). Groups are whole 32-column
// chunks, the last one possibly shorter; GS > 0: groups of GS columns, unrolled. One
// accumulator chain per (row, activation row): measured faster on Zen 3 than two, whose extra
// registers GCC spills.
// CB = 20: 5-bit codes, each 32-column chunk its 16 bytes of nibbles then 4 bytes of high bits
// (bit i column i), u = nibble + 16 * bit (GGUF Q5_0/Q5_1/Q5_K, tierlm/quant/q5.py).
// CODEBOOK: each nibble stands for kIQ4Values[nibble] (GGUF IQ4_NL / IQ4_XS).
template <int R, int MB, int GS, typename ST = uint16_t, int CB = 16, bool CODEBOOK = false>
inline void tile4(const float* x, int64_t ldx, const uint8_t* w, int64_t K, const ST* s,
                  int64_t G, int64_t group, float (&out)[MB][R]) {
  using reg = Vec::reg;
  constexpr int L = Vec::lanes;
  constexpr int64_t CHUNK = 32, LINE = 128;  // columns per 16-byte chunk, per 64-byte line
  static_assert(16 % L == 0 && GS % CHUNK == 0, "chunks are whole vectors, groups whole chunks");
  const int64_t stride = K / CHUNK * CB;
  reg acc[R][MB];
  reg total[R][MB] = {};
  auto chunk = [&](int64_t k) __attribute__((always_inline)) {
    const int64_t at = k / CHUNK * CB;
    if (TL_PREFETCH && (k & (LINE - 1)) == 0)
      for (int r = 0; r < R; ++r) prefetch(w + (r + R) * stride + at);
    for (int j = 0; j < 16; j += L) {
      reg lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        if constexpr (CODEBOOK) Vec::looked_up(w + r * stride + at + j, kIQ4Values, lo[r], hi[r]);
        else if constexpr (CB == 20) Vec::fives(w + r * stride + at + j, w + r * stride + at + 16, j, lo[r], hi[r]);
        else Vec::nibbles(w + r * stride + at + j, lo[r], hi[r]);
      }
      for (int m = 0; m < MB; ++m) {
        const reg x0 = Vec::load(x + m * ldx + k + j), x1 = Vec::load(x + m * ldx + k + 16 + j);
        for (int r = 0; r < R; ++r) acc[r][m] = Vec::fma(hi[r], x1, Vec::fma(lo[r], x0, acc[r][m]));
      }
    }
  };
  // total += acc * (the scale of each row for group g): scales[r][i] when g is group i of the
  // block of L groups whose scales were widened together (one fp16 vector load per row: a
  // scalar conversion per row and group costs ~6% at group 32), else converted alone.
  alignas(64) float scales[R][L];
  auto widen_scales = [&](int64_t g) __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r) {
      if constexpr (sizeof(ST) == 2) Vec::store(scales[r], Vec::load_half(s + r * G + g));
      else Vec::store(scales[r], Vec::load(s + r * G + g));
    }
  };
  auto scale = [&](int64_t g, int i) __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r) {
      const reg sv = Vec::set1(i >= 0 ? scales[r][i] : scale_value(s[r * G + g]));
      for (int m = 0; m < MB; ++m) total[r][m] = Vec::fma(acc[r][m], sv, total[r][m]);
    }
  };
  auto clear = [&]() __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = Vec::zero();
  };
  int64_t g = 0;
  if constexpr (GS > 0) {
    const int64_t whole = K / GS;
    for (; g + L <= whole; g += L) {
      widen_scales(g);
      for (int i = 0; i < L; ++i) {
        clear();
        for (int64_t c = 0; c < GS; c += CHUNK) chunk((g + i) * GS + c);
        scale(g + i, i);
      }
    }
  }
  for (; g < G; ++g) {  // any group size, and what is left of a fixed one (a short last group)
    if (g % L == 0 && g + L <= G) widen_scales(g);
    clear();
    for (int64_t k = g * group, k1 = std::min(K, k + group); k < k1; k += CHUNK) chunk(k);
    scale(g, g - g % L + L <= G ? static_cast<int>(g % L) : -1);
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = Vec::sum(total[r][m]);
}

// Weight rows per tile: wide tiles for one activation row, fewer rows as more activation rows
// share each widened weight (the accumulators must stay in registers).
inline int rows_per_tile(int64_t M) {
#if TIERLM_ISA == 512
  return M == 1 ? 8 : 4;
#else
  return M <= 2 ? 4 : 2;
#endif
}

// The fp16 value stored (unaligned) at p, as fp32.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return half_to_float(h);
}

// f(r, b, p, d) for super-block b of each row n + r (r < R) of W: p its `bytes` bytes, d its
// leading fp16 scale as fp32 (every super-block layout starts with its d).
template <typename F>
inline void each_super_block(const Weight& W, int64_t n, int R, int64_t bytes, F&& f) {
  const int64_t B = W.cols / kSuperColumns;
  const uint8_t* super = static_cast<const uint8_t*>(W.scales) + n * B * bytes;
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* p = super + (r * B + b) * bytes;
      f(r, b, p, half_at(p));
    }
}

// Rows [n, n + R) of a kInt4K weight's super-blocks as fp32 per-group scales s [R, G] and
// offsets o [R, G] (d * sc, -(dmin * m): the products gguf forms, exact in fp32).
inline void expand_super_blocks(const Weight& W, int64_t n, int R, float* s, float* o) {
  const int64_t G = W.groups();
  each_super_block(W, n, R, kSuperBytes, [&](int r, int64_t b, const uint8_t* p, float d) {
    const float dmin = half_at(p + 2);
    for (int j = 0; j < 8; ++j) {
      s[r * G + b * 8 + j] = d * static_cast<float>(p[4 + j]);
      o[r * G + b * 8 + j] = -(dmin * static_cast<float>(p[12 + j]));
    }
  });
}

// Rows [n, n + R) of a weight whose super-blocks are fp16 d then SUBS int8 sub-scales (kInt6K:
// 16 per 256 columns, kIQ4X: 8) as fp32 scales s [R, SUBS * cols / 256]: d * sub, as gguf forms them.
template <int SUBS>
inline void expand_signed_scales(const Weight& W, int64_t n, int R, float* s) {
  const int64_t G = W.groups();
  each_super_block(W, n, R, 2 + SUBS, [&](int r, int64_t b, const uint8_t* p, float d) {
    for (int j = 0; j < SUBS; ++j) s[r * G + b * SUBS + j] = d * static_cast<float>(static_cast<int8_t>(p[2 + j]));
  });
}

// Rows [n, n + R) of a kInt2K / kInt3K weight's super-blocks as fp32 per-16-column scales s
// [R, G] and (kInt2K) offsets o [R, G], the products gguf forms: Q2_K d * sc and -(dmin * m),
// Q3_K d * (sc - 32) with sc unpacked from GGUF's 12 bytes (4 low bits, then 2 high bits each).
inline void expand_low_bit_k(const Weight& W, int64_t n, int R, float* s, float* o) {
  const int64_t G = W.groups();
  const bool three = W.kind == kInt3K;
  each_super_block(W, n, R, three ? 14 : 20, [&](int r, int64_t b, const uint8_t* p, float d) {
    float* sg = s + r * G + b * 16;
    if (three) {
      for (int j = 0; j < 16; ++j) {
        const int sc = ((p[2 + j % 8] >> (4 * (j / 8))) & 15) | (((p[10 + j % 4] >> (2 * (j / 4))) & 3) << 4);
        sg[j] = d * static_cast<float>(sc - 32);
      }
      return;
    }
    const float dmin = half_at(p + 2);
    for (int j = 0; j < 16; ++j) {
      sg[j] = d * static_cast<float>(p[4 + j] & 15);
      o[r * G + b * 16 + j] = -(dmin * static_cast<float>(p[4 + j] >> 4));
    }
  });
}

// The codes of the kinds whose 32-column chunks are two groups of 16, read for `tile16`: each
// `load`s columns j.. (lo) and 16 + j.. (hi) of chunk c of row r as fp32 codes, less their bias.
struct SixBitCodes {  // Q6_K: low nibbles w (int4.py's packing), 2-bit high parts q; (lo + 16 hi) - 32
  const uint8_t *w, *q;
  int64_t K;
  static constexpr int kPrefetchEvery = 4;  // chunks per 64-byte line of the nibbles
  void prefetch(int r, int64_t c) const {
    tl::prefetch(w + r * (K / 2) + c * 16);
    tl::prefetch(q + r * (K / 4) + c * 8);
  }
  void load(int r, int64_t c, int j, Vec::reg& lo, Vec::reg& hi) const {
    Vec::sixes(w + r * (K / 2) + c * 16 + j, q + r * (K / 4) + c * 8, j, lo, hi);
  }
};

template <bool HIGH>
struct LowBitCodes {  // Q2_K: crumbs q; Q3_K (HIGH): crumbs + 4 x the high bit in h, less 4
  const uint8_t *q, *h;
  int64_t K;
  static constexpr int kPrefetchEvery = 8;  // chunks per 64-byte line of the crumbs
  void prefetch(int r, int64_t c) const {
    tl::prefetch(q + r * (K / 4) + c * 8);
    if (HIGH) tl::prefetch(h + r * (K / 8) + c * 4);
  }
  void load(int r, int64_t c, int j, Vec::reg& lo, Vec::reg& hi) const {
    uint32_t word = 0;
    if (HIGH) __builtin_memcpy(&word, h + r * (K / 8) + c * 4, 4);
    Vec::lowbits<HIGH>(q + r * (K / 4) + c * 8, word, HIGH ? 4 : 0, j, lo, hi);
  }
};

// Q6_K, Q2_K, Q3_K: out[m][r] = sum_k code[r][k] * s[r][k / 16] * x[m][k], rows from `codes`'
// first. Each half of a 32-column chunk is its own group, so codes are scaled as widened (one
// multiply more than tile4's deferred per-group scaling, whose two accumulators per half would
// not fit in registers).
template <int R, int MB, typename Codes>
inline void tile16(const float* x, int64_t ldx, const Codes& codes, int64_t K, const float* s, int64_t G,
                   float (&out)[MB][R]) {
  using reg = Vec::reg;
  constexpr int L = Vec::lanes;
  reg acc[R][MB] = {};
  for (int64_t c = 0; c < K / 32; ++c) {
    if (TL_PREFETCH && c % Codes::kPrefetchEvery == 0)
      for (int r = 0; r < R; ++r) codes.prefetch(r + R, c);
    reg s0[R], s1[R];
    for (int r = 0; r < R; ++r) {
      s0[r] = Vec::set1(s[r * G + 2 * c]);
      s1[r] = Vec::set1(s[r * G + 2 * c + 1]);
    }
    for (int j = 0; j < 16; j += L) {
      reg lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        codes.load(r, c, j, lo[r], hi[r]);
        lo[r] = lo[r] * s0[r];
        hi[r] = hi[r] * s1[r];
      }
      for (int m = 0; m < MB; ++m) {
        const reg x0 = Vec::load(x + m * ldx + c * 32 + j), x1 = Vec::load(x + m * ldx + c * 32 + 16 + j);
        for (int r = 0; r < R; ++r) acc[r][m] = Vec::fma(hi[r], x1, Vec::fma(lo[r], x0, acc[r][m]));
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = Vec::sum(acc[r][m]);
}

// An int8 tile of R rows from row n (w at row n), scales `s` of any stored type (all rows').
template <int R, int MB, typename ST>
inline void int8_tile(const Weight& W, const float* x, int64_t ldx, const int8_t* w, const ST* s,
                      int64_t n, float (&out)[MB][R]) {
  const int64_t K = W.cols, G = W.groups();
  if (G == 1) tile<R, MB, false, 0>(x, ldx, w, K, s + n, 1, K, out);
  else if (W.group == 32 && K % 32 == 0)  // int8-g32 and q8_0 (GGUF sources): unrolled groups
    tile<R, MB, true, 32>(x, ldx, w, K, s + n * G, G, 32, out);
  else tile<R, MB, true, 0>(x, ldx, w, K, s + n * G, G, W.group, out);
}

// A tile's sums of codes times scales finished and stored into, or added to, y[m * ldy + r]:
// plus the offsets' share, sum_g o[g] * (x summed over group g: xs), where the kind keeps its
// offsets apart (int4: -8 s when symmetric; q5: -16 s for Q5_0; asymmetric int8: fp32 o), and
// the bias. The super-block kinds add their expanded offsets in `block`.
template <int R, int MB>
inline void finish(const Weight& W, const float* xs, int64_t n, float (&out)[MB][R], float* y, int64_t ldy,
                   bool accumulate) {
  const int64_t G = W.groups();
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float v = out[m][r];
      const float* sums = xs ? xs + m * G : nullptr;
      if (W.kind == kInt4 || W.kind == kInt5) {
        const uint16_t* o = static_cast<const uint16_t*>(W.offsets);
        const uint16_t* s = static_cast<const uint16_t*>(W.scales);
        v += o ? dot(o + (n + r) * G, sums, G) : (W.kind == kInt4 ? -8.0f : -16.0f) * dot(s + (n + r) * G, sums, G);
      } else if (W.kind == kInt8 && W.offsets) {
        v += dot(static_cast<const float*>(W.offsets) + (n + r) * G, sums, G);
      }
      if (W.bias) v += W.bias[n + r];
      float& dst = y[m * ldy + r];
      dst = accumulate ? dst + v : v;
    }
}

// One tile of R rows starting at n for activation rows [0, MB) of x: finished outputs
// (scale, asymmetric offsets, bias) stored into, or added to, y[m * ldy + r].
template <int R, int MB>
inline void block(const Weight& W, const float* x, int64_t ldx, const float* xs, int64_t n,
                  float* y, int64_t ldy, bool accumulate) {
  float out[MB][R];
  const int64_t K = W.cols, G = W.groups();
  if (W.kind == kInt4) {
    const uint8_t* w = static_cast<const uint8_t*>(W.data) + n * (K / 2);
    const uint16_t* s = static_cast<const uint16_t*>(W.scales) + n * G;
    if (W.group == 32) tile4<R, MB, 32>(x, ldx, w, K, s, G, 32, out);
    else if (W.group == 128) tile4<R, MB, 128>(x, ldx, w, K, s, G, 128, out);
    else tile4<R, MB, 0>(x, ldx, w, K, s, G, W.group, out);
  } else if (W.kind == kInt4K) {
    const uint8_t* w = static_cast<const uint8_t*>(W.data) + n * (K / 2);
    thread_local std::vector<float> expanded;  // this tile's scales and offsets, reused per thread
    expanded.resize(2 * R * G);
    float* s = expanded.data();
    float* o = s + R * G;
    expand_super_blocks(W, n, R, s, o);
    tile4<R, MB, 32, float>(x, ldx, w, K, s, G, 32, out);
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) out[m][r] += dot(o + r * G, xs + m * G, G);
  } else if (W.kind == kInt5) {
    const uint8_t* w = static_cast<const uint8_t*>(W.data) + n * (K / 32 * 20);
    const uint16_t* s = static_cast<const uint16_t*>(W.scales) + n * G;
    tile4<R, MB, 32, uint16_t, 20>(x, ldx, w, K, s, G, 32, out);
  } else if (W.kind == kInt5K) {
    thread_local std::vector<float> expanded;
    expanded.resize(2 * R * G);
    float* s = expanded.data();
    float* o = s + R * G;
    expand_super_blocks(W, n, R, s, o);
    tile4<R, MB, 32, float, 20>(x, ldx, static_cast<const uint8_t*>(W.data) + n * (K / 32 * 20), K, s, G, 32, out);
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) out[m][r] += dot(o + r * G, xs + m * G, G);
  } else if (W.kind == kIQ4) {
    tile4<R, MB, 32, uint16_t, 16, true>(x, ldx, static_cast<const uint8_t*>(W.data) + n * (K / 2), K,
                                         static_cast<const uint16_t*>(W.scales) + n * G, G, 32, out);
  } else if (W.kind == kIQ4X) {
    thread_local std::vector<float> expanded;
    expanded.resize(R * G);
    expand_signed_scales<8>(W, n, R, expanded.data());
    tile4<R, MB, 32, float, 16, true>(x, ldx, static_cast<const uint8_t*>(W.data) + n * (K / 2), K,
                                      expanded.data(), G, 32, out);
  } else if (W.kind == kInt6K) {
    thread_local std::vector<float> expanded;
    expanded.resize(R * G);
    expand_signed_scales<16>(W, n, R, expanded.data());
    const SixBitCodes codes{static_cast<const uint8_t*>(W.data) + n * (K / 2),
                            static_cast<const uint8_t*>(W.offsets) + n * (K / 4), K};
    tile16<R, MB>(x, ldx, codes, K, expanded.data(), G, out);
  } else if (W.kind == kInt2K || W.kind == kInt3K) {
    thread_local std::vector<float> expanded;
    expanded.resize(2 * R * G);
    float* s = expanded.data();
    float* o = s + R * G;
    expand_low_bit_k(W, n, R, s, o);
    const uint8_t* q = static_cast<const uint8_t*>(W.data) + n * (K / 4);
    if (W.kind == kInt3K) {
      const LowBitCodes<true> codes{q, static_cast<const uint8_t*>(W.offsets) + n * (K / 8), K};
      tile16<R, MB>(x, ldx, codes, K, s, G, out);
    } else {
      tile16<R, MB>(x, ldx, LowBitCodes<false>{q, nullptr, K}, K, s, G, out);
      for (int m = 0; m < MB; ++m)
        for (int r = 0; r < R; ++r) out[m][r] += dot(o + r * G, xs + m * G, G);
    }
  } else if (W.kind == kFp32) {
    const float* unscaled = nullptr;
    tile<R, MB, false, 0>(x, ldx, static_cast<const float*>(W.data) + n * K, K, unscaled, 1, K, out);
  } else if (W.half) {
    int8_tile<R, MB>(W, x, ldx, static_cast<const int8_t*>(W.data) + n * K,
                     static_cast<const uint16_t*>(W.scales), n, out);
  } else {
    int8_tile<R, MB>(W, x, ldx, static_cast<const int8_t*>(W.data) + n * K,
                     static_cast<const float*>(W.scales), n, out);
  }
  finish<R, MB>(W, xs, n, out, y, ldy, accumulate);
}

template <int R>
inline void block_rows(int mb, const Weight& W, const float* x, int64_t ldx, const float* xs,
                       int64_t n, float* y, int64_t ldy, bool accumulate) {
  switch (mb) {
    case 1: return block<R, 1>(W, x, ldx, xs, n, y, ldy, accumulate);
    case 2: return block<R, 2>(W, x, ldx, xs, n, y, ldy, accumulate);
    case 3: return block<R, 3>(W, x, ldx, xs, n, y, ldy, accumulate);
    default: return block<R, 4>(W, x, ldx, xs, n, y, ldy, accumulate);
  }
}

inline void block_any(int r, int mb, const Weight& W, const float* x, int64_t ldx,
                      const float* xs, int64_t n, float* y, int64_t ldy, bool accumulate) {
  switch (r) {
    case 1: return block_rows<1>(mb, W, x, ldx, xs, n, y, ldy, accumulate);
    case 2: return block_rows<2>(mb, W, x, ldx, xs, n, y, ldy, accumulate);
    case 3: return block_rows<3>(mb, W, x, ldx, xs, n, y, ldy, accumulate);
    case 4: return block_rows<4>(mb, W, x, ldx, xs, n, y, ldy, accumulate);
#if TIERLM_ISA == 512
    case 5: return block<5, 1>(W, x, ldx, xs, n, y, ldy, accumulate);
    case 6: return block<6, 1>(W, x, ldx, xs, n, y, ldy, accumulate);
    case 7: return block<7, 1>(W, x, ldx, xs, n, y, ldy, accumulate);
    default: return block<8, 1>(W, x, ldx, xs, n, y, ldy, accumulate);
#else
    default: return block_rows<4>(mb, W, x, ldx, xs, n, y, ldy, accumulate);
#endif
  }
}

// y[m * ldy + (n - n0)] (+)= (x[m] @ W.T)[n] for weight rows n in [n0, n1), m < M.
// xs [M, G]: x summed per group, needed only when W has offsets.
// a: x quantized for W's integer path (quantize16), or null / unusable: the fp32 tiles.
inline void gemv_rows(const Weight& W, const float* x, int64_t ldx, int64_t M, const float* xs,
                      int64_t n0, int64_t n1, float* y, int64_t ldy, bool accumulate,
                      const Activations16* a = nullptr) {
  const int64_t G = W.groups();
  if (a && a->usable) return gemv_a16(W, *a, xs, M, n0, n1, y, ldy, accumulate);
  const int rows = rows_per_tile(M);
  for (int64_t n = n0; n < n1; n += rows) {
    const int r = static_cast<int>(std::min<int64_t>(rows, n1 - n));
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mb = static_cast<int>(std::min<int64_t>(4, M - m0));
      block_any(r, mb, W, x + m0 * ldx, ldx, xs ? xs + m0 * G : nullptr, n,
                y + m0 * ldy + (n - n0), ldy, accumulate);
    }
  }
}

// x [M, K] summed per group of W: [M, G]; empty unless W has offsets or is int4 (whose
// symmetric offsets are implied).
inline std::vector<float> group_sums(const Weight& W, const float* x, int64_t ldx, int64_t M) {
  // Q6_K's and Q3_K's `offsets` are code bits; Q2_K's offsets are in its super-blocks.
  const bool implied = W.kind == kInt4 || W.kind == kInt4K || W.kind == kInt5 || W.kind == kInt5K || W.kind == kInt2K;
  if ((!W.offsets || W.kind == kInt6K || W.kind == kInt3K) && !implied) return {};
  constexpr int L = Vec::lanes;
  const int64_t K = W.cols, G = W.groups();
  std::vector<float> xs(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* row = x + m * ldx;
      const int64_t k1 = std::min(K, (g + 1) * W.group);
      int64_t k = g * W.group;
      Vec::reg acc = Vec::zero();
      for (; k + L <= k1; k += L) acc = Vec::fma(Vec::load(row + k), Vec::set1(1.0f), acc);
      float total = Vec::sum(acc);
      for (; k < k1; ++k) total += row[k];
      xs[m * G + g] = total;
    }
  return xs;
}

// Chunks of tiles per parallel_for call: two per thread. Each claim is an atomic on a line the
// threads share (150-350 ns a round trip between cores here): decode's small products measured
// ~10 % faster than with eight a thread, and the pool's adaptive mode covers a descheduled helper.
inline int64_t tile_grain(int64_t tiles, int threads) {
  return std::max<int64_t>(1, tiles / (2 * std::max(threads, 1)));
}

// y[M, ldy] (+)= x @ W.T over all of W's rows, in parallel over tiles of rows; up to
// `integer_rows` rows (gemv_a16.h kA16PartRows at most) take the integer decode kernels.
inline void gemv(const Weight& W, const float* x, int64_t ldx, int64_t M, const float* xs,
                 float* y, int64_t ldy, bool accumulate, int threads, int64_t integer_rows = kA16MaxRows) {
  if (W.kind == kStack) {  // each run of rows by its own kernel into its columns of y (xs unused)
    int64_t row = 0;
    for (int64_t i = 0; i < W.group; ++i) {
      Weight run = W.runs()[i];
      run.bias = W.bias ? W.bias + row : nullptr;
      const std::vector<float> sums = group_sums(run, x, ldx, M);
      gemv(run, x, ldx, M, sums.data(), y + row, ldy, accumulate, threads, integer_rows);
      row += run.rows;
    }
    return;
  }
  const Activations16 a = quantize16(W, x, ldx, M, integer_rows);
  const int64_t R = rows_per_tile(M), N = W.rows, tiles = (N + R - 1) / R;
  parallel_for(tiles, tile_grain(tiles, threads), threads, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * R, n1 = std::min(N, t1 * R);
    gemv_rows(W, x, ldx, M, xs, n0, n1, y + n0, ldy, accumulate, &a);
  });
}

}  // namespace tl
