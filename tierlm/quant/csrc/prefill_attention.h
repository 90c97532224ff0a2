// Attention for the rows of a prefill chunk, a block of them at a time. The queries of one KV
// head (its group's heads at up to kChunkRows consecutive positions) meet the cache a tile of
// kKeyTile positions at a time: each tile's keys and values are read back into fp32 once
// (kv_load, as the eager path reads the cache) and multiplied by every query of the block from
// L1, with a running max and sum per query (an online softmax, as flash attention). The
// single-query loop of attention.h reads each stored row once per query, which at a context of
// 2k measured slower than torch's blocked attention.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "kv_formats.h"

namespace tl {

constexpr int64_t kChunkRows = 16;  // query positions per block (each with the group's heads)
constexpr int64_t kKeyTile = 64;    // key positions per tile (a multiple of every Vec::lanes)

// scores[j] = q . tile column j for the tile's kKeyTile columns (keys transposed: [D][kKeyTile]).
inline void tile_scores(const float* q, const float* keys_t, int64_t D, float* scores) {
  constexpr int L = Vec::lanes, N = kKeyTile / L;
  Vec::reg acc[N];
  for (int v = 0; v < N; ++v) acc[v] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    const Vec::reg qv = Vec::set1(q[d]);
    const float* column = keys_t + d * kKeyTile;
    for (int v = 0; v < N; ++v) acc[v] = Vec::fma(Vec::load(column + v * L), qv, acc[v]);
  }
  for (int v = 0; v < N; ++v) Vec::store(scores + v * L, acc[v]);
}

// out[D] += sum over j in [a, b) of p[j] * values[j] (the tile's rows [kKeyTile][D]), D values
// a block of registers at a time where D is a multiple of Vec::lanes.
inline void tile_sum(const float* p, const float* values, int64_t a, int64_t b, int64_t D, float* out) {
  constexpr int L = Vec::lanes, R = 8;
  int64_t d0 = 0;
  if (D % L == 0) {
    for (; d0 + R * L <= D; d0 += R * L) {
      Vec::reg acc[R];
      for (int r = 0; r < R; ++r) acc[r] = Vec::load(out + d0 + r * L);
      for (int64_t j = a; j < b; ++j) {
        const Vec::reg pv = Vec::set1(p[j]);
        for (int r = 0; r < R; ++r) acc[r] = Vec::fma(Vec::load(values + j * D + d0 + r * L), pv, acc[r]);
      }
      for (int r = 0; r < R; ++r) Vec::store(out + d0 + r * L, acc[r]);
    }
    for (; d0 < D; d0 += L) {
      Vec::reg acc = Vec::load(out + d0);
      for (int64_t j = a; j < b; ++j) acc = Vec::fma(Vec::load(values + j * D + d0), Vec::set1(p[j]), acc);
      Vec::store(out + d0, acc);
    }
    return;
  }
  for (int64_t j = a; j < b; ++j)
    for (int64_t d = 0; d < D; ++d) out[d] += p[j] * values[j * D + d];
}

// Attention of R consecutive positions pos[0..R) (ascending) of one KV head's group of G query
// heads: query (r, h) at q + r * ldq + h * D, its output at out + r * ldo + h * D, over the
// stored keys and values at positions [start, pos[r]], start = pos[r] - window + 1 (window > 0)
// or 0. Every position in that span must be stored.
inline void attend_block(const StoredRows& keys, const StoredRows& values, const float* q, int64_t ldq, int64_t G,
                         int64_t D, const int64_t* pos, int64_t R, int64_t window, float* out, int64_t ldo) {
  const int64_t queries = R * G;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> scaled(queries * D), acc(queries * D, 0.0f), top(queries, -INFINITY), total(queries, 0.0f);
  std::vector<float> keys_t(D * kKeyTile, 0.0f), tile(kKeyTile * D), row(D), scores(kKeyTile);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) scaled[(r * G + h) * D + d] = q[r * ldq + h * D + d] * scale;
  auto first_of = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : int64_t{0}; };
  const int64_t last = pos[R - 1];
  for (int64_t j0 = first_of(pos[0]); j0 <= last; j0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last - j0 + 1);
    for (int64_t j = 0; j < n; ++j) {
      kv_load(keys.type(), keys.codes(j0 + j), keys.scales_of(j0 + j), D, row.data());
      for (int64_t d = 0; d < D; ++d) keys_t[d * kKeyTile + j] = row[d];
      kv_load(values.type(), values.codes(j0 + j), values.scales_of(j0 + j), D, tile.data() + j * D);
    }
    for (int64_t r = 0; r < R; ++r) {
      // This row's positions in the tile: [a, b) of its columns.
      const int64_t a = std::max(first_of(pos[r]), j0) - j0, b = std::min(pos[r] + 1, j0 + n) - j0;
      if (b <= a) continue;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t i = r * G + h;
        tile_scores(scaled.data() + i * D, keys_t.data(), D, scores.data());
        float m = top[i];
        for (int64_t j = a; j < b; ++j) m = std::max(m, scores[j]);
        const float kept = exp_nonpositive(top[i] - m);  // the earlier tiles' share (0 at first)
        exp_shifted(scores.data() + a, b - a, m);
        float sum = 0.0f;
        for (int64_t j = a; j < b; ++j) sum += scores[j];
        total[i] = total[i] * kept + sum;
        top[i] = m;
        float* o = acc.data() + i * D;
        if (kept != 1.0f)
          for (int64_t d = 0; d < D; ++d) o[d] *= kept;
        tile_sum(scores.data(), tile.data(), a, b, D, o);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t i = r * G + h;
      const float inv = 1.0f / total[i];
      for (int64_t d = 0; d < D; ++d) out[r * ldo + h * D + d] = acc[i * D + d] * inv;
    }
}

}  // namespace tl
