// One decoder layer's decode step for B rows (one new token each) in five pool phases:
//
//   h = RMSNorm(x)                      (caller thread)
//   qkv = h @ Wqkv.T + bqkv             phase 1: tiles of rows
//   per (row, query head): q/k head norm (Qwen3), RoPE, the K/V write into the row's cache
//   slot (by the first query head of each KV group), attention over the row's span with a
//   max-subtracted softmax                                     phase 2: one item per head
//   x += attn @ Wo.T + bo               phase 3
//   h = RMSNorm(x)                      (caller thread)
//   act = SiLU(h @ Wg.T + bg) * (h @ Wu.T + bu), gate and up rows of a tile in one task
//                                       phase 4 (a row stack's runs one after the other)
//   x += act @ W2.T + b2                phase 5
//
// The layout of LayerArgs is mirrored by `LayerArgs` in tierlm/models/fused_decode.py.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "attention.h"
#include "gemv.h"
#include "kv_formats.h"

namespace tl {

struct LayerArgs {
  Weight qkv, o, w13, w2;
  const float* attn_norm;
  const float* mlp_norm;
  const float* q_norm;  // [head_dim] or null (Qwen3's per-head norms)
  const float* k_norm;
  const float* cos;  // [max_len, rotary_dim], laid out as models/base.py RotaryTable
  const float* sin;
  // This layer's codes in kv_type (kv_formats.h): [slots, n_kv, max_len, row], or paged
  // (page_shift > 0) [n_kv, pages, 2^page_shift, row] with max_len = pages * 2^page_shift (one
  // head's positions); fp16 scales likewise [..., head_dim / 32] (quantized types), else null.
  void* keys;
  void* values;
  uint16_t* key_scales;
  uint16_t* value_scales;
  const int64_t* slots;        // [batch]: each row's cache slot (slot layout)
  const int64_t* positions;    // [batch]: where each row's new token goes
  const int64_t* page_tables;  // [batch, table_width]: each row's pages in order (paged layout)
  int64_t batch, hidden, n_q, n_kv, head_dim, inter, rotary_dim, max_len, window;  // window 0: none
  int64_t table_width;
  float eps;
  int32_t interleaved;  // RoPE pairs (2i, 2i+1) instead of (i, i + rotary_dim/2)
  int32_t threads;
  int32_t kv_type;     // tl::KVType
  int32_t page_shift;  // 0: the slot layout; else log2 of a page's positions
};

// out = x * rsqrt(mean(x^2) + eps) * w over n values (torch's F.rms_norm order).
inline void rms_norm(const float* x, int64_t n, const float* w, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// Rotate the first R channels of one head in place (models/base.py apply_rope).
inline void rope(float* v, const float* cos, const float* sin, int64_t R, bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < R; i += 2) {
      const float a = v[i], b = v[i + 1];
      v[i] = a * cos[i] - b * sin[i];
      v[i + 1] = b * cos[i + 1] + a * sin[i + 1];
    }
  } else {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// One query head of one row: its q (and the KV head's new k, v), the cache write, attention.
inline void attend_head(const LayerArgs& a, const float* qkv, int64_t b, int64_t hq, float* out) {
  const int64_t D = a.head_dim, groups = a.n_q / a.n_kv, kvh = hq / groups;
  const int64_t pos = a.positions[b], slot = a.slots[b];
  std::vector<float> buf(2 * D + pos + 1);
  float *q = buf.data(), *k = q + D, *scores = k + D;
  const float* row = qkv + b * (a.n_q + 2 * a.n_kv) * D;
  const float* v = row + (a.n_q + a.n_kv + kvh) * D;
  if (a.q_norm) rms_norm(row + hq * D, D, a.q_norm, a.eps, q);
  else std::memcpy(q, row + hq * D, D * sizeof(float));
  if (a.k_norm) rms_norm(row + (a.n_q + kvh) * D, D, a.k_norm, a.eps, k);
  else std::memcpy(k, row + (a.n_q + kvh) * D, D * sizeof(float));
  const float* cs = a.cos + pos * a.rotary_dim;
  const float* sn = a.sin + pos * a.rotary_dim;
  rope(q, cs, sn, a.rotary_dim, a.interleaved);
  rope(k, cs, sn, a.rotary_dim, a.interleaved);
  const int32_t type = a.kv_type;
  const int64_t row_bytes = kv_code_bytes(type, D), groups_per_row = kv_quantized(type) ? D / kKVGroup : 0;
  const bool paged = a.page_shift > 0;
  // The head's first row: of its slot (slot layout) or of its region's page 0 (paged).
  const int64_t head_row = (paged ? kvh : slot * a.n_kv + kvh) * a.max_len;
  char* kc = static_cast<char*>(a.keys) + head_row * row_bytes;
  char* vc = static_cast<char*>(a.values) + head_row * row_bytes;
  uint16_t* ks = a.key_scales ? a.key_scales + head_row * groups_per_row : nullptr;
  uint16_t* vs = a.value_scales ? a.value_scales + head_row * groups_per_row : nullptr;
  StoredRows keys{{type, kc, ks, row_bytes, groups_per_row}}, values{{type, vc, vs, row_bytes, groups_per_row}};
  if (paged) {
    for (StoredRows* rows : {&keys, &values}) {
      rows->pages = a.page_tables + b * a.table_width;
      rows->page_shift = a.page_shift;
    }
  }
  // The group's first head writes the new key/value; the others read only earlier positions,
  // so no head waits for another. The new position is read from each head's own copy of what
  // the cache holds for it (the row as stored, then read back), so every head sees the same.
  if (hq % groups == 0) {
    const int64_t at = keys.row(pos);
    kv_store(type, k, D, kc + at * row_bytes, ks ? ks + at * groups_per_row : nullptr);
    kv_store(type, v, D, vc + at * row_bytes, vs ? vs + at * groups_per_row : nullptr);
  }
  std::vector<float> fresh(2 * D);
  float *k_new = fresh.data(), *v_new = k_new + D;
  if (type != kKVF32) {
    std::vector<char> stored(2 * row_bytes);
    uint16_t stored_scales[2 * 64];  // D / 32 per row; D <= 2048
    kv_store(type, k, D, stored.data(), stored_scales);
    kv_store(type, v, D, stored.data() + row_bytes, stored_scales + 64);
    kv_load(type, stored.data(), stored_scales, D, k_new);
    kv_load(type, stored.data() + row_bytes, stored_scales + 64, D, v_new);
  } else {
    std::memcpy(k_new, k, D * sizeof(float));
    std::memcpy(v_new, v, D * sizeof(float));
  }
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  attend_stored(keys, values, q, D, start, pos, k_new, v_new, scores, out);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// x += attention(RMSNorm(x)) @ Wo.T + bo: the layer's first half (all of a mixture-of-experts
// layer that runs natively: its router and experts run in torch after it).
inline void decode_attention(const LayerArgs& a, float* x) {
  const int64_t B = a.batch, H = a.hidden, D = a.head_dim;
  const int64_t Nqkv = (a.n_q + 2 * a.n_kv) * D, Q = a.n_q * D;
  const int threads = a.threads;
  std::vector<float> h(B * H), qkv(B * Nqkv), attn(B * Q);

  for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, H, a.attn_norm, a.eps, h.data() + b * H);
  std::vector<float> xs = group_sums(a.qkv, h.data(), H, B);
  gemv(a.qkv, h.data(), H, B, xs.data(), qkv.data(), Nqkv, false, threads);

  parallel_for(B * a.n_q, 1, threads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / a.n_q, hq = i % a.n_q;
      attend_head(a, qkv.data(), b, hq, attn.data() + b * Q + hq * D);
    }
  });

  xs = group_sums(a.o, attn.data(), Q, B);
  gemv(a.o, attn.data(), Q, B, xs.data(), x, H, true, threads);
}

inline void decode_layer(const LayerArgs& a, float* x) {
  const int64_t B = a.batch, H = a.hidden, I = a.inter;
  const int threads = a.threads;
  decode_attention(a, x);
  std::vector<float> h(B * H), gate(B * I), up(B * I);
  for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, H, a.mlp_norm, a.eps, h.data() + b * H);
  if (a.w13.kind == kStack) {  // gate and up stored apart: each run by its own kernel, then SiLU
    std::vector<float> both(B * 2 * I);
    gemv(a.w13, h.data(), H, B, nullptr, both.data(), 2 * I, false, threads);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < I; ++i) gate[b * I + i] = silu(both[b * 2 * I + i]) * both[b * 2 * I + I + i];
  } else {
    const std::vector<float> xs = group_sums(a.w13, h.data(), H, B);
    const Activations16 h16 = quantize16(a.w13, h.data(), H, B);
    const int64_t R = rows_per_tile(B), tiles = (I + R - 1) / R;
    parallel_for(tiles, tile_grain(tiles, threads), threads, [&](int64_t t0, int64_t t1) {
      const int64_t i0 = t0 * R, i1 = std::min(I, t1 * R);
      gemv_rows(a.w13, h.data(), H, B, xs.data(), i0, i1, gate.data() + i0, I, false, &h16);
      gemv_rows(a.w13, h.data(), H, B, xs.data(), I + i0, I + i1, up.data() + i0, I, false, &h16);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = i0; i < i1; ++i) gate[b * I + i] = silu(gate[b * I + i]) * up[b * I + i];
    });
  }

  std::vector<float> xs = group_sums(a.w2, gate.data(), I, B);
  gemv(a.w2, gate.data(), I, B, xs.data(), x, H, true, threads);
}

}  // namespace tl
