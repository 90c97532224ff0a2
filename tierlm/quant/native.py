"""The native CPU library: tierlm's C++ kernels, built once with the system compiler.

One owner: this module compiles every `.cpp` of `tierlm/quant/csrc` (package data) into one
shared library cached under `kernels_root()` ($TIERLM_KERNELS, else `cache_root()/kernels`),
and wraps its entry points:

- `matmul`: y[M, N] = x[M, K] @ (q[N, K] * s[N, G] (+ o[N, G])).T (+ bias), for small M
  (decode); asymmetric offsets o add each output's dot with x summed per group. Weights are
  widened to fp32 in registers and FMA'd with up to 4 activation rows, a tile of rows at a
  time, each cache line prefetching the next tile's; a group's partial dot is scaled once per
  group. Only the int8 bytes cross the memory bus and accumulation is fp32: W8A16.
- `gemm`: the same product for many rows (prefill) multiplied in integers (csrc/gemm_a16.h):
  activations quantized to int16 per 32 columns, any stored kind expanded a panel of rows at
  a time into its integer codes; None where the build or the input has no such path.
- `dequantize_into`: fp32 rows of a weight block, for the dequantize-then-BLAS path (prefill
  where `gemm` declines, and accelerators).
- `matmul4`: the same product for INT4 weights (tierlm/quant/int4.py: packed nibbles, fp16
  scales and offsets per group of a multiple of 32 columns, all read as stored, no fp32 copy):
  W = u * s + o (o = -8 s when symmetric); each group's fp32 dot with the nibbles is scaled
  once, and o multiplies x summed over the group. Only the packed bytes (half of int8's) cross
  the memory bus and accumulation is fp32: W4A16.
- `dequantize4_into`: fp32 rows of an INT4 weight, exactly `int4.dequantize4`'s values.
- `matmul4k`, `dequantize4k_into`: the same for GGUF Q4_K weights as tierlm/quant/q4k.py holds
  them (the nibbles packed as INT4's, per 256 columns fp16 d and dmin with 8 sub-scales and
  mins): each tile's per-group scales d * sc and offsets -dmin * m are formed as it is read.
- `decode_layer`: a whole decoder layer's decode step (tierlm/models/fused_decode.py); its
  weights may be fp32, INT8 or INT4, its KV cache any of kv/formats.py's formats;
  `decode_attention`: its attention half alone (a mixture-of-experts layer's).
- `kv_store`, `kv_attend`: rows as that step writes them into a KV cache, and its attention
  over stored rows (tests hold both to kv/codec.py and torch).

The vector code (csrc/simd.h) is AVX-512, AVX2+FMA or portable vector extensions, chosen by
the compiler's target; the library is compiled with `-march=native`, so its cache key includes
the CPU's identity as well as every source file, the flags and the compiler. Parallel loops
run on tierlm's own pool (csrc/pool.h). Any failure (no compiler, a build error) raises
`KernelUnavailable`, and the caller falls back. A build is a phase of its own for a caller's
progress (`built_library`): the compiler runs for tens of seconds, once per machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tierlm.paths import kernels_root
from tierlm.progress import ProgressFactory
from tierlm.quant.kernel_api import KernelUnavailable

SOURCES = Path(__file__).with_name("csrc")
# -march=native: the widest vector path this CPU has. -fopenmp-simd honours `omp simd` hints
# without linking an OpenMP runtime (threads come from csrc/pool.h).
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-pthread", "-std=c++17", "-shared", "-fPIC")
ISA_NAMES = {512: "native-avx512", 256: "native-avx2", 0: "native-simd"}
BUILD_TIMEOUT_S = 300
POLL_S = 1.0  # how often a build reports that the compiler still runs
# A build's duration is kept beside the libraries for the next build's estimate; before any, this
# one: 16 s of CPU, 35 s on the reference 2-core machine while it was busy.
BUILD_RECORD = "last-build-seconds"
FIRST_BUILD_GUESS_S = 35


# tl::WeightKind (csrc/weight.h): what a weight's data holds.
KIND_FP32, KIND_INT8, KIND_INT4, KIND_INT4K, KIND_INT6K, KIND_INT5, KIND_INT5K, KIND_IQ4, KIND_IQ4X = 0, 1, 4, 5, 6, 7, 8, 9, 10
KIND_STACK = 13  # `data` an array of `group` tl::Weight runs of rows (quant/row_stack.py)


class WeightArg(ctypes.Structure):
    """tl::Weight (csrc/weight.h): a weight as the native entry points read it, its fields the
    9 words `describe_weight` gives (data, scales, offsets, bias, rows, cols, group, kind, half)."""

    _fields_ = [("data", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("group", ctypes.c_int64), ("kind", ctypes.c_int32), ("half", ctypes.c_int32)]  # fmt: skip


class NativeKernel:
    """The compiled library behind the `Int8Kernel` interface (see `kernel_api`), plus the INT4
    entry points (`matmul4`, `dequantize4_into`).

    `lib` is the ctypes handle, for the other entry points (fused decode, pool controls).
    """

    def __init__(self, library: Path):
        lib = ctypes.CDLL(str(library))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.tierlm_i8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        lib.tierlm_i8_matmul.restype = ctypes.c_int
        lib.tierlm_i8_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
        lib.tierlm_i8_dequant.restype = ctypes.c_int
        lib.tierlm_i4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
        lib.tierlm_i4_matmul.restype = ctypes.c_int
        lib.tierlm_i4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
        lib.tierlm_i4_dequant.restype = ctypes.c_int
        lib.tierlm_q4k_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
        lib.tierlm_q4k_matmul.restype = ctypes.c_int
        lib.tierlm_q4k_dequant.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_int]
        lib.tierlm_q4k_dequant.restype = ctypes.c_int
        lib.tierlm_q6k_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
        lib.tierlm_q6k_matmul.restype = ctypes.c_int
        lib.tierlm_q6k_dequant.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
        lib.tierlm_q6k_dequant.restype = ctypes.c_int
        lib.tierlm_q5_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        lib.tierlm_q5_matmul.restype = ctypes.c_int
        lib.tierlm_q5_dequant.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
        lib.tierlm_q5_dequant.restype = ctypes.c_int
        lib.tierlm_iq4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        lib.tierlm_iq4_matmul.restype = ctypes.c_int
        lib.tierlm_iq4_dequant.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
        lib.tierlm_iq4_dequant.restype = ctypes.c_int
        lib.tierlm_weight_matmul.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int]
        lib.tierlm_weight_matmul.restype = ctypes.c_int
        lib.tierlm_weight_matmul_rows.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int, i64]
        lib.tierlm_weight_matmul_rows.restype = ctypes.c_int
        lib.tierlm_weight_gemm.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int]
        lib.tierlm_weight_gemm.restype = ctypes.c_int
        lib.tierlm_weight_dequant.argtypes = [ptr, ptr, ctypes.c_int]
        lib.tierlm_weight_dequant.restype = ctypes.c_int
        lib.tierlm_decode_layer.argtypes = [ptr, ptr, ptr]
        lib.tierlm_decode_layer.restype = ctypes.c_int
        lib.tierlm_decode_attention.argtypes = [ptr, ptr, ptr]
        lib.tierlm_decode_attention.restype = ctypes.c_int
        lib.tierlm_decode_layers.argtypes = [ptr, ptr, i64, ptr]
        lib.tierlm_decode_layers.restype = ctypes.c_int
        lib.tierlm_decode_args_size.restype = i64
        lib.tierlm_kv_store.argtypes = [ctypes.c_int32, ptr, i64, i64, ptr, ptr]
        lib.tierlm_kv_store.restype = ctypes.c_int
        lib.tierlm_kv_attend.argtypes = [ctypes.c_int32, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int32, i64, i64, ptr]
        lib.tierlm_kv_attend.restype = ctypes.c_int
        self.lib = lib
        self.library = library
        self.isa = lib.tierlm_i8_isa()
        self.name = ISA_NAMES.get(self.isa, "native-simd")

    def matmul(self, x, qweight, scales, group, bias=None, offsets=None):
        """x [M, K] fp32 @ dequantized qweight [N, K].T (+ bias [N]) -> [M, N] fp32.

        All inputs contiguous, on the CPU; scales fp32 or fp16 [N, G], G = ceil(K / group);
        offsets fp32 [N, G] (with fp32 scales only).
        """
        m, k = x.shape
        n = qweight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        half = _half_scales(scales, offsets)
        self.lib.tierlm_i8_matmul(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(),
            offsets.data_ptr() if offsets is not None else None, n, group,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads(), half,
        )  # fmt: skip
        return y

    def dequantize_into(self, qweight, scales, group, out, offsets=None):
        """out [N, K] fp32 = qweight [N, K] * scales [N, G] (+ offsets [N, G]) broadcast per
        group (all contiguous)."""
        n, k = qweight.shape
        self.lib.tierlm_i8_dequant(
            qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr() if offsets is not None else None,
            n, k, group, out.data_ptr(),
            torch.get_num_threads(), _half_scales(scales, offsets),
        )  # fmt: skip
        return out

    def matmul4(self, x, packed, scales, offsets, group, bias=None):
        """x [M, K] fp32 @ the INT4 weight's dequantized [N, K].T (+ bias [N] fp32) -> [M, N] fp32.

        packed uint8 [N, K / 2], scales and offsets (None: symmetric) float16 [N, G], G =
        ceil(K / group), laid out as tierlm/quant/int4.py packs them; all contiguous, on the CPU.
        ValueError unless K and group are positive multiples of 32.
        """
        m, k = x.shape
        n = packed.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        done = self.lib.tierlm_i4_matmul(
            x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(),
            offsets.data_ptr() if offsets is not None else None, n, group,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if done != 0:
            raise ValueError(f"int4 weights need K ({k}) and group ({group}) multiples of 32")
        return y

    def dequantize4_into(self, packed, scales, offsets, group, out):
        """out [N, K] fp32 = the INT4 weight (packed [N, K / 2], fp16 scales and offsets or None
        [N, G]) dequantized: u * s + o, exactly `int4.dequantize4`'s values. All contiguous."""
        n, k = out.shape
        done = self.lib.tierlm_i4_dequant(
            packed.data_ptr(), scales.data_ptr(), offsets.data_ptr() if offsets is not None else None,
            n, k, group, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if done != 0:
            raise ValueError(f"int4 weights need K ({k}) and group ({group}) multiples of 32")
        return out

    def matmul4k(self, x, packed, superblocks, bias=None):
        """x [M, K] fp32 @ the GGUF Q4_K weight's dequantized [N, K].T (+ bias) -> [M, N] fp32:
        packed uint8 [N, K / 2] (int4.py's packing), superblocks uint8 [N, K / 256 * 20]
        (tierlm/quant/q4k.py). All contiguous, on the CPU; ValueError unless K is a multiple of 256."""
        m, k = x.shape
        n = packed.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        done = self.lib.tierlm_q4k_matmul(x.data_ptr(), m, k, packed.data_ptr(), superblocks.data_ptr(), n,
                                          bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                          torch.get_num_threads())  # fmt: skip
        if done != 0:
            raise ValueError(f"Q4_K weights need K ({k}) a multiple of 256")
        return y

    def dequantize4k_into(self, packed, superblocks, out):
        """out [N, K] fp32 = the Q4_K weight dequantized, exactly the `gguf` package's values."""
        n, k = out.shape
        done = self.lib.tierlm_q4k_dequant(packed.data_ptr(), superblocks.data_ptr(), n, k, out.data_ptr(),
                                           torch.get_num_threads())  # fmt: skip
        if done != 0:
            raise ValueError(f"Q4_K weights need K ({k}) a multiple of 256")
        return out

    def matmul6k(self, x, packed, high, superblocks, bias=None):
        """x [M, K] fp32 @ the GGUF Q6_K weight (tierlm/quant/q6k.py: low nibbles [N, K / 2],
        high parts [N, K / 4], super-blocks [N, K / 256 * 18]).T (+ bias) -> [M, N] fp32."""
        m, k = x.shape
        n = packed.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        done = self.lib.tierlm_q6k_matmul(x.data_ptr(), m, k, packed.data_ptr(), high.data_ptr(),
                                          superblocks.data_ptr(), n, bias.data_ptr() if bias is not None else None,
                                          y.data_ptr(), torch.get_num_threads())  # fmt: skip
        if done != 0:
            raise ValueError(f"Q6_K weights need K ({k}) a multiple of 256")
        return y

    def dequantize6k_into(self, packed, high, superblocks, out):
        """out [N, K] fp32 = the Q6_K weight dequantized, exactly the `gguf` package's values."""
        n, k = out.shape
        done = self.lib.tierlm_q6k_dequant(packed.data_ptr(), high.data_ptr(), superblocks.data_ptr(), n, k,
                                           out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if done != 0:
            raise ValueError(f"Q6_K weights need K ({k}) a multiple of 256")
        return out

    def matmul5(self, x, codes, scales, offsets=None, superblocks=None, bias=None):
        """x [M, K] fp32 @ a GGUF 5-bit weight (tierlm/quant/q5.py: codes [N, K / 32 * 20] with fp16
        scales (and offsets, None: Q5_0) [N, K / 32], or Q5_K's `superblocks`).T (+ bias)."""
        m, k = x.shape
        n = codes.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        s = superblocks if superblocks is not None else scales
        done = self.lib.tierlm_q5_matmul(x.data_ptr(), m, k, codes.data_ptr(), s.data_ptr(),
                                         offsets.data_ptr() if offsets is not None else None, n,
                                         bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                         torch.get_num_threads(), int(superblocks is not None))  # fmt: skip
        if done != 0:
            raise ValueError(f"5-bit weights cannot have K = {k} (a multiple of 32, of 256 for Q5_K)")
        return y

    def dequantize5_into(self, codes, scales, offsets, superblocks, out):
        """out [N, K] fp32 = the 5-bit weight dequantized, exactly the `gguf` package's values."""
        n, k = out.shape
        s = superblocks if superblocks is not None else scales
        done = self.lib.tierlm_q5_dequant(codes.data_ptr(), s.data_ptr(),
                                          offsets.data_ptr() if offsets is not None else None, n, k, out.data_ptr(),
                                          torch.get_num_threads(), int(superblocks is not None))  # fmt: skip
        if done != 0:
            raise ValueError(f"5-bit weights cannot have K = {k} (a multiple of 32, of 256 for Q5_K)")
        return out

    def matmul_words(self, x, weight, bias=None):
        """x [M, K] fp32 @ a weight that describes itself to the kernels (`native_words()`:
        quant/low_bit_k.py's LowBitKWeight).T (+ bias) -> [M, N] fp32."""
        m = x.shape[0]
        y = torch.empty(m, weight.shape[0], dtype=torch.float32)
        words = _words_array(weight, bias)
        if self.lib.tierlm_weight_matmul(x.data_ptr(), m, words, y.data_ptr(), torch.get_num_threads()) != 0:
            raise ValueError(f"the native kernels cannot read {weight!r}")
        return y

    def gemm(self, x, weight, bias=None):
        """x [M, K] fp32 @ weight.T (+ bias) -> [M, N] fp32 multiplied in integers (csrc/gemm_a16.h:
        prefill-sized M, activations as int16 per 32 columns), for any quantized weight this build
        multiplies so; None where it does not (fp32 weights, the portable build, a NaN in x)."""
        if x.dim() != 2 or x.shape[1] != weight.shape[1] or not is_cpu_fp32(x):
            raise ValueError(f"x {list(x.shape)} {x.dtype} is no contiguous fp32 CPU [M, {weight.shape[1]}]")
        keep = []
        words = describe_weight(weight, bias, tuple(weight.shape), keep)
        if words is None:
            return None
        m = x.shape[0]
        y = torch.empty(m, weight.shape[0], dtype=torch.float32)
        array = (ctypes.c_int64 * 9)(*words)
        if self.lib.tierlm_weight_gemm(x.data_ptr(), m, array, y.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return y

    def dequantize_words_into(self, weight, out):
        """out [N, K] fp32 = such a weight dequantized, exactly the `gguf` package's values."""
        if self.lib.tierlm_weight_dequant(_words_array(weight), out.data_ptr(), torch.get_num_threads()) != 0:
            raise ValueError(f"the native kernels cannot dequantize {weight!r}")
        return out

    def matmul_iq4(self, x, packed, scales=None, superblocks=None, bias=None):
        """x [M, K] fp32 @ a GGUF IQ4_NL (fp16 `scales` [N, K / 32]) or IQ4_XS (`superblocks`
        [N, K / 256 * 10]) weight (tierlm/quant/iq4.py).T (+ bias) -> [M, N] fp32."""
        m, k = x.shape
        n = packed.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        s = superblocks if superblocks is not None else scales
        done = self.lib.tierlm_iq4_matmul(x.data_ptr(), m, k, packed.data_ptr(), s.data_ptr(), n,
                                          bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                          torch.get_num_threads(), int(superblocks is not None))  # fmt: skip
        if done != 0:
            raise ValueError(f"IQ4 weights cannot have K = {k} (a multiple of 32, of 256 for IQ4_XS)")
        return y

    def dequantize_iq4_into(self, packed, scales, superblocks, out):
        """out [N, K] fp32 = the IQ4 weight dequantized, exactly the `gguf` package's values."""
        n, k = out.shape
        s = superblocks if superblocks is not None else scales
        done = self.lib.tierlm_iq4_dequant(packed.data_ptr(), s.data_ptr(), n, k, out.data_ptr(),
                                           torch.get_num_threads(), int(superblocks is not None))  # fmt: skip
        if done != 0:
            raise ValueError(f"IQ4 weights cannot have K = {k} (a multiple of 32, of 256 for IQ4_XS)")
        return out

    def kv_store(self, kv_type: int, x, codes, scales=None):
        """Rows x [n, D] fp32 written into codes [n, row] (and fp16 scales [n, D / 32]) as the
        fused decode step writes KV rows of tl::KVType `kv_type`. All contiguous, on the CPU."""
        n, d = x.shape
        done = self.lib.tierlm_kv_store(kv_type, x.data_ptr(), n, d, codes.data_ptr(),
                                        scales.data_ptr() if scales is not None else None)  # fmt: skip
        if done != 0:
            raise ValueError(f"KV type {kv_type} cannot hold rows of {d} values")
        return codes, scales

    def kv_attend(self, kv_type: int, q, keys, key_scales, values, value_scales, pages=None, page_tokens: int = 0,
                  positions: int | None = None):  # fmt: skip
        """out [D]: the decode step's attention of q [D] over stored rows (codes [rows, row], fp16
        scales [rows, D / 32] or None, as `kv_store` writes them). All contiguous, on the CPU.
        Position t is row t, or with `pages` (int64 [count]) of `page_tokens` rows each (a power of
        two), row pages[t // page_tokens] * page_tokens + t % page_tokens; `positions` (default:
        every row) says how many."""
        n, d = positions if positions is not None else keys.shape[0], q.shape[0]
        out = torch.empty(d, dtype=torch.float32)
        pointer = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        shift = page_tokens.bit_length() - 1 if pages is not None else 0
        done = self.lib.tierlm_kv_attend(kv_type, q.data_ptr(), keys.data_ptr(), pointer(key_scales),
                                         values.data_ptr(), pointer(value_scales), pointer(pages), shift, n, d,
                                         out.data_ptr())  # fmt: skip
        if done != 0:
            raise ValueError(f"KV type {kv_type} cannot hold rows of {d} values")
        return out


def weight_words(weight, bias_ptr: int = 0) -> tuple | None:
    """tl::Weight's 9 words (csrc/library.cpp `weight_from_words`) for a weight with
    `native_words()` and the address of its fp32 CPU bias (0: none); None off the CPU."""
    words = weight.native_words()
    if words is None:
        return None
    data, scales, offsets, group, kind, half = words
    rows, cols = weight.shape
    return data, scales, offsets, bias_ptr, rows, cols, group, kind, half


def _words_array(weight, bias=None):
    """`weight_words` as the int64 array the entry points take; ValueError where there are none."""
    words = weight_words(weight, bias.data_ptr() if bias is not None else 0)
    if words is None:
        raise ValueError(f"the native kernels cannot read {weight!r}: its parts must be CPU tensors")
    return (ctypes.c_int64 * 9)(*words)


def _half_scales(scales, offsets) -> int:
    """1 for fp16 scales (GGUF Q8_0's form, symmetric only), 0 for fp32; ValueError otherwise."""
    if scales.dtype == torch.float32:
        return 0
    if scales.dtype == torch.float16 and offsets is None:
        return 1
    raise ValueError(f"int8 scales must be fp32, or fp16 without offsets; got {scales.dtype}"
                     f"{' with offsets' if offsets is not None else ''}")  # fmt: skip


def load_native(build_root: Path | None = None, flags: tuple[str, ...] = FLAGS) -> NativeKernel:
    """The native kernel, compiled into `build_root` (default `kernels_root()`: $TIERLM_KERNELS,
    else `cache_root()/kernels`) if needed.

    `flags` are the compiler flags (tests pass e.g. `-march=x86-64-v3` for the AVX2 path,
    `-march=x86-64-v2` for the portable one). Raises KernelUnavailable when there is no C++ compiler or the
    build fails.
    """
    library = built_library(build_root, flags)
    try:
        return NativeKernel(library)
    except OSError as err:  # a truncated or foreign library: report, the caller falls back
        raise KernelUnavailable(f"cannot load {library}: {err}") from None


def built_library(build_root: Path | None = None, flags: tuple[str, ...] = FLAGS,
                  progress: ProgressFactory | None = None) -> Path:  # fmt: skip
    """The library's path, compiled first when missing, as the phase "building the int8 kernels"
    of `progress`. KernelUnavailable as `load_native` says."""
    build_root = kernels_root() if build_root is None else build_root
    compiler = _compiler()
    library = build_root / f"tierlm_cpu-{_build_key(compiler, flags)}.so"
    if not library.exists():
        guess = _build_estimate(build_root)
        report = progress(f"building the int8 kernels for this CPU (one-time, ~{guess} s)") if progress else None
        _compile(compiler, flags, library, report)
    return library


def _build_estimate(build_root: Path) -> int:
    """Seconds the last build here took, else `FIRST_BUILD_GUESS_S`."""
    try:
        return max(1, round(float((build_root / BUILD_RECORD).read_text())))
    except (OSError, ValueError):
        return FIRST_BUILD_GUESS_S


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelUnavailable("no C++ compiler found (set $CXX or install g++)")


@functools.lru_cache(maxsize=None)
def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Hash of everything the library's bytes depend on: source, flags, compiler, CPU (once per
    process: every CPU load checks that the library is built)."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelUnavailable(f"{compiler} --version failed: {err}") from None
    parts = [*_source_texts(), " ".join(flags), version, platform.machine(), _cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _source_texts() -> list[str]:
    """Every file of csrc, name and text, in a fixed order (all of them go into the key)."""
    try:
        files = sorted(p for p in SOURCES.iterdir() if p.suffix in (".cpp", ".h"))
        return [f"{p.name}\n{p.read_text()}" for p in files]
    except OSError as err:
        raise KernelUnavailable(f"cannot read the kernel sources in {SOURCES}: {err}") from None


def _cpu_identity() -> str:
    """The CPU model and feature flags, since `-march=native` bakes them into the library."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _compile(compiler: str, flags: tuple[str, ...], library: Path, progress=None) -> None:
    try:
        _build(compiler, flags, library, progress)
    except OSError as err:  # a read-only or full cache: the caller falls back to another kernel
        raise KernelUnavailable(f"cannot build the int8 kernel in {library.parent}: {err.strerror or err}") from None


def _build(compiler: str, flags: tuple[str, ...], library: Path, progress=None) -> None:
    """Compile into `library`; `progress(0, 1)` as the compiler starts and every `POLL_S` while it
    runs, `progress(1, 1)` once the library is in place."""
    report = progress or (lambda done, total: None)
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build under a unique name and rename: concurrent builders never expose a partial file.
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".build-") as tmp:
        sources = [str(p) for p in sorted(SOURCES.glob("*.cpp"))]
        output = Path(tmp) / library.name
        started = time.monotonic()
        report(0, 1)
        returncode, out, err = _run_compiler([compiler, *flags, f"-I{SOURCES}", *sources, "-o", str(output)], report)
        if returncode != 0:
            tail = (err or out).strip().splitlines()[-3:]
            raise KernelUnavailable(f"building the int8 kernel failed: {' | '.join(tail)}")
        os.replace(output, library)
    try:
        (library.parent / BUILD_RECORD).write_text(f"{time.monotonic() - started:.0f}\n")
    except OSError:
        pass  # only the next estimate misses it
    report(1, 1)


def _run_compiler(command: list[str], report) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the compiler, `report(0, 1)` every `POLL_S` while it runs."""
    started = time.monotonic()
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
            while True:
                try:
                    out, err = child.communicate(timeout=POLL_S)  # retrying it loses no output
                    return child.returncode, out, err
                except subprocess.TimeoutExpired:
                    if time.monotonic() - started > BUILD_TIMEOUT_S:
                        child.kill()
                        child.communicate()
                        raise KernelUnavailable(f"{command[0]} ran over {BUILD_TIMEOUT_S} s") from None
                    report(0, 1)
    except OSError as err:
        raise KernelUnavailable(f"{command[0]} failed to run: {err}") from None


def is_cpu_fp32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def describe_weight(weight, bias, shape: tuple[int, int], keep: list) -> tuple | None:
    """`weight` (fp32 tensor, Int8Weight or Int4Weight of `shape`) and its bias as tl::Weight's
    9 words (data, scales, offsets, bias, rows, cols, group, kind, half); None if unsupported."""
    if weight.shape != shape:
        return None
    bias_ptr = 0
    if bias is not None:
        if not (isinstance(bias, torch.Tensor) and bias.is_cpu and bias.numel() == shape[0]):
            return None
        bias = bias.float().contiguous()
        keep.append(bias)  # a converted copy must outlive the call
        bias_ptr = bias.data_ptr()
    rows, cols = shape
    if isinstance(weight, torch.Tensor):
        if not is_cpu_fp32(weight):
            return None
        return weight.data_ptr(), 0, 0, bias_ptr, rows, cols, cols, KIND_FP32, 0
    runs = getattr(weight, "runs", None)
    if runs is not None:  # a row stack: its runs' words in an array that `keep` holds for the call
        described = [describe_weight(run, None, tuple(run.shape), keep) for run in runs]
        if any(d is None or d[7] == KIND_STACK for d in described):
            return None
        array = (WeightArg * len(runs))(*(WeightArg(*d) for d in described))
        keep.append(array)
        return ctypes.addressof(array), 0, 0, bias_ptr, rows, cols, len(runs), KIND_STACK, 0
    if hasattr(weight, "native_words"):  # a weight that describes itself (GGUF Q2_K/Q3_K: quant/low_bit_k.py)
        return weight_words(weight, bias_ptr)
    if getattr(weight, "codebook", False):  # GGUF IQ4_NL / IQ4_XS (quant/iq4.py): read as stored
        parts = list(weight.tensors().values())
        if not all(p.is_cpu and p.is_contiguous() for p in parts):
            return None
        if weight.superblocks is not None:
            return weight.packed.data_ptr(), weight.superblocks.data_ptr(), 0, bias_ptr, rows, cols, 32, KIND_IQ4X, 0
        return weight.packed.data_ptr(), weight.scales.data_ptr(), 0, bias_ptr, rows, cols, 32, KIND_IQ4, 1
    codes = getattr(weight, "codes", None)
    if codes is not None:  # GGUF Q5_0 / Q5_1 / Q5_K (quant/q5.py): read as stored
        parts = list(weight.tensors().values())
        if not all(p.is_cpu and p.is_contiguous() for p in parts):
            return None
        if weight.superblocks is not None:
            return codes.data_ptr(), weight.superblocks.data_ptr(), 0, bias_ptr, rows, cols, 32, KIND_INT5K, 0
        offsets = weight.offsets.data_ptr() if weight.offsets is not None else 0
        return codes.data_ptr(), weight.scales.data_ptr(), offsets, bias_ptr, rows, cols, 32, KIND_INT5, 1
    superblocks = getattr(weight, "superblocks", None)
    if superblocks is not None:  # GGUF Q4_K / Q6_K (quant/q4k.py, q6k.py): read as stored
        high = getattr(weight, "high", None)
        parts = [weight.packed, superblocks] + ([high] if high is not None else [])
        if not all(p.is_cpu and p.is_contiguous() for p in parts):
            return None
        if high is not None:
            return weight.packed.data_ptr(), superblocks.data_ptr(), high.data_ptr(), bias_ptr, rows, cols, 16, KIND_INT6K, 0
        return weight.packed.data_ptr(), superblocks.data_ptr(), 0, bias_ptr, rows, cols, 32, KIND_INT4K, 0
    if getattr(weight, "packed", None) is not None:
        return _int4_words(weight, bias_ptr, rows, cols)
    qweight = getattr(weight, "qweight", None)
    if qweight is None or not qweight.is_cpu or qweight.dtype != torch.int8:
        return None
    offsets = weight.offsets_2d
    offsets_ptr = offsets.data_ptr() if offsets is not None else 0
    scales = weight.scales_2d  # fp32, or fp16 (symmetric: GGUF Q8_0's form)
    half = int(scales.dtype == torch.float16)
    if half and offsets is not None:
        return None
    return qweight.data_ptr(), scales.data_ptr(), offsets_ptr, bias_ptr, rows, cols, weight.group, KIND_INT8, half


def _int4_words(weight, bias_ptr: int, rows: int, cols: int) -> tuple | None:
    """An Int4Weight's words, if its parts are what the native code reads: contiguous CPU uint8
    packed [rows, cols / 2], float16 scales (and offsets) [rows, G], group and cols multiples of 32."""
    packed, scales, offsets, group = weight.packed, weight.scales, weight.offsets, weight.group_size
    if not isinstance(group, int) or group <= 0 or group % 32 or cols % 32:
        return None
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (rows, cols // 2):
        return None
    want = (rows, -(-cols // group))
    parts = [packed, scales] + ([offsets] if offsets is not None else [])
    if any(not (p.is_cpu and p.is_contiguous()) for p in parts):
        return None
    for part in parts[1:]:
        if part.dtype != torch.float16 or tuple(part.shape) != want:
            return None
    offsets_ptr = offsets.data_ptr() if offsets is not None else 0
    return packed.data_ptr(), scales.data_ptr(), offsets_ptr, bias_ptr, rows, cols, group, KIND_INT4, 1
