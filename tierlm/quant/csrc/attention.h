// Single-query attention over a KV head's stored rows (kv_formats.h), the decode step's inner
// loop: its cost grows with the context, so it is written for it. Scores are taken four
// positions at a time (four independent FMA chains: one chain is latency-bound), the softmax
// exponent is a branch-free polynomial the compiler vectorizes, and the weighted sum keeps its
// accumulators in registers across positions, a block of the head's values at a time.
// Quantized rows are read as codes: each group's scale multiplies the query (scores) or the
// weight (sums), never a dequantized copy; their codes are of rotated values (kv_formats.h
// `hadamard`), so the query is rotated once and the stored rows' weighted sum rotated back once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemv.h"
#include "kv_formats.h"

namespace tl {

// A run of one KV head's rows stored one after another: position t's codes at
// data + t * row_bytes, its scales (quantized types) at scales + t * groups. The loops below
// read runs, so their address arithmetic has no branch.
struct RowRun {
  int32_t type;
  const char* data;
  const uint16_t* scales;
  int64_t row_bytes, groups;
  const void* codes(int64_t t) const { return data + t * row_bytes; }
  const uint16_t* scales_of(int64_t t) const { return scales ? scales + t * groups : nullptr; }
};

// One KV head's rows as a cache holds them: one run (`pages` null), or paged: position t lies
// in page pages[t >> page_shift] at row t & (2^page_shift - 1), i.e. row
// pages[t >> page_shift] * 2^page_shift + that of the head's region (`run` points at its row 0:
// the cache is head-major, kv/paged.py).
struct StoredRows {
  RowRun run;
  const int64_t* pages = nullptr;
  int32_t page_shift = 0;
  int32_t type() const { return run.type; }
  int64_t row(int64_t t) const {
    if (!pages) return t;
    return (pages[t >> page_shift] << page_shift) + (t & ((int64_t{1} << page_shift) - 1));
  }
  const void* codes(int64_t t) const { return run.codes(row(t)); }
  const uint16_t* scales_of(int64_t t) const { return run.scales_of(row(t)); }
};

// body(run, first, a, b) for the positions [t0, t1) in runs of rows stored one after another
// (one run for unpaged rows; paged, a run per stretch of consecutively numbered pages, which a
// pool hands out in order): position t is the run's row t - first.
template <typename Body>
inline void for_runs(const StoredRows& rows, int64_t t0, int64_t t1, Body body) {
  if (!rows.pages) return body(rows.run, int64_t{0}, t0, t1);
  const int32_t shift = rows.page_shift;
  const int64_t size = int64_t{1} << shift;
  for (int64_t a = t0; a < t1;) {
    const int64_t first = a & ~(size - 1);
    int64_t b = std::min(t1, first + size);
    while (b < t1 && rows.pages[b >> shift] == rows.pages[(b - 1) >> shift] + 1) b = std::min(t1, b + size);
    const int64_t row = rows.pages[a >> shift] << shift;
    RowRun run = rows.run;
    run.data += row * run.row_bytes;
    if (run.scales) run.scales += row * run.groups;
    body(run, first, a, b);
    a = b;
  }
}

// exp(x) for x <= 0 (softmax after the max is subtracted): Cody-Waite reduction and a degree-6
// polynomial, within 1e-7 relative of exp over [-87, 0]; 0 below. Plain arithmetic (rounding by
// the 1.5 * 2^23 shift), so a loop of it vectorizes on every target.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const float n = (clamped * 1.44269504088896341f + shift) - shift;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return x < -87.0f ? 0.0f : out;
}

#if TIERLM_ISA >= 256
// exp_nonpositive of 8 values at once (the same steps; 0 below -87).
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.0f), shift = _mm256_set1_ps(12582912.0f);
  const __m256 clamped = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504088896341f), shift), shift);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i power = _mm256_slli_epi32(_mm256_cvttps_epi32(n), 23);
  const __m256 out = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), power));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ), out);
}
#endif

// v[i] = exp_nonpositive(v[i] - top) for i < n, 8 at a time in registers where the build has them.
inline void exp_shifted(float* v, int64_t n, float top) {
  int64_t i = 0;
#if TIERLM_ISA >= 256
  const __m256 t = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(v + i), t)));
#endif
  for (; i < n; ++i) v[i] = exp_nonpositive(v[i] - top);
}

// Vec::lanes values of a float-format row from value d on.
template <int32_t T>
inline Vec::reg load_values(const void* codes, int64_t d) {
  if constexpr (T == kKVF32) return Vec::load(static_cast<const float*>(codes) + d);
  else if constexpr (T == kKVF16) return Vec::load_half(static_cast<const uint16_t*>(codes) + d);
  else return load_bf16(static_cast<const uint16_t*>(codes) + d);
}

// scores[i] = q . row(t0 + i) * scale for i < N (N rows at once: N independent chains).
template <int32_t T, int N>
inline void dot_rows(const RowRun& k, const float* q, int64_t D, int64_t t0, float scale, float* scores) {
  constexpr int L = Vec::lanes;
  Vec::reg acc[N];
  for (int i = 0; i < N; ++i) acc[i] = Vec::zero();
  if constexpr (T == kKVQ8 || T == kKVQ4) {
    for (int64_t g = 0; g < D / kKVGroup; ++g) {
      const float* qg = q + g * kKVGroup;
      for (int i = 0; i < N; ++i) {
        const Vec::reg sv = Vec::set1(half_to_float(k.scales_of(t0 + i)[g]));
        for_group_codes(T, k.codes(t0 + i), g, [&](int j, Vec::reg v) {
          acc[i] = Vec::fma(v, Vec::fma(Vec::load(qg + j), sv, Vec::zero()), acc[i]);
        });
      }
    }
  } else {
    for (int64_t d = 0; d < D; d += L) {
      const Vec::reg qv = Vec::load(q + d);
      for (int i = 0; i < N; ++i) acc[i] = Vec::fma(load_values<T>(k.codes(t0 + i), d), qv, acc[i]);
    }
  }
  for (int i = 0; i < N; ++i) scores[i] = Vec::sum(acc[i]) * scale;
}

// out[d0, d0 + R * lanes) += sum over t in [t0, t1) of p[t - t0] * row(t) (float formats).
template <int32_t T, int R>
inline void sum_block(const RowRun& v, const float* p, int64_t t0, int64_t t1, int64_t d0, float* out) {
  constexpr int L = Vec::lanes;
  Vec::reg acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Vec::load(out + d0 + r * L);
  for (int64_t t = t0; t < t1; ++t) {
    const Vec::reg pv = Vec::set1(p[t - t0]);
    const void* row = v.codes(t);
    for (int r = 0; r < R; ++r) acc[r] = Vec::fma(load_values<T>(row, d0 + r * L), pv, acc[r]);
  }
  for (int r = 0; r < R; ++r) Vec::store(out + d0 + r * L, acc[r]);
}

// The same for G quantized groups from group g0 (their 32 * G values held in registers).
template <int32_t T, int G>
inline void sum_groups(const RowRun& v, const float* p, int64_t t0, int64_t t1, int64_t g0, float* out) {
  constexpr int L = Vec::lanes, per_group = kKVGroup / L;
  Vec::reg acc[G * per_group];
  float* base = out + g0 * kKVGroup;
  for (int r = 0; r < G * per_group; ++r) acc[r] = Vec::load(base + r * L);
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* scales = v.scales_of(t);
    for (int g = 0; g < G; ++g) {
      const Vec::reg pv = Vec::set1(p[t - t0] * half_to_float(scales[g0 + g]));
      for_group_codes(T, v.codes(t), g0 + g,
                      [&](int j, Vec::reg x) { acc[g * per_group + j / L] = Vec::fma(x, pv, acc[g * per_group + j / L]); });
    }
  }
  for (int r = 0; r < G * per_group; ++r) Vec::store(base + r * L, acc[r]);
}

// The head's values in blocks of at most 8 registers, the widest first, so a head of 64 values
// with 16 lanes is one pass of 4 registers over the positions, not four passes of one.
template <int32_t T, int R>
inline int64_t sum_blocks(const RowRun& v, const float* p, int64_t D, int64_t t0, int64_t t1, int64_t d, float* out) {
  constexpr int L = Vec::lanes;
  for (; d + R * L <= D; d += R * L) sum_block<T, R>(v, p, t0, t1, d, out);
  if constexpr (R > 1) return sum_blocks<T, R / 2>(v, p, D, t0, t1, d, out);
  return d;
}

template <int32_t T, int G>
inline int64_t sum_group_blocks(const RowRun& v, const float* p, int64_t groups, int64_t t0, int64_t t1,
                                int64_t g, float* out) {
  for (; g + G <= groups; g += G) sum_groups<T, G>(v, p, t0, t1, g, out);
  if constexpr (G > 1) return sum_group_blocks<T, G / 2>(v, p, groups, t0, t1, g, out);
  return g;
}

template <int32_t T>
inline void weighted_sum(const RowRun& v, const float* p, int64_t D, int64_t t0, int64_t t1, float* out) {
  constexpr int L = Vec::lanes;
  if constexpr (T == kKVQ8 || T == kKVQ4) {
    // Up to 8 registers of accumulators: 4 groups of 16 lanes, 2 of 8, 1 of 4.
    constexpr int G = 8 * L / kKVGroup > 0 ? 8 * L / kKVGroup : 1;
    sum_group_blocks<T, G>(v, p, D / kKVGroup, t0, t1, 0, out);
  } else {
    sum_blocks<T, 8>(v, p, D, t0, t1, 0, out);
  }
}

// out[D] = softmax(q . k_t / sqrt(D)) . v_t over t in [start, pos] (max-subtracted), the stored
// rows read in registers; position pos is k_new/v_new (what the cache holds for it, as floats).
// `scores` has room for pos - start + 1 values. D a multiple of Vec::lanes (and of 32 when
// quantized: kv_formats.h).
template <int32_t T>
inline void attend_typed(const StoredRows& keys, const StoredRows& values, const float* q, int64_t D,
                         int64_t start, int64_t pos, const float* k_new, const float* v_new, float* scores,
                         float* out) {
  constexpr bool rotated = T == kKVQ8 || T == kKVQ4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float turned[2048];  // q rotated as the stored keys are (D <= 2048)
  const float* qs = q;
  if constexpr (rotated) {
    std::memcpy(turned, q, D * sizeof(float));
    hadamard(turned, D);
    qs = turned;
  }
  for_runs(keys, start, pos, [&](const RowRun& run, int64_t first, int64_t a, int64_t b) {
    int64_t t = a;
    for (; t + 4 <= b; t += 4) dot_rows<T, 4>(run, qs, D, t - first, scale, scores + (t - start));
    for (; t < b; ++t) dot_rows<T, 1>(run, qs, D, t - first, scale, scores + (t - start));
  });
  scores[pos - start] = dot(q, k_new, D) * scale;
  const int64_t n = pos - start + 1;
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, scores[i]);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) scores[i] = exp_nonpositive(scores[i] - top);
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += scores[i];
  std::fill(out, out + D, 0.0f);
  for_runs(values, start, pos, [&](const RowRun& run, int64_t first, int64_t a, int64_t b) {
    weighted_sum<T>(run, scores + (a - start), D, a - first, b - first, out);
  });
  if constexpr (rotated) hadamard(out, D);
  const float last = scores[pos - start], inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = (out[d] + last * v_new[d]) * inv;
}

// The loop above for heads of a multiple of Vec::lanes values (every common head size), one
// position at a time otherwise (float formats only: quantized heads are multiples of 32).
inline void attend_any(const StoredRows& keys, const StoredRows& values, const float* q, int64_t D, int64_t start,
                       int64_t pos, const float* k_new, const float* v_new, float* scores, float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float top = -INFINITY;
  for (int64_t t = start; t <= pos; ++t) {
    const float s = (t == pos ? dot(q, k_new, D) : kv_dot(keys.type(), q, keys.codes(t), keys.scales_of(t), D)) * scale;
    scores[t - start] = s;
    top = std::max(top, s);
  }
  float total = 0.0f;
  for (int64_t t = start; t <= pos; ++t) total += scores[t - start] = exp_nonpositive(scores[t - start] - top);
  std::fill(out, out + D, 0.0f);
  for (int64_t t = start; t < pos; ++t) kv_axpy(values.type(), scores[t - start], values.codes(t), values.scales_of(t), D, out);
  const float last = scores[pos - start], inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = (out[d] + last * v_new[d]) * inv;
}

inline void attend_stored(const StoredRows& keys, const StoredRows& values, const float* q, int64_t D,
                          int64_t start, int64_t pos, const float* k_new, const float* v_new, float* scores,
                          float* out) {
  if (D % Vec::lanes) return attend_any(keys, values, q, D, start, pos, k_new, v_new, scores, out);
  switch (keys.type()) {
    case kKVF32: return attend_typed<kKVF32>(keys, values, q, D, start, pos, k_new, v_new, scores, out);
    case kKVF16: return attend_typed<kKVF16>(keys, values, q, D, start, pos, k_new, v_new, scores, out);
    case kKVBF16: return attend_typed<kKVBF16>(keys, values, q, D, start, pos, k_new, v_new, scores, out);
    case kKVQ8: return attend_typed<kKVQ8>(keys, values, q, D, start, pos, k_new, v_new, scores, out);
    default: return attend_typed<kKVQ4>(keys, values, q, D, start, pos, k_new, v_new, scores, out);
  }
}

}  // namespace tl
