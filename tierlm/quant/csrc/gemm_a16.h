// Prefill-sized products multiplied in integers: y[M, N] = x[M, K] @ W.T (+ bias) for many
// activation rows, every weight kind but fp32 and row stacks, read as stored.
//
// x is quantized once per call to int16 per 32 columns (gemv_a16.h's quantize_group16: the
// decode rows' numerics, each value within 1.5e-5 of its group's largest magnitude). W is
// expanded a panel of `PanelOps::lanes` rows at a time into its integer codes (Q8_0's int8,
// nibbles, Q5's and Q6_K's joined bits, Q2_K/Q3_K's crumbs, IQ4's codebook values) with fp32
// scales and offsets per group of 16 or 32 columns, as gguf forms them, and the codes laid out
// as column pairs: word p of lane r holds row r's codes at columns 2p and 2p + 1. One pairwise
// int32 dot (vpdpwssd, or vpmaddwd + vpaddd) then multiplies two columns of every row of the
// panel by one activation row's broadcast pair, with no horizontal sums; each group's int32
// sums are scaled once into fp32: y = sum_g s_w s_x (codes . x codes) + sum_g o_w (x summed
// over g). |code| <= 127, |x code| <= 32767 and 32 products a group keep every sum < 2^27.
// Each panel is expanded once per block of activation rows and serves all of them (the fp32
// path instead writes every dequantized weight to memory and reads it back in BLAS).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "gemv_a16.h"
#include "pool.h"
#include "weight.h"

namespace tl {

// Activation rows quantized and multiplied together per pass over the panels: bounds the
// int16 copy of x (kGemmRowBlock x K) that every panel reads from cache.
constexpr int64_t kGemmRowBlock = 256;

// Rows past which a product runs as this GEMM where W has it (fewer: the decode kernels), as
// tierlm/quant/dispatch.py's INTEGER_GEMM_ROWS.
constexpr int64_t kGemmMinRows = 32;

// Columns per scale of W's codes: 16 for the kinds whose sub-blocks are 16 wide, else 32.
inline int64_t code_group(const Weight& W) {
  return W.kind == kInt6K || W.kind == kInt2K || W.kind == kInt3K ? 16 : 32;
}

// Whether gemm_a16 multiplies W: every stored kind whose columns come in whole 32-column
// chunks (int8 only in groups that are whole chunks), and row stacks of those, on the x86 builds.
inline bool has_gemm_a16_path(const Weight& W) {
  if (!Ints16::available || !W.supported() || W.cols <= 0 || W.cols % 32 != 0) return false;
  if (W.kind == kInt8) return W.group % 32 == 0 || W.group >= W.cols;
  if (W.kind == kStack) return std::all_of(W.runs(), W.runs() + W.group, [](const Weight& run) { return has_gemm_a16_path(run); });
  return W.kind != kFp32;
}

// 32 ones: a group's sum as a dot product.
alignas(64) inline constexpr float kOnes[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// Row n's 32 codes of chunk c (columns 32c..32c+31) of W, less the bias the kind subtracts
// (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q3_K's 4: its offsets then need no term of their own).
inline void chunk_codes(const Weight& W, int64_t n, int64_t c, int16_t* out) {
  const int64_t K = W.cols;
  const uint8_t* bytes = static_cast<const uint8_t*>(W.data);
  switch (W.kind) {
    case kInt8: {
      const int8_t* w = static_cast<const int8_t*>(W.data) + n * K + c * 32;
      for (int k = 0; k < 32; ++k) out[k] = w[k];
      return;
    }
    case kInt4:
    case kInt4K:
    case kIQ4:
    case kIQ4X: {  // int4.py's packing: byte k holds column k (low nibble) and 16 + k (high)
      const uint8_t* b = bytes + n * (K / 2) + c * 16;
      const int bias = W.kind == kInt4 && !W.offsets ? 8 : 0;
      for (int k = 0; k < 16; ++k) {
        const int lo = b[k] & 15, hi = b[k] >> 4;
        if (W.kind == kIQ4 || W.kind == kIQ4X) {
          out[k] = kIQ4Codes[lo];
          out[16 + k] = kIQ4Codes[hi];
        } else {
          out[k] = static_cast<int16_t>(lo - bias);
          out[16 + k] = static_cast<int16_t>(hi - bias);
        }
      }
      return;
    }
    case kInt5:
    case kInt5K: {  // 16 bytes of nibbles, then the fifth bits (bit k column k)
      const uint8_t* chunk = bytes + (n * (K / 32) + c) * 20;
      uint32_t high;
      std::memcpy(&high, chunk + 16, 4);
      const int bias = W.kind == kInt5 && !W.offsets ? 16 : 0;
      for (int k = 0; k < 16; ++k) {
        out[k] = static_cast<int16_t>(((chunk[k] & 15) | ((high >> k) & 1) << 4) - bias);
        out[16 + k] = static_cast<int16_t>(((chunk[k] >> 4) | ((high >> (16 + k)) & 1) << 4) - bias);
      }
      return;
    }
    case kInt6K: {  // low nibbles as int4's, 2-bit high parts: byte k % 8, bits 2 (k / 8)
      const uint8_t* b = bytes + n * (K / 2) + c * 16;
      const uint8_t* q = static_cast<const uint8_t*>(W.offsets) + n * (K / 4) + c * 8;
      for (int k = 0; k < 32; ++k) {
        const int lo = k < 16 ? b[k] & 15 : b[k - 16] >> 4;
        out[k] = static_cast<int16_t>(lo + 16 * ((q[k % 8] >> (2 * (k / 8))) & 3) - 32);
      }
      return;
    }
    default: {  // kInt2K, kInt3K: crumbs as Q6_K's high parts, Q3_K's third bit a word per chunk
      const uint8_t* q = bytes + n * (K / 4) + c * 8;
      uint32_t bits = 0;
      if (W.kind == kInt3K) std::memcpy(&bits, static_cast<const uint8_t*>(W.offsets) + n * (K / 8) + c * 4, 4);
      const int bias = W.kind == kInt3K ? 4 : 0;
      for (int k = 0; k < 32; ++k)
        out[k] = static_cast<int16_t>((((q[k % 8] >> (2 * (k / 8))) & 3) | ((bits >> k) & 1) << 2) - bias);
      return;
    }
  }
}

// Row n's scales s [K / code_group] and offsets o (left untouched where the kind has none:
// returns false), one per group of code_group(W) columns, as gguf forms them.
inline bool row_scales(const Weight& W, int64_t n, float* s, float* o) {
  const int64_t K = W.cols, G = W.groups(), chunks = K / 32;
  switch (W.kind) {
    case kInt8: {  // groups of any multiple of 32 (or the whole row): repeated per chunk
      const int64_t per = std::min(W.group, K) / 32;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t g = std::min(c / per, G - 1);
        s[c] = W.half ? half_to_float(static_cast<const uint16_t*>(W.scales)[n * G + g])
                      : static_cast<const float*>(W.scales)[n * G + g];
        if (W.offsets) o[c] = static_cast<const float*>(W.offsets)[n * G + g];
      }
      return W.offsets != nullptr;
    }
    case kInt4:
    case kInt5:
    case kIQ4: {  // fp16 scales (and offsets) per group, a multiple of 32 columns
      const int64_t per = W.group / 32;
      const uint16_t* scales = static_cast<const uint16_t*>(W.scales) + n * G;
      const uint16_t* offsets = static_cast<const uint16_t*>(W.offsets);
      for (int64_t c = 0; c < chunks; ++c) {
        s[c] = half_to_float(scales[c / per]);
        if (offsets) o[c] = half_to_float(offsets[n * G + c / per]);
      }
      return offsets != nullptr;
    }
    case kInt4K:
    case kInt5K:
      expand_super_blocks(W, n, 1, s, o);
      return true;
    case kIQ4X:
      expand_signed_scales<8>(W, n, 1, s);
      return false;
    case kInt6K:
      expand_signed_scales<16>(W, n, 1, s);
      return false;
    default:  // kInt2K, kInt3K
      expand_low_bit_k(W, n, 1, s, o);
      return W.kind == kInt2K;
  }
}

#if TIERLM_ISA >= 256

// The registers a panel is multiplied in: `lanes` weight rows, `regs` registers of `width`
// int32 lanes (column pairs) each, against `rows` activation rows per register block.
#if TIERLM_ISA == 512
struct PanelOps {
  static constexpr int width = 16, regs = 1, lanes = 16, rows = 8;
  using ireg = __m512i;
  using freg = __m512;
  static ireg izero() { return _mm512_setzero_si512(); }
  static freg fzero() { return _mm512_setzero_ps(); }
  static ireg load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static ireg broadcast(const int32_t* p) { return _mm512_set1_epi32(*p); }
  // acc += the pairwise products of w with the pair at p broadcast to every lane.
  static ireg dot(ireg acc, ireg w, const int32_t* p) {
#if defined(__AVX512VNNI__) && defined(__GNUC__)
    // As written (the broadcast from memory embedded, acc updated in place): GCC 12 otherwise
    // copies every accumulator once a step (measured 2x slower).
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
    return acc;
#elif defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(*p));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(*p)));
#endif
  }
  static ireg dot(ireg acc, ireg w, ireg b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, b));
#endif
  }
  static freg loadf(const float* p) { return _mm512_loadu_ps(p); }
  static freg set1(float v) { return _mm512_set1_ps(v); }
  static freg mul(freg a, freg b) { return _mm512_mul_ps(a, b); }
  static freg add(freg a, freg b) { return _mm512_add_ps(a, b); }
  static freg fma(freg a, freg b, freg c) { return _mm512_fmadd_ps(a, b, c); }
  static freg cvt(ireg v) { return _mm512_cvtepi32_ps(v); }
  static void storef(float* p, freg v) { _mm512_storeu_ps(p, v); }
};
#else
struct PanelOps {
  // Two registers of weight rows share each broadcast pair: per step 2 loads and 4 broadcasts
  // feed 8 multiplies (one register against 4 rows measured half the multiplier's rate on Zen 3).
  static constexpr int width = 8, regs = 2, lanes = 16, rows = 5;
  using ireg = __m256i;
  using freg = __m256;
  static ireg izero() { return _mm256_setzero_si256(); }
  static freg fzero() { return _mm256_setzero_ps(); }
  static ireg load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static ireg broadcast(const int32_t* p) { return _mm256_set1_epi32(*p); }
  // acc += the pairwise products of w and b.
  static ireg dot(ireg acc, ireg w, ireg b) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return _mm256_dpwssd_epi32(acc, w, b);
#elif defined(__GNUC__)
    // In place through one scratch register: GCC 12 otherwise copies every accumulator a step.
    __m256i product;
    __asm__("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(product) : "x"(w), "x"(b));
    return acc;
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, b));
#endif
  }
  static ireg dot(ireg acc, ireg w, const int32_t* p) { return dot(acc, w, broadcast(p)); }
  static freg loadf(const float* p) { return _mm256_loadu_ps(p); }
  static freg set1(float v) { return _mm256_set1_ps(v); }
  static freg mul(freg a, freg b) { return _mm256_mul_ps(a, b); }
  static freg add(freg a, freg b) { return _mm256_add_ps(a, b); }
  static freg fma(freg a, freg b, freg c) { return _mm256_fmadd_ps(a, b, c); }
  static freg cvt(ireg v) { return _mm256_cvtepi32_ps(v); }
  static void storef(float* p, freg v) { _mm256_storeu_ps(p, v); }
};
#endif

// Row n's codes [K] as chunk_codes gives them, the common kinds a register at a time.
inline void row_codes(const Weight& W, int64_t n, int16_t* out) {
  using I = Ints16;
  const int64_t K = W.cols, chunks = K / 32;
  const uint8_t* bytes = static_cast<const uint8_t*>(W.data);
  switch (W.kind) {
    case kInt8: {
      const int8_t* w = static_cast<const int8_t*>(W.data) + n * K;
      for (int64_t k = 0; k < K; k += 16) I::store(out + k, I::widen(w + k));
      return;
    }
    case kInt4:
    case kInt4K: {
      const I::reg bias = I::splat(W.kind == kInt4 && !W.offsets ? 8 : 0);
      for (int64_t c = 0; c < chunks; ++c) {
        const I::reg v = I::widen(bytes + n * (K / 2) + c * 16);
        I::store(out + c * 32, I::sub(I::low_nibbles(v), bias));
        I::store(out + c * 32 + 16, I::sub(I::high_nibbles(v), bias));
      }
      return;
    }
    case kInt5:
    case kInt5K: {
      const I::reg bias = I::splat(W.kind == kInt5 && !W.offsets ? 16 : 0);
      for (int64_t c = 0; c < chunks; ++c) {
        I::reg lo, hi;
        I::fives(bytes + (n * chunks + c) * 20, lo, hi);
        I::store(out + c * 32, I::sub(lo, bias));
        I::store(out + c * 32 + 16, I::sub(hi, bias));
      }
      return;
    }
    case kInt6K: {
      const uint8_t* q = static_cast<const uint8_t*>(W.offsets) + n * (K / 4);
      for (int64_t c = 0; c < chunks; ++c) {
        I::reg lo, hi;
        I::sixes(bytes + n * (K / 2) + c * 16, q + c * 8, lo, hi);
        I::store(out + c * 32, lo);
        I::store(out + c * 32 + 16, hi);
      }
      return;
    }
    default:
      for (int64_t c = 0; c < chunks; ++c) chunk_codes(W, n, c, out + c * 32);
  }
}

// One panel of W: `lanes` rows' codes as column pairs [K / 2][lanes], their scales and
// offsets [groups][lanes] (rows past W's last: zero codes and scales).
struct CodePanel {
  std::vector<int32_t> pairs;
  std::vector<float> scales, offsets;
  std::vector<int16_t> rows;  // the panel's codes row by row [lanes][K], before the transpose
  bool has_offsets = false;

  void expand(const Weight& W, int64_t n0, int count) {
    constexpr int L = PanelOps::lanes;
    const int64_t K = W.cols, GW = code_group(W), G = K / GW, P = K / 2;
    pairs.resize(P * L);
    rows.resize(L * K);
    std::fill(rows.begin() + count * K, rows.end(), int16_t{0});  // rows past W's last
    scales.assign(G * L, 0.0f);
    offsets.assign(G * L, 0.0f);
    std::vector<float> s(G), o(G, 0.0f);
    has_offsets = false;
    for (int r = 0; r < count; ++r) {
      has_offsets |= row_scales(W, n0 + r, s.data(), o.data());
      for (int64_t g = 0; g < G; ++g) {
        scales[g * L + r] = s[g];
        offsets[g * L + r] = o[g];
      }
      row_codes(W, n0 + r, rows.data() + r * K);
    }
    // Column pairs as one int32 each: a transpose of [L][P] words into [P][L], 8 x 8 at a time
    // (P is a multiple of 16: K comes in 32-column chunks).
    const int32_t* words = reinterpret_cast<const int32_t*>(rows.data());
    for (int r0 = 0; r0 < L; r0 += 8)
      for (int64_t p0 = 0; p0 < P; p0 += 8) transpose8(words + r0 * P + p0, P, pairs.data() + p0 * L + r0, L);
  }

  // dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 8.
  static void transpose8(const int32_t* src, int64_t src_stride, int32_t* dst, int64_t dst_stride) {
    __m256 v[8], t[8];
    for (int r = 0; r < 8; ++r) v[r] = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * src_stride)));
    for (int r = 0; r < 8; r += 2) {  // pairs of rows interleaved, then fours, then the halves swapped
      t[r] = _mm256_unpacklo_ps(v[r], v[r + 1]);
      t[r + 1] = _mm256_unpackhi_ps(v[r], v[r + 1]);
    }
    for (int r = 0; r < 8; r += 4) {
      v[r] = _mm256_shuffle_ps(t[r], t[r + 2], 0x44);
      v[r + 1] = _mm256_shuffle_ps(t[r], t[r + 2], 0xEE);
      v[r + 2] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0x44);
      v[r + 3] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      _mm256_storeu_ps(reinterpret_cast<float*>(dst + c * dst_stride), _mm256_permute2f128_ps(v[c], v[c + 4], 0x20));
      _mm256_storeu_ps(reinterpret_cast<float*>(dst + (c + 4) * dst_stride), _mm256_permute2f128_ps(v[c], v[c + 4], 0x31));
    }
  }
};

// The activation rows quantized for the panels, `PanelOps::rows` (MR) rows at a time: block b
// holds pair p (columns 2p, 2p + 1 as int16 codes) of its row i at pairs[(b * K / 2 + p) * MR + i],
// so one step's MR broadcasts read one cache line; scales [rows, K / 32] and sums [rows, K / GW]
// (x summed per code group, for the offsets' share). Rows past M: zero codes and scales.
struct PairedRows {
  std::vector<int32_t> pairs;
  std::vector<float> scales, sums;
};

// x [M, K] as PairedRows for weights of code group GW; false where a value is NaN or inf.
inline bool pair_rows(const float* x, int64_t M, int64_t K, int64_t GW, int threads, PairedRows& out) {
  constexpr int MR = PanelOps::rows;
  const int64_t blocks = (M + MR - 1) / MR, Ga = K / 32, G = K / GW;
  out.pairs.assign(blocks * MR * K / 2, 0);
  out.scales.assign(blocks * MR * Ga, 0.0f);
  out.sums.assign(blocks * MR * G, 0.0f);
  std::atomic<bool> finite{true};
  parallel_for(M, 16, threads, [&](int64_t m0, int64_t m1) {
    alignas(64) int16_t codes[32];
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      int32_t* dst = out.pairs.data() + (m / MR) * (K / 2) * MR + m % MR;
      for (int64_t g = 0; g < Ga; ++g) {
        if (!quantize_group16(row + g * 32, codes, out.scales.data() + m * Ga + g)) {
          finite.store(false, std::memory_order_relaxed);
          return;
        }
        for (int p = 0; p < 16; ++p) {
          int32_t pair;
          std::memcpy(&pair, codes + 2 * p, 4);
          dst[(g * 16 + p) * MR] = pair;
        }
      }
      for (int64_t g = 0; g < G; ++g) out.sums[m * G + g] = dot(row + g * GW, kOnes, GW);
    }
  });
  return finite.load();
}

// y[m, n0 + r] for the MR activation rows of block b (rows m < M only) and the panel's rows
// r < count: per code group, int32 sums of column pairs, then scaled into fp32.
inline void panel_block(const CodePanel& panel, int64_t K, int64_t GW, const PairedRows& x, int64_t b, int64_t M,
                        float* y, int64_t ldy, int64_t n0, int count, const float* bias) {
  using P = PanelOps;
  constexpr int L = P::lanes, MR = P::rows, R = P::regs, V = P::width;
  const int64_t G = K / GW, step = GW / 2, Ga = K / 32;
  const int32_t* xb = x.pairs.data() + b * (K / 2) * MR;
  const float* xscale = x.scales.data() + b * MR * Ga;
  const float* xsum = x.sums.data() + b * MR * G;
  // The fp32 results live in memory: the int32 sums and the weights take every register.
  alignas(64) float acc[MR][L] = {};
  for (int64_t g = 0; g < G; ++g) {
    typename P::ireg sums[R][MR];
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < MR; ++i) sums[j][i] = P::izero();
    const int32_t* w = panel.pairs.data() + g * step * L;
    const int32_t* xp = xb + g * step * MR;
    for (int64_t p = 0; p < step; ++p, w += L, xp += MR) {
      if constexpr (R == 1) {
        const typename P::ireg wv = P::load(w);
        for (int i = 0; i < MR; ++i) sums[0][i] = P::dot(sums[0][i], wv, xp + i);
      } else {
        typename P::ireg wv[R];
        for (int j = 0; j < R; ++j) wv[j] = P::load(w + j * V);
        for (int i = 0; i < MR; ++i) {
          const typename P::ireg pair = P::broadcast(xp + i);
          for (int j = 0; j < R; ++j) sums[j][i] = P::dot(sums[j][i], wv[j], pair);
        }
      }
    }
    const int64_t ga = g * GW / 32;
    for (int j = 0; j < R; ++j) {
      const typename P::freg ws = P::loadf(panel.scales.data() + g * L + j * V);
      const typename P::freg wo = panel.has_offsets ? P::loadf(panel.offsets.data() + g * L + j * V) : P::fzero();
      for (int i = 0; i < MR; ++i) {
        typename P::freg a = P::fma(P::cvt(sums[j][i]), P::mul(ws, P::set1(xscale[i * Ga + ga])), P::loadf(acc[i] + j * V));
        if (panel.has_offsets) a = P::fma(wo, P::set1(xsum[i * G + g]), a);
        P::storef(acc[i] + j * V, a);
      }
    }
  }
  for (int i = 0; i < MR && b * MR + i < M; ++i) {
    float* out = y + (b * MR + i) * ldy + n0;
    for (int r = 0; r < count; ++r) out[r] = acc[i][r] + (bias ? bias[n0 + r] : 0.0f);
  }
}

#endif

// y[M, N] (row stride ldy) = x[M, K] @ W.T (+ W.bias). False (nothing written) where W has no
// integer path here (has_gemm_a16_path) or x holds a value int16 codes cannot carry.
inline bool gemm_a16(const Weight& W, const float* x, int64_t M, float* y, int64_t ldy, int threads) {
#if TIERLM_ISA >= 256
  if (!has_gemm_a16_path(W)) return false;
  if (W.kind == kStack) {  // each run of rows into its columns of y; a NaN in x stops the first
    int64_t row = 0;
    for (int64_t i = 0; i < W.group; ++i) {
      Weight run = W.runs()[i];
      run.bias = W.bias ? W.bias + row : nullptr;
      if (!gemm_a16(run, x, M, y + row, ldy, threads)) return false;
      row += run.rows;
    }
    return true;
  }
  constexpr int L = PanelOps::lanes, MR = PanelOps::rows;
  const int64_t K = W.cols, N = W.rows, GW = code_group(W);
  PairedRows paired;  // every row quantized before anything is written: a NaN refuses the call
  if (!pair_rows(x, M, K, GW, threads, paired)) return false;
  const int64_t panels = (N + L - 1) / L, blocks = (M + MR - 1) / MR, per_pass = kGemmRowBlock / MR;
  for (int64_t b0 = 0; b0 < blocks; b0 += per_pass) {
    const int64_t b1 = std::min(blocks, b0 + per_pass);
    parallel_for(panels, 1, threads, [&](int64_t p0, int64_t p1) {
      thread_local CodePanel panel;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * L;
        const int count = static_cast<int>(std::min<int64_t>(L, N - n0));
        panel.expand(W, n0, count);
        for (int64_t b = b0; b < b1; ++b) panel_block(panel, K, GW, paired, b, M, y, ldy, n0, count, W.bias);
      }
    });
  }
  return true;
#else
  (void)W, (void)x, (void)M, (void)y, (void)ldy, (void)threads;
  return false;
#endif
}

}  // namespace tl
