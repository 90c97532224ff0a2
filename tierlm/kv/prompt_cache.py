"""Prompt-cache files: a conversation's token ids and the KV rows computed for them, saved so a
later run resumes it without prefilling it again (as llama-server's slot save and mlx-lm's
prompt caches do), and trusted only whole and only by the model that computed them.

Layout: MAGIC (8 bytes) | header length (8 bytes, little-endian) | header (UTF-8 JSON) |
payload: keys then values, each [layers, kv_heads, length, head_dim] raw in the KV dtype |
sha256 of every byte before it (32 bytes).

The header holds the format version, the identity of what computed the rows (the weights'
content key, compute and KV dtypes, device type, cache layout: `identity` from the caller), the
token ids the rows hold and the conversation they belong to. A reader checks the size, then the
checksum, then the version and the identity before it uses anything; a writer writes a hidden
temporary beside the file, fsyncs it and renames it over the file, so a killed save leaves at most
a temporary no reader opens (tierlm.atomic sweeps it once its process is gone).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.atomic import atomic_file

MAGIC = b"TLMKVSES"
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<Q")
_DIGEST_BYTES = 32
_MAX_HEADER = 64 << 20  # a header holds token ids and text: far below this for any context
_READ_CHUNK = 8 << 20


class PromptCacheRejected(Exception):
    """A file that must not be used: `reason` says why in a few words. `conversation` is set only
    when the file is whole (checksum verified) but was computed by another model: then `reason`
    is how the models differ, and its messages are sound even though its rows are not."""

    def __init__(self, reason: str, conversation: dict | None = None):
        super().__init__(reason)
        self.reason = reason
        self.conversation = conversation


@dataclass
class PromptCache:
    token_ids: list[int]  # the ids whose keys/values `keys`/`values` hold, in order
    conversation: dict  # what the caller saved beside them (messages, system prompt)
    keys: torch.Tensor  # [layers, kv_heads, len(token_ids), head_dim]
    values: torch.Tensor


def save_prompt_cache(path: Path, identity: dict, conversation: dict, token_ids: list[int],
                      keys: torch.Tensor, values: torch.Tensor) -> None:  # fmt: skip
    """Write `keys`/`values` [layers, kv_heads, N, head_dim] (N = len(token_ids); views of a
    larger cache are fine) to `path` atomically. An OSError leaves `path` as it was."""
    layers, kv_heads, length, head_dim = keys.shape
    if values.shape != keys.shape or length != len(token_ids):
        raise ValueError(f"keys {tuple(keys.shape)}, values {tuple(values.shape)}, {len(token_ids)} ids")
    layer_bytes = kv_heads * length * head_dim * keys.element_size()
    header = {
        "format_version": FORMAT_VERSION,
        "identity": identity,
        "kv_dtype": str(keys.dtype).removeprefix("torch."),
        "shape": [layers, kv_heads, length, head_dim],
        "payload_bytes": 2 * layers * layer_bytes,
        "token_ids": list(token_ids),
        "conversation": conversation,
    }
    head = json.dumps(header, ensure_ascii=False).encode()
    digest = hashlib.sha256()
    with atomic_file(path) as handle:
        for piece in (MAGIC, _LENGTH.pack(len(head)), head):
            digest.update(piece)
            handle.write(piece)
        # One layer at a time: the copy out of the cache (off an accelerator) stays one layer's size.
        for slab in (keys, values):
            for layer in range(layers):
                raw = slab[layer].cpu().contiguous().view(torch.uint8).numpy()
                digest.update(raw)
                handle.write(raw)
        handle.write(digest.digest())


def read_prompt_cache(path: Path, identity: dict) -> PromptCache:
    """The prompt cache at `path`, checked whole and made by `identity`; PromptCacheRejected
    says why it is not used (FileNotFoundError when there is none)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        header, head_bytes = _read_header(handle, size)
        if header.get("format_version") != FORMAT_VERSION:
            raise PromptCacheRejected(f"it has format version {header.get('format_version')!r}, "
                                      f"this tierlm reads {FORMAT_VERSION}")  # fmt: skip
        try:
            layers, kv_heads, length, head_dim = (int(n) for n in header["shape"])
            dtype = getattr(torch, str(header["kv_dtype"]))
            payload_bytes = int(header["payload_bytes"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PromptCacheRejected("it is damaged (its header is incomplete)") from None
        expected = len(MAGIC) + _LENGTH.size + len(head_bytes) + payload_bytes + _DIGEST_BYTES
        if size != expected:
            raise PromptCacheRejected(f"it is truncated ({size:,} of {expected:,} bytes)" if size < expected
                                      else f"it is damaged ({size - expected:,} bytes too many)")  # fmt: skip
        digest = hashlib.sha256(MAGIC + _LENGTH.pack(len(head_bytes)) + head_bytes)
        payload = bytearray(payload_bytes)
        view = memoryview(payload)
        done = 0
        while done < payload_bytes:
            got = handle.readinto(view[done : done + _READ_CHUNK])
            if not got:
                raise PromptCacheRejected("it is truncated (it shrank while read)")
            digest.update(view[done : done + got])
            done += got
        if handle.read(_DIGEST_BYTES) != digest.digest():
            raise PromptCacheRejected("it is damaged (checksum mismatch)")
    # Whole and as written from here on.
    conversation = header.get("conversation") if isinstance(header.get("conversation"), dict) else {}
    differs = identity_difference(header.get("identity"), identity)
    if differs is not None:
        raise PromptCacheRejected(differs, conversation)
    token_ids = header.get("token_ids")
    element = torch.empty((), dtype=dtype).element_size()
    if (not isinstance(token_ids, list) or len(token_ids) != length
            or payload_bytes != 2 * layers * kv_heads * length * head_dim * element):  # fmt: skip
        raise PromptCacheRejected("it is damaged (its sizes disagree)")
    rows = torch.frombuffer(payload, dtype=dtype) if payload_bytes else torch.empty(0, dtype=dtype)
    rows = rows.view(2, layers, kv_heads, length, head_dim)
    return PromptCache([int(t) for t in token_ids], conversation, rows[0], rows[1])


def identity_difference(saved, current: dict) -> str | None:
    """The first field in which a file's identity differs from `current`, as "name: saved, not
    current"; None when they are the same."""
    if not isinstance(saved, dict):
        return "no identity recorded"
    for name, value in current.items():
        if saved.get(name) != value:
            return f"{name} {_short(saved.get(name))}, not {_short(value)}"
    extra = sorted(set(saved) - set(current))
    return f"{extra[0]} recorded, which this run does not have" if extra else None


def _short(value) -> str:
    text = str(value)
    return text[:19] + "…" if len(text) > 20 else text


def _read_header(handle, size: int) -> tuple[dict, bytes]:
    magic = handle.read(len(MAGIC))
    if magic != MAGIC and not MAGIC.startswith(magic):
        raise PromptCacheRejected("it is not a tierlm prompt-cache file")
    if size < len(MAGIC) + _LENGTH.size:
        raise PromptCacheRejected(f"it is truncated ({size} bytes)")
    (length,) = _LENGTH.unpack(handle.read(_LENGTH.size))
    if length > _MAX_HEADER:
        raise PromptCacheRejected("it is damaged (its header length is implausible)")
    if len(MAGIC) + _LENGTH.size + length + _DIGEST_BYTES > size:
        raise PromptCacheRejected(f"it is truncated ({size:,} bytes, its header alone needs more)")
    head = handle.read(length)
    try:
        header = json.loads(head)
    except ValueError:
        raise PromptCacheRejected("it is damaged (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise PromptCacheRejected("it is damaged (its header is not an object)")
    return header, head
