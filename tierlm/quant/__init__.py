"""Weight-only quantization (W8A16 INT8) and its matmul kernels per device.

    modes.py          quant mode names (int8, int8-g128, fp16, bf16, fp32) -> QuantMode
    int8.py           quantize_int8() and Int8Weight (.linear, .rows, .dequantize, .tensors)
    dispatch.py       KernelChoice: which kernel runs where, calibrated once per process
    kernel_api.py     the kernel interface and KernelUnavailable
    native.py         the C++ CPU kernel (AVX-512), built once into the cache
    numba_kernel.py   the numba CPU kernel, for machines without a compiler (optional numba)
    torch_kernels.py  dequantize+BLAS (prefill) and dequantize+F.linear (accelerators)

Importing this package imports nothing heavy; torch comes with `int8` / `dispatch`.
"""

from tierlm.quant.modes import QuantMode, parse_quant_mode

__all__ = ["QuantMode", "parse_quant_mode"]
