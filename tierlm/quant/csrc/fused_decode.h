// One decoder layer's step for B rows in five pool phases. The rows are one new token each of
// B sequences (a decode step), or B consecutive positions of one sequence (`sequence`: a
// prefill chunk, whose keys and values are all stored before any row attends).
//
//   h = RMSNorm(x)                      (caller thread; a prefill chunk's rows in parallel)
//   qkv = h @ Wqkv.T + bqkv             phase 1: tiles of rows (a chunk: the integer GEMM)
//   per (row, query head): q/k head norm (Qwen3), RoPE, the K/V write into the row's cache
//   slot (by the first query head of each KV group), attention over the row's span with a
//   max-subtracted softmax                                     phase 2: one item per head
//   (a chunk: the writes per row first, then attention per (KV head, block of rows))
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
#include "gemm_a16.h"
#include "gemv.h"
#include "kv_formats.h"
#include "prefill_attention.h"

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
  int32_t sequence;    // 1: the rows are positions of row 0's sequence (its slot, its page table)
  // Rows up to which the products take the integer decode kernels, each row computed as alone
  // (gemv_a16.h kA16PartRows at most): decode batches and verification passes; a prompt's 4.
  int32_t integer_rows;
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

// KV head kvh's rows in the cache of `slot` (slot layout) or through page table `table` (paged).
inline void head_rows(const LayerArgs& a, int64_t slot, int64_t table, int64_t kvh, StoredRows& keys,
                      StoredRows& values) {
  const int32_t type = a.kv_type;
  const int64_t D = a.head_dim, row_bytes = kv_code_bytes(type, D);
  const int64_t groups_per_row = kv_quantized(type) ? D / kKVGroup : 0;
  const bool paged = a.page_shift > 0;
  // The head's first row: of its slot (slot layout) or of its region's page 0 (paged).
  const int64_t head_row = (paged ? kvh : slot * a.n_kv + kvh) * a.max_len;
  const char* kc = static_cast<const char*>(a.keys) + head_row * row_bytes;
  const char* vc = static_cast<const char*>(a.values) + head_row * row_bytes;
  const uint16_t* ks = a.key_scales ? a.key_scales + head_row * groups_per_row : nullptr;
  const uint16_t* vs = a.value_scales ? a.value_scales + head_row * groups_per_row : nullptr;
  keys = StoredRows{{type, kc, ks, row_bytes, groups_per_row}};
  values = StoredRows{{type, vc, vs, row_bytes, groups_per_row}};
  if (paged) {
    for (StoredRows* rows : {&keys, &values}) {
      rows->pages = a.page_tables + table * a.table_width;
      rows->page_shift = a.page_shift;
    }
  }
}

// Position pos of `rows` := v [D] in the rows' format (the cache's storage is writable: the
// runs only read it as const).
inline void store_row(const StoredRows& rows, int64_t pos, const float* v, int64_t D) {
  const int64_t at = rows.row(pos);
  uint16_t* scales = const_cast<uint16_t*>(rows.run.scales_of(at));
  kv_store(rows.type(), v, D, const_cast<void*>(rows.run.codes(at)), scales);
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
  const int64_t row_bytes = kv_code_bytes(type, D);
  StoredRows keys, values;
  head_rows(a, slot, b, kvh, keys, values);
  // The group's first head writes the new key/value; the others read only earlier positions,
  // so no head waits for another. The new position is read from each head's own copy of what
  // the cache holds for it (the row as stored, then read back), so every head sees the same.
  if (hq % groups == 0) {
    store_row(keys, pos, k, D);
    store_row(values, pos, v, D);
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

// SiLU(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) so the exponent is never positive:
// 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

// out[i] = SiLU(gate[i]) * up[i] (out may be gate), 8 at a time in registers where the build
// has them (one value at a time, std::exp, measured a tenth of a prefill). The last few go
// through the registers too: a value's result must not depend on where a thread's share of
// the row begins (decode splits rows by thread count; a pipeline's stages run one thread).
inline void silu_times(const float* gate, const float* up, int64_t n, float* out) {
#if TIERLM_ISA >= 256
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  auto eight = [&](const float* g8, const float* u8, float* o8) {
    const __m256 g = _mm256_loadu_ps(g8);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
    _mm256_storeu_ps(o8, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(u8)));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) eight(gate + i, up + i, out + i);
  if (i < n) {
    alignas(32) float g8[8] = {}, u8[8] = {}, o8[8];
    std::memcpy(g8, gate + i, (n - i) * sizeof(float));
    std::memcpy(u8, up + i, (n - i) * sizeof(float));
    eight(g8, u8, o8);
    std::memcpy(out + i, o8, (n - i) * sizeof(float));
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
#endif
}

// out[b] = RMSNorm(x[b]) for B rows of n values, in parallel for a prefill chunk's rows.
inline void norm_rows(const float* x, int64_t B, int64_t n, const float* w, float eps, float* out, int threads) {
  parallel_for(B, 16, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rms_norm(x + b * n, n, w, eps, out + b * n);
  });
}

// y[M, ldy] (+)= x[M, W.cols] @ W.T (+ bias): the integer GEMM for a prefill chunk's rows, the
// decode kernels for fewer rows, for weights without a GEMM path and for x it cannot carry.
inline void rows_product(const Weight& W, const float* x, int64_t M, float* y, int64_t ldy, bool accumulate,
                         int threads, int64_t integer_rows) {
  if (M > kGemmMinRows && has_gemm_a16_path(W)) {
    if (!accumulate && gemm_a16(W, x, M, y, ldy, threads)) return;
    if (accumulate) {
      std::vector<float> part(M * W.rows);
      if (gemm_a16(W, x, M, part.data(), W.rows, threads)) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < W.rows; ++n) y[m * ldy + n] += part[m * W.rows + n];
        return;
      }
    }
  }
  const std::vector<float> xs = group_sums(W, x, W.cols, M);
  gemv(W, x, W.cols, M, xs.data(), y, ldy, accumulate, threads, integer_rows);
}

// x += attention(RMSNorm(x)) @ Wo.T + bo for rows that are consecutive positions of one
// sequence (a prefill chunk): every row's key and value are stored first, then each KV head's
// queries attend over the cache a block of rows at a time (prefill_attention.h), every position
// read back as stored (as the eager path reads the cache back).
inline void prefill_attention(const LayerArgs& a, float* x) {
  const int64_t T = a.batch, H = a.hidden, D = a.head_dim, nq = a.n_q, nkv = a.n_kv;
  const int64_t width = (nq + 2 * nkv) * D, Q = nq * D, groups = nq / nkv;
  const int threads = a.threads;
  std::vector<float> h(T * H), qkv(T * width), attn(T * Q);
  norm_rows(x, T, H, a.attn_norm, a.eps, h.data(), threads);
  rows_product(a.qkv, h.data(), T, qkv.data(), width, false, threads, a.integer_rows);
  std::vector<StoredRows> keys(nkv), values(nkv);
  for (int64_t kvh = 0; kvh < nkv; ++kvh) head_rows(a, a.slots[0], 0, kvh, keys[kvh], values[kvh]);
  parallel_for(T, 1, threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = qkv.data() + t * width;
      const int64_t pos = a.positions[t];
      const float* cs = a.cos + pos * a.rotary_dim;
      const float* sn = a.sin + pos * a.rotary_dim;
      for (int64_t head = 0; head < nq + nkv; ++head) {  // queries, then keys: normed, rotated
        float* v = row + head * D;
        const float* norm = head < nq ? a.q_norm : a.k_norm;
        if (norm) rms_norm(v, D, norm, a.eps, v);
        rope(v, cs, sn, a.rotary_dim, a.interleaved);
      }
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        store_row(keys[kvh], pos, row + (nq + kvh) * D, D);
        store_row(values[kvh], pos, row + (nq + nkv + kvh) * D, D);
      }
    }
  });
  // One item per (KV head, block of rows), the blocks with the longest spans first.
  const int64_t blocks = (T + kChunkRows - 1) / kChunkRows;
  parallel_for(nkv * blocks, 1, threads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kvh = i % nkv, t0 = (blocks - 1 - i / nkv) * kChunkRows, rows = std::min(kChunkRows, T - t0);
      const int64_t head = kvh * groups * D;  // the group's first query head
      attend_block(keys[kvh], values[kvh], qkv.data() + t0 * width + head, width, groups, D, a.positions + t0, rows,
                   a.window, attn.data() + t0 * Q + head, Q);
    }
  });
  rows_product(a.o, attn.data(), T, x, H, true, threads, a.integer_rows);
}

// x += attention(RMSNorm(x)) @ Wo.T + bo: the layer's first half (all of a mixture-of-experts
// layer that runs natively: its router and experts run in torch after it).
inline void decode_attention(const LayerArgs& a, float* x) {
  if (a.sequence && a.batch > 1) return prefill_attention(a, x);
  const int64_t B = a.batch, H = a.hidden, D = a.head_dim;
  const int64_t Nqkv = (a.n_q + 2 * a.n_kv) * D, Q = a.n_q * D;
  const int threads = a.threads;
  std::vector<float> h(B * H), qkv(B * Nqkv), attn(B * Q);

  for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, H, a.attn_norm, a.eps, h.data() + b * H);
  std::vector<float> xs = group_sums(a.qkv, h.data(), H, B);
  gemv(a.qkv, h.data(), H, B, xs.data(), qkv.data(), Nqkv, false, threads, a.integer_rows);

  parallel_for(B * a.n_q, 1, threads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / a.n_q, hq = i % a.n_q;
      attend_head(a, qkv.data(), b, hq, attn.data() + b * Q + hq * D);
    }
  });

  xs = group_sums(a.o, attn.data(), Q, B);
  gemv(a.o, attn.data(), Q, B, xs.data(), x, H, true, threads, a.integer_rows);
}

inline void decode_layer(const LayerArgs& a, float* x) {
  const int64_t B = a.batch, H = a.hidden, I = a.inter;
  const int threads = a.threads;
  decode_attention(a, x);
  std::vector<float> h(B * H), gate(B * I);
  norm_rows(x, B, H, a.mlp_norm, a.eps, h.data(), threads);
  if (a.w13.kind == kStack || B > kGemmMinRows) {
    // Gate and up as one product (a stack's runs each by its own kernel; a chunk's rows by the
    // GEMM), then SiLU.
    std::vector<float> both(B * 2 * I);
    rows_product(a.w13, h.data(), B, both.data(), 2 * I, false, threads, a.integer_rows);
    parallel_for(B, 16, threads, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) silu_times(both.data() + b * 2 * I, both.data() + b * 2 * I + I, I, gate.data() + b * I);
    });
  } else {
    std::vector<float> up(B * I);
    const std::vector<float> xs = group_sums(a.w13, h.data(), H, B);
    const Activations16 h16 = quantize16(a.w13, h.data(), H, B, a.integer_rows);
    const int64_t R = rows_per_tile(B), tiles = (I + R - 1) / R;
    parallel_for(tiles, tile_grain(tiles, threads), threads, [&](int64_t t0, int64_t t1) {
      const int64_t i0 = t0 * R, i1 = std::min(I, t1 * R);
      gemv_rows(a.w13, h.data(), H, B, xs.data(), i0, i1, gate.data() + i0, I, false, &h16);
      gemv_rows(a.w13, h.data(), H, B, xs.data(), I + i0, I + i1, up.data() + i0, I, false, &h16);
      for (int64_t b = 0; b < B; ++b) silu_times(gate.data() + b * I + i0, up.data() + b * I + i0, i1 - i0, gate.data() + b * I + i0);
    });
  }

  rows_product(a.w2, gate.data(), B, x, H, true, threads, a.integer_rows);
}

}  // namespace tl
