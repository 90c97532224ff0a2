// The KV cache formats of tierlm/kv/formats.py, as the fused decode step reads and writes them:
// one head's row of D values at one position is `row_bytes` of codes (and, quantized, D / 32
// fp16 scales in a parallel array). Quantized rows are Hadamard-rotated first (`hadamard`), then
// rounded exactly as llama.cpp's reference quantizers; f16/bf16 round to nearest even. Writes
// equal tierlm/kv/codec.py's byte for byte, so either path fills the cache with the same bytes.
// Reads never widen the cache: scores and the weighted sum read the codes in registers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemv.h"

namespace tl {

enum KVType : int32_t { kKVF32 = 0, kKVF16 = 1, kKVBF16 = 2, kKVQ8 = 3, kKVQ4 = 4 };
constexpr int64_t kKVGroup = 32;

// fp32 -> fp16 bits, round to nearest even (as torch's .half()).
inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(f, 0));  // 0: round to nearest even
#else
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN (quiet)
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (mag < 0x38800000u) {  // below 2^-14: a subnormal half, in units of 2^-24 (exact product)
    float a;
    std::memcpy(&a, &mag, sizeof a);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t h = (mag - 0x38000000u) >> 13;  // rebiased exponent and the top 10 mantissa bits
  const uint32_t rest = mag & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return static_cast<uint16_t>(sign | h);
#endif
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The rotation's block: the largest power of two that divides D (D a multiple of 32).
inline int64_t hadamard_block(int64_t D) {
  int64_t n = 32;
  while (2 * n <= D && D % (2 * n) == 0) n *= 2;
  return n;
}

// x[D] times the orthonormal Walsh-Hadamard matrix of each block (its own inverse): butterflies
// (a + b, a - b) over strides 1, 2, 4, ..., then 1 / sqrt(block). Spreading a head's outlier
// channels over its block makes the quantized formats' per-32 scales fit the rest of it.
inline void hadamard(float* x, int64_t D) {
  const int64_t n = hadamard_block(D);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t b = 0; b < D; b += n)
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = b; i < b + n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], c = x[j + h];
          x[j] = a + c;
          x[j + h] = a - c;
        }
  for (int64_t d = 0; d < D; ++d) x[d] *= scale;
}

// Bytes of one row's codes (scales live apart).
inline int64_t kv_code_bytes(int32_t type, int64_t D) {
  switch (type) {
    case kKVF32: return 4 * D;
    case kKVF16: case kKVBF16: return 2 * D;
    case kKVQ8: return D;
    default: return D / 2;
  }
}

inline bool kv_quantized(int32_t type) { return type == kKVQ8 || type == kKVQ4; }

// Store x[D] as one row: codes (and scales[D / 32] when quantized: of x rotated).
inline void kv_store(int32_t type, const float* values, int64_t D, void* codes, uint16_t* scales) {
  switch (type) {
    case kKVF32: std::memcpy(codes, values, D * sizeof(float)); return;
    case kKVF16: for (int64_t i = 0; i < D; ++i) static_cast<uint16_t*>(codes)[i] = float_to_half(values[i]); return;
    case kKVBF16: for (int64_t i = 0; i < D; ++i) static_cast<uint16_t*>(codes)[i] = float_to_bf16(values[i]); return;
    default: break;
  }
  float rotated[2048];  // D <= 2048 (the decode step refuses larger heads)
  std::memcpy(rotated, values, D * sizeof(float));
  hadamard(rotated, D);
  const float* x = rotated;
  for (int64_t g = 0; g < D / kKVGroup; ++g) {
    const float* b = x + g * kKVGroup;
    if (type == kKVQ8) {
      float amax = 0.0f;
      for (int i = 0; i < kKVGroup; ++i) amax = std::max(amax, std::fabs(b[i]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = static_cast<int8_t*>(codes) + g * kKVGroup;
      for (int i = 0; i < kKVGroup; ++i) q[i] = static_cast<int8_t>(std::round(b[i] * id));
      scales[g] = float_to_half(d);
    } else {  // Q4_0: the value of largest magnitude (the first of equals) maps to -8
      float amax = 0.0f, top = 0.0f;
      for (int i = 0; i < kKVGroup; ++i)
        if (amax < std::fabs(b[i])) amax = std::fabs(b[i]), top = b[i];
      const float d = top / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      uint8_t* q = static_cast<uint8_t*>(codes) + g * kKVGroup / 2;
      for (int i = 0; i < kKVGroup / 2; ++i) {
        const int lo = std::min(15, static_cast<int>(b[i] * id + 8.5f));
        const int hi = std::min(15, static_cast<int>(b[i + kKVGroup / 2] * id + 8.5f));
        q[i] = static_cast<uint8_t>(lo | (hi << 4));
      }
      scales[g] = float_to_half(d);
    }
  }
}

// out[D] = the values one row holds (quantized: its codes' values rotated back).
inline void kv_load(int32_t type, const void* codes, const uint16_t* scales, int64_t D, float* out) {
  switch (type) {
    case kKVF32: std::memcpy(out, codes, D * sizeof(float)); return;
    case kKVF16: for (int64_t i = 0; i < D; ++i) out[i] = half_to_float(static_cast<const uint16_t*>(codes)[i]); return;
    case kKVBF16: for (int64_t i = 0; i < D; ++i) out[i] = bf16_to_float(static_cast<const uint16_t*>(codes)[i]); return;
    default: break;
  }
  for (int64_t g = 0; g < D / kKVGroup; ++g) {
    const float d = half_to_float(scales[g]);
    if (type == kKVQ8) {
      const int8_t* q = static_cast<const int8_t*>(codes) + g * kKVGroup;
      for (int i = 0; i < kKVGroup; ++i) out[g * kKVGroup + i] = static_cast<float>(q[i]) * d;
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(codes) + g * kKVGroup / 2;
      for (int i = 0; i < kKVGroup / 2; ++i) {
        out[g * kKVGroup + i] = static_cast<float>((q[i] & 15) - 8) * d;
        out[g * kKVGroup + i + kKVGroup / 2] = static_cast<float>((q[i] >> 4) - 8) * d;
      }
    }
  }
  hadamard(out, D);
}

inline Vec::reg load_bf16(const uint16_t* p) {
#if TIERLM_ISA == 512
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif TIERLM_ISA == 256
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  Vec::reg r;
  for (int i = 0; i < Vec::lanes; ++i) r[i] = bf16_to_float(p[i]);
  return r;
#endif
}

// The four values of 32 quantized codes as fp32 registers: q8 reads Vec::lanes int8 at a time,
// q4 the low and high nibbles of Vec::lanes bytes (values j.. and 16 + j..), less 8.
template <typename Body>
inline void for_group_codes(int32_t type, const void* codes, int64_t g, Body body) {
  constexpr int L = Vec::lanes;
  if (type == kKVQ8) {
    const int8_t* q = static_cast<const int8_t*>(codes) + g * kKVGroup;
    for (int j = 0; j < kKVGroup; j += L) body(j, Vec::load(q + j));
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(codes) + g * kKVGroup / 2;
    const Vec::reg one = Vec::set1(1.0f), minus8 = Vec::set1(-8.0f);
    for (int j = 0; j < kKVGroup / 2; j += L) {
      Vec::reg lo, hi;
      Vec::nibbles(q + j, lo, hi);
      body(j, Vec::fma(lo, one, minus8));
      body(j + kKVGroup / 2, Vec::fma(hi, one, minus8));
    }
  }
}

// q[D] . row, as stored: a quantized row's codes are of the rotated values (rotate q first).
inline float kv_dot(int32_t type, const float* q, const void* codes, const uint16_t* scales, int64_t D) {
  constexpr int L = Vec::lanes;
  if (type == kKVF32) return dot(q, static_cast<const float*>(codes), D);
  if (type == kKVF16) return dot(static_cast<const uint16_t*>(codes), q, D);
  if (type == kKVBF16) {
    const uint16_t* c = static_cast<const uint16_t*>(codes);
    Vec::reg acc = Vec::zero();
    int64_t i = 0;
    for (; i + L <= D; i += L) acc = Vec::fma(load_bf16(c + i), Vec::load(q + i), acc);
    float s = Vec::sum(acc);
    for (; i < D; ++i) s += bf16_to_float(c[i]) * q[i];
    return s;
  }
  float total = 0.0f;
  for (int64_t g = 0; g < D / kKVGroup; ++g) {
    Vec::reg acc = Vec::zero();
    const float* qg = q + g * kKVGroup;
    for_group_codes(type, codes, g, [&](int j, Vec::reg v) { acc = Vec::fma(v, Vec::load(qg + j), acc); });
    total += half_to_float(scales[g]) * Vec::sum(acc);
  }
  return total;
}

// out[D] += p * row, as stored (a quantized row's sum is rotated: rotate it back after).
inline void kv_axpy(int32_t type, float p, const void* codes, const uint16_t* scales, int64_t D, float* out) {
  constexpr int L = Vec::lanes;
  if (!kv_quantized(type)) {
    const Vec::reg pv = Vec::set1(p);
    int64_t i = 0;
    if (type == kKVF32) {
      const float* c = static_cast<const float*>(codes);
      for (; i + L <= D; i += L) Vec::store(out + i, Vec::fma(Vec::load(c + i), pv, Vec::load(out + i)));
      for (; i < D; ++i) out[i] += p * c[i];
    } else {
      const uint16_t* c = static_cast<const uint16_t*>(codes);
      const bool half = type == kKVF16;
      for (; i + L <= D; i += L) {
        const Vec::reg v = half ? Vec::load_half(c + i) : load_bf16(c + i);
        Vec::store(out + i, Vec::fma(v, pv, Vec::load(out + i)));
      }
      for (; i < D; ++i) out[i] += p * (half ? half_to_float(c[i]) : bf16_to_float(c[i]));
    }
    return;
  }
  for (int64_t g = 0; g < D / kKVGroup; ++g) {
    const Vec::reg pd = Vec::set1(p * half_to_float(scales[g]));
    float* og = out + g * kKVGroup;
    for_group_codes(type, codes, g, [&](int j, Vec::reg v) { Vec::store(og + j, Vec::fma(v, pd, Vec::load(og + j))); });
  }
}

}  // namespace tl
