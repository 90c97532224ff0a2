"""Weight-only quantization (W8A16 INT8, W4A16 INT4, mixed) and its matmul kernels per device.

    modes.py          quant mode names (int8, int8-g128, fp16, bf16, fp32) -> QuantMode
    int8.py           quantize_int8() and Int8Weight (.linear, .rows, .dequantize, .tensors)
    int4.py           quantize_int4() and Int4Weight, the same for packed 4-bit weights
    nibbles.py        the INT4 packed layout and its reference dequantization
    grids.py          finding the grid a source group already sits on (GGUF Q4/Q5/Q8)
    mixed.py          mixed:SIZE's per-weight choice of int8 or int4
    dispatch.py       KernelChoice: which kernel runs where, calibrated once per process
    kernel_api.py     the kernel interface and KernelUnavailable
    native.py         the C++ CPU kernels (AVX-512, AVX2, portable), built once into the cache
    numba_kernel.py   the numba CPU kernel, for machines without a compiler (optional numba)
    torch_kernels.py  dequantize+BLAS (prefill) and dequantize+F.linear (accelerators)

Importing this package imports nothing heavy; torch comes with `int8` / `dispatch`.
"""

from tierlm.quant.modes import QuantMode, parse_quant_mode

__all__ = ["QuantMode", "parse_quant_mode"]
