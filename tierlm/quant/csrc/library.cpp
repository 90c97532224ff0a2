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
int tierlm_decode_layer(const tl::LayerArgs* args, float* x) {
  tl::decode_layer(*args, x);
  return 0;
}

// The size of LayerArgs, so the Python side can refuse a mismatched layout.
int64_t tierlm_decode_args_size() { return sizeof(tl::LayerArgs); }

}  // extern "C"
