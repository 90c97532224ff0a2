// The exported entry points of tierlm's native CPU library (tierlm/quant/native.py builds every
// .cpp of this folder into one shared library and wraps these with ctypes).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fused_decode.h"
#include "gemm_a16.h"
#include "gemv.h"
#include "pool.h"

extern "C" {

// Which vector path was compiled: 512 (AVX-512), 256 (AVX2+FMA) or 0 (portable).
int tierlm_i8_isa() { return TIERLM_ISA; }

// y[M, N] = x[M, K] @ (w[N, K] * s[N, G] (+ o[N, G])).T (+ bias[N]); all row-major and
// contiguous; o may be null (symmetric weights). `half`: s is fp16 (then o must be null).
// Returns -1 (nothing written) for fp16 scales with offsets.
int tierlm_i8_matmul(const float* x, int64_t M, int64_t K, const int8_t* w, const void* s,
                     const float* o, int64_t N, int64_t group, const float* bias, float* y,
                     int threads, int half) {
  const tl::Weight W{w, s, o, bias, N, K, group, tl::kInt8, half};
  if (!W.supported()) return -1;
  const std::vector<float> xs = tl::group_sums(W, x, K, M);
  tl::gemv(W, x, K, M, xs.data(), y, N, false, threads);
  return 0;
}

// out[N, K] = w[N, K] * s[N, G] (+ o[N, G]), broadcast over each group of `group` columns;
// `half`: s is fp16.
int tierlm_i8_dequant(const int8_t* w, const void* s, const float* o, int64_t N, int64_t K,
                      int64_t group, float* out, int threads, int half) {
  const int64_t G = (K + group - 1) / group;
  const float* s32 = static_cast<const float*>(s);
  const uint16_t* s16 = static_cast<const uint16_t*>(s);
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const float sg = half ? tl::half_to_float(s16[n * G + g]) : s32[n * G + g];
        const float og = o ? o[n * G + g] : 0.0f;
        const int64_t k1 = std::min(K, (g + 1) * group);
#pragma omp simd
        for (int64_t k = g * group; k < k1; ++k) out[n * K + k] = static_cast<float>(w[n * K + k]) * sg + og;
      }
  });
  return 0;
}

// y[M, N] = x[M, K] @ W.T (+ bias[N]) for int4 W[n, k] = u * s[n, g] + o[n, g] (int4.py's
// packing: packed [N, K / 2]; fp16 s and o [N, G]; o null: symmetric, o = -8 s). Returns -1
// (nothing written) unless K and group are positive multiples of 32.
int tierlm_i4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed, const uint16_t* s,
                     const uint16_t* o, int64_t N, int64_t group, const float* bias, float* y,
                     int threads) {
  const tl::Weight W{packed, s, o, bias, N, K, group, tl::kInt4, 1};
  if (!W.supported()) return -1;
  const std::vector<float> xs = tl::group_sums(W, x, K, M);
  tl::gemv(W, x, K, M, xs.data(), y, N, false, threads);
  return 0;
}

// out[N, K] = u * s + o in fp32 (exactly dequantize4's values: u * s is exact in fp32), for the
// int4 weight of tierlm_i4_matmul. Returns -1 (nothing written) on a bad K or group.
int tierlm_i4_dequant(const uint8_t* packed, const uint16_t* s, const uint16_t* o, int64_t N,
                      int64_t K, int64_t group, float* out, int threads) {
  const tl::Weight W{packed, s, o, nullptr, N, K, group, tl::kInt4, 1};
  if (!W.supported()) return -1;
  using reg = tl::Vec::reg;
  constexpr int L = tl::Vec::lanes;
  const int64_t G = W.groups();
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const float sg = tl::half_to_float(s[n * G + g]);
        const float og = o ? tl::half_to_float(o[n * G + g]) : -8.0f * sg;
        const reg sv = tl::Vec::set1(sg), ov = tl::Vec::set1(og);
        for (int64_t k = g * group, k1 = std::min(K, k + group); k < k1; k += 32) {
          const uint8_t* p = packed + n * (K / 2) + k / 2;
          float* row = out + n * K + k;
          for (int j = 0; j < 16; j += L) {
            reg lo, hi;
            tl::Vec::nibbles(p + j, lo, hi);
            tl::Vec::store(row + j, tl::Vec::fma(lo, sv, ov));
            tl::Vec::store(row + 16 + j, tl::Vec::fma(hi, sv, ov));
          }
        }
      }
  });
  return 0;
}

// y[M, N] = x[M, K] @ W.T (+ bias[N]) for a GGUF Q4_K weight as gemv.h's kInt4K holds it: packed
// [N, K / 2] nibbles, super-blocks [N, K / 256, 20]. Returns -1 (nothing written) unless K is a
// positive multiple of 256.
int tierlm_q4k_matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed, const uint8_t* super,
                      int64_t N, const float* bias, float* y, int threads) {
  const tl::Weight W{packed, super, nullptr, bias, N, K, 32, tl::kInt4K, 0};
  if (!W.supported() || K <= 0) return -1;
  const std::vector<float> xs = tl::group_sums(W, x, K, M);
  tl::gemv(W, x, K, M, xs.data(), y, N, false, threads);
  return 0;
}

// out[N, K] = u * (d * sc) - dmin * m in fp32 for the weight of tierlm_q4k_matmul: exactly the
// `gguf` package's Q4_K values (every product is exact, so one rounding either way).
int tierlm_q4k_dequant(const uint8_t* packed, const uint8_t* super, int64_t N, int64_t K, float* out,
                       int threads) {
  const tl::Weight W{packed, super, nullptr, nullptr, N, K, 32, tl::kInt4K, 0};
  if (!W.supported() || K <= 0) return -1;
  const int64_t G = W.groups();
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> s(G), o(G);
    for (int64_t n = n0; n < n1; ++n) {
      tl::expand_super_blocks(W, n, 1, s.data(), o.data());
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* p = packed + n * (K / 2) + g * 16;
        float* row = out + n * K + g * 32;
        for (int j = 0; j < 16; ++j) {
          row[j] = static_cast<float>(p[j] & 0x0F) * s[g] + o[g];
          row[16 + j] = static_cast<float>(p[j] >> 4) * s[g] + o[g];
        }
      }
    }
  });
  return 0;
}

// y[M, N] = x[M, K] @ W.T (+ bias[N]) for a GGUF Q6_K weight as gemv.h's kInt6K holds it: low
// nibbles [N, K / 2], high parts [N, K / 4], super-blocks [N, K / 256, 18]. Returns -1 (nothing
// written) unless K is a positive multiple of 256.
int tierlm_q6k_matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed, const uint8_t* high,
                      const uint8_t* super, int64_t N, const float* bias, float* y, int threads) {
  const tl::Weight W{packed, super, high, bias, N, K, 16, tl::kInt6K, 0};
  if (!W.supported() || K <= 0) return -1;
  tl::gemv(W, x, K, M, nullptr, y, N, false, threads);
  return 0;
}

// out[N, K] = (lo + 16 hi - 32) * (d * sc) in fp32 for the weight of tierlm_q6k_matmul: exactly
// the `gguf` package's Q6_K values.
int tierlm_q6k_dequant(const uint8_t* packed, const uint8_t* high, const uint8_t* super, int64_t N, int64_t K,
                       float* out, int threads) {
  const tl::Weight W{packed, super, high, nullptr, N, K, 16, tl::kInt6K, 0};
  if (!W.supported() || K <= 0) return -1;
  const int64_t G = W.groups();
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> s(G);
    for (int64_t n = n0; n < n1; ++n) {
      tl::expand_signed_scales<16>(W, n, 1, s.data());
      for (int64_t c = 0; c < K / 32; ++c) {
        const uint8_t* p = packed + n * (K / 2) + c * 16;
        const uint8_t* h = high + n * (K / 4) + c * 8;
        float* row = out + n * K + c * 32;
        for (int j = 0; j < 16; ++j) {
          const int shift = j / 8 * 2;
          const int lo = (p[j] & 0x0F) | (((h[j % 8] >> shift) & 3) << 4);
          const int hi = (p[j] >> 4) | (((h[j % 8] >> (shift + 4)) & 3) << 4);
          row[j] = static_cast<float>(lo - 32) * s[2 * c];
          row[16 + j] = static_cast<float>(hi - 32) * s[2 * c + 1];
        }
      }
    }
  });
  return 0;
}

// y[M, N] = x[M, K] @ W.T (+ bias[N]) for GGUF 5-bit weights as gemv.h holds them: codes [N, K /
// 32, 20]; `super` 0: fp16 scales s and offsets o (null: Q5_0's -16 s) [N, K / 32], 1: Q5_K's
// super-blocks as s (o null). Returns -1 (nothing written) on a K they cannot hold.
int tierlm_q5_matmul(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s, const void* o,
                     int64_t N, const float* bias, float* y, int threads, int super) {
  const tl::Weight W{codes, s, o, bias, N, K, 32, super ? tl::kInt5K : tl::kInt5, super ? 0 : 1};
  if (!W.supported() || K <= 0) return -1;
  const std::vector<float> xs = tl::group_sums(W, x, K, M);
  tl::gemv(W, x, K, M, xs.data(), y, N, false, threads);
  return 0;
}

// out[N, K] = u * s + o in fp32 for the weight of tierlm_q5_matmul: exactly the `gguf` package's
// values (each product is exact in fp32).
int tierlm_q5_dequant(const uint8_t* codes, const void* s, const void* o, int64_t N, int64_t K, float* out,
                      int threads, int super) {
  const tl::Weight W{codes, s, o, nullptr, N, K, 32, super ? tl::kInt5K : tl::kInt5, super ? 0 : 1};
  if (!W.supported() || K <= 0) return -1;
  const int64_t G = W.groups();
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> sg(G), og(G);
    for (int64_t n = n0; n < n1; ++n) {
      if (super) {
        tl::expand_super_blocks(W, n, 1, sg.data(), og.data());
      } else {
        const uint16_t* s16 = static_cast<const uint16_t*>(s) + n * G;
        const uint16_t* o16 = o ? static_cast<const uint16_t*>(o) + n * G : nullptr;
        for (int64_t g = 0; g < G; ++g) {
          sg[g] = tl::half_to_float(s16[g]);
          og[g] = o16 ? tl::half_to_float(o16[g]) : -16.0f * sg[g];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* p = codes + (n * G + g) * 20;
        uint32_t high;
        __builtin_memcpy(&high, p + 16, 4);
        float* row = out + n * K + g * 32;
        for (int j = 0; j < 16; ++j) {
          const int lo = (p[j] & 0x0F) | (((high >> j) & 1) << 4), hi = (p[j] >> 4) | (((high >> (16 + j)) & 1) << 4);
          row[j] = static_cast<float>(lo) * sg[g] + og[g];
          row[16 + j] = static_cast<float>(hi) * sg[g] + og[g];
        }
      }
    }
  });
  return 0;
}

// y[M, N] = x[M, K] @ W.T (+ bias[N]) for GGUF IQ4_NL (`super` 0: fp16 scales [N, K / 32]) or
// IQ4_XS (`super` 1: [N, K / 256, 10] super-blocks) as gemv.h's kIQ4 / kIQ4X hold them: nibbles
// [N, K / 2] standing for kIQ4Values. Returns -1 (nothing written) on a K they cannot hold.
int tierlm_iq4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed, const void* s, int64_t N,
                      const float* bias, float* y, int threads, int super) {
  const tl::Weight W{packed, s, nullptr, bias, N, K, 32, super ? tl::kIQ4X : tl::kIQ4, super ? 0 : 1};
  if (!W.supported() || K <= 0) return -1;
  tl::gemv(W, x, K, M, nullptr, y, N, false, threads);
  return 0;
}

// out[N, K] = value * scale in fp32 for the weight of tierlm_iq4_matmul: exactly the `gguf`
// package's values (every product exact in fp32).
int tierlm_iq4_dequant(const uint8_t* packed, const void* s, int64_t N, int64_t K, float* out, int threads,
                       int super) {
  const tl::Weight W{packed, s, nullptr, nullptr, N, K, 32, super ? tl::kIQ4X : tl::kIQ4, super ? 0 : 1};
  if (!W.supported() || K <= 0) return -1;
  const int64_t G = W.groups();
  tl::parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> sg(G);
    for (int64_t n = n0; n < n1; ++n) {
      if (super) {
        tl::expand_signed_scales<8>(W, n, 1, sg.data());
      } else {
        for (int64_t g = 0; g < G; ++g) sg[g] = tl::half_to_float(static_cast<const uint16_t*>(s)[n * G + g]);
      }
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* p = packed + n * (K / 2) + g * 16;
        float* row = out + n * K + g * 32;
        for (int j = 0; j < 16; ++j) {
          row[j] = tl::kIQ4Values[p[j] & 15] * sg[g];
          row[16 + j] = tl::kIQ4Values[p[j] >> 4] * sg[g];
        }
      }
    }
  });
  return 0;
}

// tl::Weight from its 9 int64 words {data, scales, offsets, bias, rows, cols, group, kind, half}
// (pointers as integers, 0 for null): how Python hands any weight kind over.
static tl::Weight weight_from_words(const int64_t* words) {
  auto ptr = [&](int i) { return reinterpret_cast<const void*>(static_cast<intptr_t>(words[i])); };
  return tl::Weight{ptr(0), ptr(1), ptr(2), static_cast<const float*>(ptr(3)), words[4], words[5], words[6],
                    static_cast<int32_t>(words[7]), static_cast<int32_t>(words[8])};
}

// y[M, rows] = x[M, cols] @ W.T (+ bias) for the weight of `words`, any kind the kernels
// implement. Returns -1 (nothing written) for a combination they do not.
int tierlm_weight_matmul_rows(const float* x, int64_t M, const int64_t* words, float* y, int threads,
                              int64_t integer_rows);
int tierlm_weight_matmul(const float* x, int64_t M, const int64_t* words, float* y, int threads) {
  return tierlm_weight_matmul_rows(x, M, words, y, threads, tl::kA16MaxRows);
}

// As tierlm_weight_matmul, with up to `integer_rows` rows (gemv_a16.h kA16PartRows at most) on
// the integer decode kernels, each row computed as alone (what the fused step asks for in decode
// batches and verification passes).
int tierlm_weight_matmul_rows(const float* x, int64_t M, const int64_t* words, float* y, int threads,
                              int64_t integer_rows) {
  const tl::Weight W = weight_from_words(words);
  if (!W.supported() || W.cols <= 0) return -1;
  const std::vector<float> xs = tl::group_sums(W, x, W.cols, M);
  tl::gemv(W, x, W.cols, M, xs.data(), y, W.rows, false, threads, integer_rows);
  return 0;
}

// y[M, rows] = x[M, cols] @ W.T (+ bias) for the weight of `words`, multiplied in integers
// (gemm_a16.h: prefill-sized M). Returns -1 (nothing written) where W has no integer path in
// this build or x holds NaN or inf: the caller dequantizes into BLAS instead.
int tierlm_weight_gemm(const float* x, int64_t M, const int64_t* words, float* y, int threads) {
  const tl::Weight W = weight_from_words(words);
  return M > 0 && tl::gemm_a16(W, x, M, y, W.rows, threads) ? 0 : -1;
}

// out[rows, cols] = the weight of `words` dequantized in fp32, exactly the `gguf` package's
// values, for GGUF Q2_K and Q3_K (kInt2K, kInt3K; each product exact in fp32). Returns -1
// (nothing written) for other kinds, which have entries of their own above.
int tierlm_weight_dequant(const int64_t* words, float* out, int threads) {
  const tl::Weight W = weight_from_words(words);
  if ((W.kind != tl::kInt2K && W.kind != tl::kInt3K) || !W.supported() || W.cols <= 0) return -1;
  const int64_t K = W.cols, G = W.groups();
  const bool three = W.kind == tl::kInt3K;
  const uint8_t* crumbs = static_cast<const uint8_t*>(W.data);
  const uint8_t* high = static_cast<const uint8_t*>(W.offsets);
  tl::parallel_for(W.rows, 16, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> s(G), o(G);
    for (int64_t n = n0; n < n1; ++n) {
      tl::expand_low_bit_k(W, n, 1, s.data(), o.data());
      for (int64_t c = 0; c < K / 32; ++c) {
        const uint8_t* q = crumbs + n * (K / 4) + c * 8;
        uint32_t bits = 0;
        if (three) __builtin_memcpy(&bits, high + n * (K / 8) + c * 4, 4);
        float* row = out + n * K + c * 32;
        for (int k = 0; k < 32; ++k) {
          const int u = ((q[k % 8] >> (2 * (k / 8))) & 3) | (((bits >> k) & 1) << 2);
          const int64_t g = 2 * c + k / 16;
          row[k] = three ? static_cast<float>(u - 4) * s[g] : static_cast<float>(u) * s[g] + o[g];
        }
      }
    }
  });
  return 0;
}

// One decoder layer's decode step, x [batch, hidden] updated in place (see fused_decode.h).
// `step` holds what every layer of a step shares; `words` this layer's 44 int64 words:
// 4 weights (qkv, o, w13, w2) x {data, scales, offsets, bias, rows, cols, group, kind, half}
// (tl::Weight's fields), attn_norm, mlp_norm, q_norm, k_norm, keys, values, key_scales,
// value_scales (pointers as integers, 0 for null). One flat array is what Python fills fastest (a layer costs ~40 ctypes
// field writes otherwise). Returns -1 (x untouched) if a weight is no supported combination.
constexpr int64_t kWordsPerLayer = 44;

static bool parse_layer(const tl::LayerArgs* step, const int64_t* words, bool mlp, tl::LayerArgs& a) {
  a = *step;
  auto ptr = [&](int i) { return reinterpret_cast<void*>(static_cast<intptr_t>(words[i])); };
  tl::Weight* weights[4] = {&a.qkv, &a.o, &a.w13, &a.w2};
  for (int i = 0; i < 4; ++i) {
    const int b = 9 * i;
    *weights[i] = tl::Weight{ptr(b), ptr(b + 1), ptr(b + 2), static_cast<const float*>(ptr(b + 3)),
                             words[b + 4], words[b + 5], words[b + 6],
                             static_cast<int32_t>(words[b + 7]), static_cast<int32_t>(words[b + 8])};
    if ((i < 2 || mlp) && !weights[i]->supported()) return false;
  }
  a.attn_norm = static_cast<const float*>(ptr(36));
  a.mlp_norm = static_cast<const float*>(ptr(37));
  a.q_norm = static_cast<const float*>(ptr(38));
  a.k_norm = static_cast<const float*>(ptr(39));
  a.keys = ptr(40);
  a.values = ptr(41);
  a.key_scales = static_cast<uint16_t*>(ptr(42));
  a.value_scales = static_cast<uint16_t*>(ptr(43));
  return !(a.kv_type < tl::kKVF32 || a.kv_type > tl::kKVQ4 || a.head_dim > 2048 ||
           (tl::kv_quantized(a.kv_type) && (a.head_dim % tl::kKVGroup || !a.key_scales || !a.value_scales)));
}

static int decode_call(const tl::LayerArgs* step, const int64_t* words, float* x, bool mlp) {
  tl::LayerArgs a;
  if (!parse_layer(step, words, mlp, a)) return -1;
  if (mlp) tl::decode_layer(a, x);
  else tl::decode_attention(a, x);
  return 0;
}

int tierlm_decode_layer(const tl::LayerArgs* step, const int64_t* words, float* x) {
  return decode_call(step, words, x, true);
}

// The attention half alone (x += attention @ Wo.T): the same words, w13 and w2 unread (zeros).
int tierlm_decode_attention(const tl::LayerArgs* step, const int64_t* words, float* x) {
  return decode_call(step, words, x, false);
}

// `count` whole layers in order, each its kWordsPerLayer words after the previous one's: one
// call per step keeps the pool's helpers spinning between layers and Python out of the step.
// Every layer is checked before the first runs: -1 (x untouched) if any is unsupported.
int tierlm_decode_layers(const tl::LayerArgs* step, const int64_t* words, int64_t count, float* x) {
  std::vector<tl::LayerArgs> layers(count);
  for (int64_t i = 0; i < count; ++i)
    if (!parse_layer(step, words + i * kWordsPerLayer, true, layers[i])) return -1;
  for (const tl::LayerArgs& a : layers) tl::decode_layer(a, x);
  return 0;
}

// Rows x[n, D] stored as the decode step stores KV rows in `type` (kv_formats.h): codes
// [n, row bytes] and, quantized, fp16 scales [n, D / 32]. Returns -1 (nothing written) on an
// unknown type or a D the type cannot hold.
int tierlm_kv_store(int32_t type, const float* x, int64_t n, int64_t D, void* codes, uint16_t* scales) {
  if (type < tl::kKVF32 || type > tl::kKVQ4 || D <= 0 || (tl::kv_quantized(type) && D % tl::kKVGroup)) return -1;
  const int64_t row = tl::kv_code_bytes(type, D), groups = tl::kv_quantized(type) ? D / tl::kKVGroup : 0;
  for (int64_t i = 0; i < n; ++i)
    tl::kv_store(type, x + i * D, D, static_cast<char*>(codes) + i * row, scales ? scales + i * groups : nullptr);
  return 0;
}

// out[D] = single-query attention of q[D] over n stored rows (keys, values: codes [rows, row
// bytes] and fp16 scales [rows, D / 32] or null, as tierlm_kv_store writes them), the decode
// step's own read path; the last row is read back as floats first, as the step reads its new
// token. `pages` null: position t is row t; else paged (attention.h StoredRows): position t is
// row (pages[t >> page_shift] << page_shift) + (t & (2^page_shift - 1)).
int tierlm_kv_attend(int32_t type, const float* q, const void* keys, const uint16_t* key_scales,
                     const void* values, const uint16_t* value_scales, const int64_t* pages, int32_t page_shift,
                     int64_t n, int64_t D, float* out) {
  if (type < tl::kKVF32 || type > tl::kKVQ4 || n <= 0 || D <= 0 ||
      (tl::kv_quantized(type) && (D % tl::kKVGroup || !key_scales || !value_scales)))
    return -1;
  const int64_t row = tl::kv_code_bytes(type, D), groups = tl::kv_quantized(type) ? D / tl::kKVGroup : 0;
  const tl::StoredRows k{{type, static_cast<const char*>(keys), key_scales, row, groups}, pages, page_shift};
  const tl::StoredRows v{{type, static_cast<const char*>(values), value_scales, row, groups}, pages, page_shift};
  std::vector<float> last(2 * D), scores(n);
  tl::kv_load(type, k.codes(n - 1), k.scales_of(n - 1), D, last.data());
  tl::kv_load(type, v.codes(n - 1), v.scales_of(n - 1), D, last.data() + D);
  tl::attend_stored(k, v, q, D, 0, n - 1, last.data(), last.data() + D, scores.data(), out);
  return 0;
}

// The size of LayerArgs, so the Python side can refuse a mismatched layout.
int64_t tierlm_decode_args_size() { return sizeof(tl::LayerArgs); }

}  // extern "C"
