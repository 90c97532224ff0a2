"""A preallocated KV cache written in place at the current offset (static shapes)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for every layer: [layers, batch, kv_heads, max_len, head_dim] each.

    Allocated once with `torch.empty`, so pages are only touched as positions fill and
    resident memory grows with the conversation, not with the reserved context.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        device="cpu",
        dtype: torch.dtype = torch.float32,
    ):
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.offset = 0

    @classmethod
    def for_model(cls, config, max_len: int, *, batch: int = 1, device="cpu", dtype=torch.float32):
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            max_len,
            batch=batch,
            device=device,
            dtype=dtype,
        )

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [B, T, kv_heads, D] at the offset; return all so far [B, kv_heads, S, D]."""
        end = self.offset + keys.shape[1]
        self.keys[layer, :, :, self.offset : end].copy_(keys.transpose(1, 2))
        self.values[layer, :, :, self.offset : end].copy_(values.transpose(1, 2))
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def advance(self, length: int) -> None:
        """Commit `length` new positions after every layer has written them."""
        self.offset += length

    def trim(self, length: int) -> None:
        """Forget everything after the first `length` positions (reuse of a shared prefix)."""
        self.offset = min(self.offset, max(0, length))

    def reset(self) -> None:
        self.offset = 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the whole context."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def used_bytes(self) -> int:
        return self.nbytes * self.offset // self.max_len
