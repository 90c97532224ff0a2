"""How block tensors are encoded in an artifact and decoded for compute.

2-D weights (projections, embedding, head) take the quant mode's format: INT8 with scales (and
offsets when asymmetric), or a float dtype. 1-D tensors (norms, biases) always stay fp32: they
are tiny and precision-critical.
"""

from __future__ import annotations

from typing import Any, Mapping

from tierlm.quant.modes import QuantMode, parse_quant_mode

CODEC_VERSION = 1  # bump when the same inputs would encode to different bytes

parse_mode = parse_quant_mode


def encode(tensor, mode: QuantMode) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """fp32 tensor -> (encoding name, {part: tensor}, metadata) for `ArtifactWriter.add_tensor`."""
    import torch

    if tensor.dim() == 2 and mode.quantized:
        from tierlm.quant.int8 import quantize_int8

        weight = quantize_int8(tensor, mode.group_size, asymmetric=mode.asymmetric)
        return "int8", weight.tensors(), {"group_size": mode.group_size}
    dtype = getattr(torch, mode.weight_dtype) if tensor.dim() == 2 else torch.float32
    return "plain", {"data": tensor.to(dtype)}, {}


def decode(record, parts: Mapping[str, Any], *, device="cpu", dtype=None):
    """Parts read from an artifact -> what the model computes with, on `device`.

    Plain tensors already in the target dtype on the CPU stay views of the block buffer.
    """
    import torch

    dtype = dtype or torch.float32
    if record.encoding == "int8":
        from tierlm.quant.int8 import Int8Weight

        weight = Int8Weight.from_tensors(parts, record.meta.get("group_size"), dtype=dtype)
        return weight if torch.device(device).type == "cpu" else weight.to(device)
    if record.encoding == "plain":
        return parts["data"].to(device=device, dtype=dtype)
    raise ValueError(f"unknown tensor encoding {record.encoding!r}")
