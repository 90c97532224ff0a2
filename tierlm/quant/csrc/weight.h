// A weight matrix as the native kernels see it: its kind (the stored format), its codes,
// scales and offsets, and the combinations the kernels implement. Shared by the float-activation
// tiles (gemv.h) and the int16-activation rows (gemv_a16.h).
#pragma once

#include <cstdint>

#include "simd.h"

namespace tl {

// What a Weight's data holds (the values of Weight::kind).
enum WeightKind : int32_t { kFp32 = 0, kInt8 = 1, kInt4 = 4, kInt4K = 5, kInt6K = 6, kInt5 = 7, kInt5K = 8,
                           kIQ4 = 9, kIQ4X = 10, kInt2K = 11, kInt3K = 12, kStack = 13 };

// GGUF IQ4_NL / IQ4_XS's codebook: a nibble u stands for kIQ4Values[u] (times the group's scale).
alignas(64) inline constexpr float kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};
// The same codebook as the integers it holds, for the integer paths' byte lookups.
alignas(16) inline constexpr int8_t kIQ4Codes[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};

// GGUF Q4_K's scales as tierlm/quant/q4k.py stores them beside int4.py-packed nibbles: per row, per
// 256 columns, 20 bytes: fp16 d, fp16 dmin, then 8 sub-scales and 8 sub-mins (6-bit values, one
// byte each); group j of 32 columns is W = u * (d * sc[j]) - dmin * m[j] (every product exact).
constexpr int64_t kSuperColumns = 256, kSuperBytes = 20;
// GGUF Q6_K as tierlm/quant/q6k.py stores it: the low nibbles packed as int4.py packs them, the
// 2-bit high parts (simd.h `sixes`, cols / 4 bytes a row) and per 256 columns 18 bytes: fp16 d
// and 16 int8 sub-scales; group j (16 columns) is W = (lo + 16 hi - 32) * (d * sc[j]) (exact).

// A weight matrix [rows, cols]:
//   kFp32  float data [rows, cols]; scales and offsets null.
//   kInt8  int8 data [rows, cols], fp32 scales [rows, G] (G = ceil(cols / group)) and, for
//          asymmetric modes, fp32 offsets of that shape (else null); or, symmetric only, fp16
//          scales (`half`: GGUF Q8_0's form, int8 with an fp16 scale per 32 columns).
//   kInt4  uint8 data [rows, cols / 2] packed as int4.py says (cols and group multiples of
//          32), fp16 scales [rows, G] and fp16 offsets [rows, G] or null (symmetric: -8 s).
//   kInt4K the same nibbles, group 32, `scales` the super-blocks (uint8 [rows, cols / 256, 20],
//          above: cols a multiple of 256), offsets null, half 0.
//   kInt6K low nibbles as kInt4's, `offsets` the high parts (uint8 [rows, cols / 4]), `scales`
//          the super-blocks (uint8 [rows, cols / 256, 18]), group 16, half 0.
//   kInt5  5-bit codes u (uint8 [rows, cols / 32, 20]: per chunk 16 bytes of nibbles, then the
//          high bits), group 32, fp16 scales [rows, G] and offsets or null (W = (u - 16) s):
//          GGUF Q5_1 and Q5_0; half 1.
//   kInt5K the same codes with kInt4K's super-blocks as `scales` (GGUF Q5_K), half 0.
//   kIQ4   nibbles as kInt4's standing for kIQ4Values, group 32, fp16 scales [rows, G], no
//          offsets, half 1 (GGUF IQ4_NL); kIQ4X the same with `scales` per 256 columns fp16 d and
//          8 int8 sub-scales (uint8 [rows, cols / 256, 10]), W = value * d * sub, half 0 (IQ4_XS).
//   kInt2K GGUF Q2_K (tierlm/quant/low_bit_k.py): 2-bit codes u as `sixes` reads crumbs (uint8
//          [rows, cols / 4]), `scales` the super-blocks (uint8 [rows, cols / 256, 20]: fp16 d,
//          fp16 dmin, 16 bytes sc | m << 4), offsets null, group 16: W = u * (d sc) - dmin m.
//   kInt3K GGUF Q3_K: the same crumbs, `offsets` the high bits (uint8 [rows, cols / 8], per 32
//          columns a uint32, bit i column i), `scales` [rows, cols / 256, 14] (fp16 d, GGUF's 12
//          bytes of 6-bit sc), group 16: W = (u - 4) * (d (sc - 32)), u = crumb + 4 bit.
//   kStack rows fused from weights of several kinds (tierlm/quant/row_stack.py): `data` an array
//          of `group` Weights (none itself a stack, each with its own rows, all `cols` wide, no
//          bias: the stack's applies), rows [0, r0) the first's, then the next's; scales,
//          offsets null, half 0.
// `half` says the scales (and offsets) are fp16: 1 for kInt4, either for kInt8 (`supported()`).
// The layout is mirrored by `WeightArg` in tierlm/models/fused_decode.py.
struct Weight {
  const void* data;
  const void* scales;
  const void* offsets;
  const float* bias;  // [rows] or null
  int64_t rows, cols, group;
  int32_t kind;
  int32_t half;

  int64_t groups() const { return kind != kFp32 && kind != kStack ? (cols + group - 1) / group : 1; }
  const Weight* runs() const { return static_cast<const Weight*>(data); }
  // The combinations the kernels implement; anything else must be refused before a call.
  bool supported() const {
    if (kind == kFp32) return !scales && !offsets;
    if (kind == kInt8) return scales && group > 0 && !(half && offsets);
    if (kind == kInt4) return half && scales && group > 0 && group % 32 == 0 && cols % 32 == 0;
    if (kind == kInt4K) return !half && scales && !offsets && group == 32 && cols % kSuperColumns == 0;
    if (kind == kInt6K) return !half && scales && offsets && group == 16 && cols % kSuperColumns == 0;
    if (kind == kInt5) return half && scales && group == 32 && cols % 32 == 0;
    if (kind == kInt5K) return !half && scales && !offsets && group == 32 && cols % kSuperColumns == 0;
    if (kind == kIQ4) return half && scales && !offsets && group == 32 && cols % 32 == 0;
    if (kind == kIQ4X) return !half && scales && !offsets && group == 32 && cols % kSuperColumns == 0;
    if (kind == kStack) {
      if (!data || scales || offsets || half || group < 1) return false;
      int64_t total = 0;
      for (int64_t i = 0; i < group; ++i) {
        const Weight& run = runs()[i];
        if (run.kind == kStack || run.bias || run.cols != cols || run.rows < 1 || !run.supported()) return false;
        total += run.rows;
      }
      return total == rows;
    }
    if (kind == kInt2K || kind == kInt3K)
      return !half && scales && (offsets != nullptr) == (kind == kInt3K) && group == 16 && cols % kSuperColumns == 0;
    return false;
  }
};

template <typename T>
inline void prefetch(const T* p) {
  __builtin_prefetch(p, 0, 2);
}

}  // namespace tl
