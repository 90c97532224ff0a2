// The vector primitives the kernels are written in, one set per instruction set. The build's
// -march picks one at compile time: AVX-512 (16 lanes), AVX2+FMA (8 lanes), or GCC/Clang
// vector extensions (4 lanes, whatever the target offers: SSE, NEON, ...). Kernels use only
// `Vec`, so the tile code tested on one ISA is the code the others run.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TIERLM_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIERLM_ISA 256
#else
#define TIERLM_ISA 0
#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif
#endif

namespace tl {

#if TIERLM_ISA == 512
struct Vec {
  using reg = __m512;
  static constexpr int lanes = 16;
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg set1(float v) { return _mm512_set1_ps(v); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline reg load(const int8_t* p) {  // 16 int8 -> 16 fp32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float sum(reg v) { return _mm512_reduce_add_ps(v); }
};
#elif TIERLM_ISA == 256
struct Vec {
  using reg = __m256;
  static constexpr int lanes = 8;
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg set1(float v) { return _mm256_set1_ps(v); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline reg load(const int8_t* p) {  // 8 int8 -> 8 fp32 (vpmovsxbd reads 8 bytes)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float sum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#else
// 4 lanes: the width SSE4 and NEON registers hold (8 measured 2x slower on x86-64-v2).
struct Vec {
  typedef float reg __attribute__((vector_size(16)));
  typedef int8_t bytes __attribute__((vector_size(4)));
  typedef int32_t ints __attribute__((vector_size(16)));
  static constexpr int lanes = 4;
  static inline reg zero() { return reg{}; }
  static inline reg set1(float v) { return reg{} + v; }
  static inline reg load(const float* p) {
    reg r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  static inline reg load(const int8_t* p) {
#if defined(__SSE4_1__)  // pmovsxbd: GCC's generic widening is unpack+shift chains (2x slower)
    int32_t word;
    std::memcpy(&word, p, sizeof word);
    return reinterpret_cast<reg>(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word))));
#else  // widened to int32 first: one sign-extend, one convert
    bytes b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ints), reg);
#endif
  }
  static inline reg fma(reg a, reg b, reg c) { return a * b + c; }
  static inline float sum(reg v) {
    float s = 0.0f;
    for (int i = 0; i < lanes; ++i) s += v[i];
    return s;
  }
};
#endif

}  // namespace tl
