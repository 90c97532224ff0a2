"""How the native decode rows round activations, as float64 models the kernel tests compare with:
int16 per 32 columns (quant/csrc/gemv_a16.h) or, for the K-quants, int8 per 256 columns as
llama.cpp rounds them (gemv_a8.h), and the bound each rounding puts on a product's error. Its own
module because the kernel tests of several formats share it (and test_a16_kernels imports
test_gguf_carry's blocks)."""

from __future__ import annotations

import torch


def int16_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it, dequantized in float64."""
    groups = x.unflatten(-1, (-1, 32))
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 32767.0 / largest, torch.zeros_like(largest))
    codes = torch.round(groups * inverse)  # fp32 product, rounded half to even as cvtps2dq does
    return (codes.double() * (largest / 32767.0).double()).flatten(-2)


def int8_block_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the K-quants' decode rows quantize it (per 256 columns, to int8), in float64."""
    blocks = x.unflatten(-1, (-1, 256))
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    return (torch.round(blocks * inverse).double() * (largest / 127.0).double()).flatten(-2)


def rounding_bound(x: torch.Tensor, dense: torch.Tensor, *, group: int = 32, levels: int = 32767) -> torch.Tensor:
    largest = x.abs().unflatten(-1, (-1, group)).amax(-1).repeat_interleave(group, -1).double()
    return largest @ dense.abs().double().T / (2 * levels)


# Kinds whose decode rows take x as int8 per 256 columns (gemv_a8.h), with that rounding's bound.
INT8_BLOCK_KINDS = {"Q4_K", "Q5_K", "Q6_K"}


def activation_model(kind: str):
    """(x as kind's decode rows quantize it, the bound that rounding implies) on the integer rows."""
    if kind in INT8_BLOCK_KINDS:
        return int8_block_activations, lambda x, dense: rounding_bound(x, dense, group=256, levels=127)
    return int16_activations, rounding_bound
