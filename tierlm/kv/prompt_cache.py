"""Prompt-cache files: a conversation's token ids and the KV rows computed for them, saved so a
later run resumes it without prefilling it again (as llama-server's slot save and mlx-lm's
prompt caches do), and trusted only whole and only by the model that computed them.

Layout: MAGIC (8 bytes) | header length (8 bytes, little-endian) | header (UTF-8 JSON) |
payload: the cache's parts one after another (keys and values, then their scales when the
format is quantized: kv/cache.py `rows_of`), each [layers, kv_heads, length, width] raw in its
dtype as the header lists them | sha256 of every byte before it (32 bytes).

The header holds the format version, the identity of what computed the rows (the weights'
content key, compute dtype and KV format, device type, cache layout: `identity` from the caller), the
token ids the rows hold and the conversation they belong to. A reader checks the size, then the
checksum, then the version and the identity before it uses anything; a writer writes a hidden
temporary beside the file, fsyncs it and renames it over the file, so a killed save leaves at most
a temporary no reader opens (tierlm.atomic sweeps it once its process is gone).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.atomic import atomic_file

MAGIC = b"TLMKVSES"
FORMAT_VERSION = 2  # 2: a list of parts (quantized KV formats add scales)
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
    token_ids: list[int]  # the ids whose keys/values `parts` hold, in order
    conversation: dict  # what the caller saved beside them (messages, system prompt)
    parts: list[torch.Tensor]  # each [layers, kv_heads, len(token_ids), width], as saved


def save_prompt_cache(path: Path, identity: dict, conversation: dict, token_ids: list[int],
                      parts: list[torch.Tensor]) -> None:  # fmt: skip
    """Write `parts` (each [layers, kv_heads, N, width], N = len(token_ids); views of a larger
    cache are fine) to `path` atomically. An OSError leaves `path` as it was."""
    if not parts or any(p.shape[:3] != parts[0].shape[:3] or p.dim() != 4 for p in parts) \
            or parts[0].shape[2] != len(token_ids):  # fmt: skip
        raise ValueError(f"parts {[tuple(p.shape) for p in parts]}, {len(token_ids)} ids")
    header = {
        "format_version": FORMAT_VERSION,
        "identity": identity,
        "parts": [{"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape)} for p in parts],
        "payload_bytes": sum(p.numel() * p.element_size() for p in parts),
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
        for slab in parts:
            for layer in range(slab.shape[0]):
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
        if header.get("format_version") not in (1, FORMAT_VERSION):
            raise PromptCacheRejected(f"it has format version {header.get('format_version')!r}, "
                                      f"this tierlm reads {FORMAT_VERSION}")  # fmt: skip
        try:
            if header["format_version"] == 1:  # keys and values in one dtype: its messages stay readable
                header["parts"] = [{"dtype": header["kv_dtype"], "shape": header["shape"]}] * 2
            layouts = [(getattr(torch, str(part["dtype"])), [int(n) for n in part["shape"]]) for part in header["parts"]]
            payload_bytes = int(header["payload_bytes"])
            if not all(isinstance(dtype, torch.dtype) and len(shape) == 4 for dtype, shape in layouts):
                raise ValueError
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
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for dtype, shape in layouts]
    if (not isinstance(token_ids, list) or not layouts or any(shape[2] != len(token_ids) for _, shape in layouts)
            or payload_bytes != sum(sizes)):  # fmt: skip
        raise PromptCacheRejected("it is damaged (its sizes disagree)")
    parts, start = [], 0
    for (dtype, shape), size in zip(layouts, sizes):
        raw = payload[start : start + size]
        parts.append((torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)).view(shape))
        start += size
    return PromptCache([int(t) for t in token_ids], conversation, parts)


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
