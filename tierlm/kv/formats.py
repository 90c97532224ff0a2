"""How a KV cache holds keys and values (`--kv-cache`, the profile's `kv_cache`); torch-free, so
the planner prices each format without loading torch (kv/codec.py encodes and decodes them).

    f32, f16, bf16   each value as that float
    q8_0             llama.cpp's Q8_0 along each head's dimension: per 32 values one fp16 scale d
                     and 32 int8 codes q, value = d * q (8.5 bits a value)
    q4_0             llama.cpp's Q4_0: per 32 values one fp16 scale d and 16 bytes of 4-bit codes
                     (value j in the low nibble of byte j, value 16 + j in its high nibble),
                     value = d * (q - 8) (4.5 bits a value)

The quantized formats hold each head's values after an orthonormal Walsh-Hadamard rotation
(kv/codec.py `rotate`), which costs no bits and spreads outlier channels over the block.
Scales are per position, head and 32 values: a token's keys are quantized once, when it is
written, and never again (a scale over a whole page would have to change as the page fills).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.errors import TierlmError

AUTO = "auto"
GROUP = 32  # values per scale of the quantized formats (llama.cpp's block)
# Spellings older profiles (`kv_dtype`) and torch users write.
_ALIASES = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "half": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class KVFormat:
    name: str
    code_bits: int  # bits of one value's code (its float width for the float formats)
    quantized: bool

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one position of one head holds: its codes, plus a 2-byte scale per GROUP values."""
        codes = head_dim * self.code_bits // 8
        return codes + (2 * head_dim // GROUP if self.quantized else 0)

    def bits_per_value(self, head_dim: int = 128) -> float:
        return 8 * self.row_bytes(head_dim) / head_dim

    def unsupported(self, head_dim: int) -> str | None:
        """Why a model with heads of `head_dim` cannot use this format, or None."""
        if self.quantized and head_dim % GROUP:
            return f"--kv-cache {self.name} quantizes each head in blocks of {GROUP} values; this model's heads have {head_dim}"
        return None


FORMATS = {
    "f32": KVFormat("f32", 32, False),
    "f16": KVFormat("f16", 16, False),
    "bf16": KVFormat("bf16", 16, False),
    "q8_0": KVFormat("q8_0", 8, True),
    "q4_0": KVFormat("q4_0", 4, True),
}
KV_CACHE_CHOICES = (AUTO, *FORMATS)


def check_kv_cache(name, where: str = "--kv-cache") -> str:
    """`name` as a KV cache choice ("auto" or a format), aliases folded; one line otherwise."""
    folded = _ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else None
    if folded not in KV_CACHE_CHOICES:
        raise TierlmError(f"{where} {name} is not a KV cache type", f"use one of: {', '.join(KV_CACHE_CHOICES)}")
    return folded


def auto_format(accelerator: bool, compute: str | None = None) -> str:
    """What `auto` holds: the compute dtype (fp32 on CPUs; bf16/fp16 on accelerators)."""
    if compute is not None:
        return _ALIASES.get(compute, compute)
    return "bf16" if accelerator else "f32"


def kv_format(choice: str, accelerator: bool, compute: str | None = None) -> KVFormat:
    """The format a choice (a profile's `kv_cache`, a flag) resolves to on this device."""
    choice = check_kv_cache(choice)
    return FORMATS[auto_format(accelerator, compute) if choice == AUTO else choice]


def model_format(choice: str, accelerator: bool, head_dim: int, compute: str | None = None) -> KVFormat:
    """`kv_format` for a model with heads of `head_dim`; one line when they cannot be held in it
    (the planner and the loader refuse alike)."""
    held = kv_format(choice, accelerator, compute)
    reason = held.unsupported(head_dim)
    if reason:
        raise TierlmError(reason, "use --kv-cache f16 or bf16 for this model")
    return held
