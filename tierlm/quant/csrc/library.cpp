// The exported entry points of tierlm's native CPU library (tierlm/quant/native.py builds every
// .cpp of this folder into one shared library and wraps these with ctypes).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fused_decode.h"
#include "gemv.h"
#include "pool.h"

extern "C" {

// Which vector path was compiled: 512 (AVX-512), 256 (AVX2+FMA) or 0 (portable).
int tierlm_i8_isa() { return TIERLM_ISA; }

// y[M, N] = x[M, K] @ (w[N, K] * s[N, G] (+ o[N, G])).T (+ bias[N]); all row-major and
// contiguous; o may be null (symmetric weights).
int tierlm_i8_matmul(const float* x, int64_t M, int64_t K, const int8_t* w, const float* s,
                     const float* o, int64_t N, int64_t group, const float* bias, float* y,
                     int threads) {
  const tl::Weight W{w, s, o, bias, N, K, group, 1, 0};
  const std::vector<float> xs = tl::group_sums(W, x, K, M);
  tl::gemv(W, x, K, M, xs.data(), y, N, false, threads);
  return 0;
}

// out[N, K] = w[N, K] * s[N, G] (+ o[N, G]), broadcast over each group of `group` columns.
int tierlm_i8_dequant(const int8_t* w, const float* s, const float* o, int64_t N, int64_t K,
                      int64_t group, float* out, int threads) {
  const int64_t G = (K + group - 1) / group;
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const float sg = s[n * G + g];
        const float og = o ? o[n * G + g] : 0.0f;
        const int64_t k1 = std::min(K, (g + 1) * group);
#pragma omp simd
        for (int64_t k = g * group; k < k1; ++k) out[n * K + k] = static_cast<float>(w[n * K + k]) * sg + og;
      }
  });
  return 0;
}

// One decoder layer's decode step, x [batch, hidden] updated in place (see fused_decode.h).
// `step` holds what every layer of a step shares; `words` this layer's 38 int64 words:
// 4 weights (qkv, o, w13, w2) x {data, scales, offsets, bias, rows, cols, group, int8},
// attn_norm, mlp_norm, q_norm, k_norm, keys, values (pointers as integers, 0 for null).
// One flat array is what Python fills fastest (a layer costs ~40 ctypes field writes otherwise).
int tierlm_decode_layer(const tl::LayerArgs* step, const int64_t* words, float* x) {
  tl::LayerArgs a = *step;
  auto ptr = [&](int i) { return reinterpret_cast<void*>(static_cast<intptr_t>(words[i])); };
  tl::Weight* weights[4] = {&a.qkv, &a.o, &a.w13, &a.w2};
  for (int i = 0; i < 4; ++i) {
    const int b = 8 * i;
    *weights[i] = tl::Weight{ptr(b), static_cast<const float*>(ptr(b + 1)),
                             static_cast<const float*>(ptr(b + 2)), static_cast<const float*>(ptr(b + 3)),
                             words[b + 4], words[b + 5], words[b + 6], static_cast<int32_t>(words[b + 7]), 0};
  }
  a.attn_norm = static_cast<const float*>(ptr(32));
  a.mlp_norm = static_cast<const float*>(ptr(33));
  a.q_norm = static_cast<const float*>(ptr(34));
  a.k_norm = static_cast<const float*>(ptr(35));
  a.keys = static_cast<float*>(ptr(36));
  a.values = static_cast<float*>(ptr(37));
  tl::decode_layer(a, x);
  return 0;
}

// The size of LayerArgs, so the Python side can refuse a mismatched layout.
int64_t tierlm_decode_args_size() { return sizeof(tl::LayerArgs); }

}  // extern "C"
