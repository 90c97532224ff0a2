"""Generated bad inputs: each case damages a copy of a good file in one way and names the words
the resulting error must contain.

Three families, one per kind of file tierlm reads from disk:
- SAFETENSORS: a model's `model.safetensors` (header fields, sizes, other formats in disguise);
- MANIFESTS: a compiled artifact's `manifest.json`;
- ADAPTERS: a PEFT LoRA adapter's values and settings (`adapter_model.safetensors`, config).
A case is (id, mutate, expected substring); `mutate` edits the directory in place.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import torch

SAFETENSORS = "model.safetensors"


# ----------------------------------------------------------------------------- safetensors


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(header dict, data section) of a safetensors file, without validating anything."""
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def write_raw(path: Path, header: Any, data: bytes, *, size: int | None = None) -> None:
    """A safetensors-shaped file: 8-byte length (`size` overrides it), header JSON, data."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if size is None else size) + text + data)


def _edit(edit: Callable[[dict, bytes], tuple[Any, bytes]], **write) -> Callable[[Path], None]:
    """A mutation that rewrites model.safetensors through `edit(header, data)`."""

    def mutate(model_dir: Path) -> None:
        path = model_dir / SAFETENSORS
        header, data = read_raw(path)
        header, data = edit(header, data)
        write_raw(path, header, data, **write)

    return mutate


def _tensor(edit: Callable[[dict], None], name: str = "model.layers.0.self_attn.q_proj.weight"):
    """Edit one tensor's header record in place."""

    def change(header: dict, data: bytes):
        edit(header[name])
        return header, data

    return _edit(change)


def _set(field: str, value: Any):
    return _tensor(lambda meta: meta.__setitem__(field, value))


def _shift_offsets(delta_begin: int, delta_end: int):
    return _tensor(lambda m: m.__setitem__("data_offsets", [m["data_offsets"][0] + delta_begin, m["data_offsets"][1] + delta_end]))


def _reverse(meta: dict) -> None:
    meta["data_offsets"] = meta["data_offsets"][::-1]


def _overlap(header: dict, data: bytes):
    # o_proj [H, H] has q_proj's size: pointing it at q_proj's bytes is a consistent but shared range.
    header["model.layers.0.self_attn.o_proj.weight"]["data_offsets"] = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    return header, data


def _past_end(header: dict, data: bytes):
    meta = header["model.layers.0.self_attn.q_proj.weight"]
    size = meta["data_offsets"][1] - meta["data_offsets"][0]
    meta["data_offsets"] = [len(data), len(data) + size]
    return header, data


def _nan_values(header: dict, data: bytes):
    begin = header["model.layers.1.mlp.down_proj.weight"]["data_offsets"][0]
    nan = struct.pack("<f", float("nan"))
    return header, data[:begin] + nan + data[begin + 4 :]


def _fixed_bytes(blob: bytes) -> Callable[[Path], None]:
    return lambda model_dir: (model_dir / SAFETENSORS).write_bytes(blob)


def _torch_zip(model_dir: Path) -> None:
    import io

    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buffer)  # the zip container torch.save writes since 1.6
    (model_dir / SAFETENSORS).write_bytes(buffer.getvalue())


def _sharded(weight_map_value: Callable[[str], str]):
    """Split into an index whose weight_map values are rewritten by `weight_map_value`."""

    def mutate(model_dir: Path) -> None:
        header, _ = read_raw(model_dir / SAFETENSORS)
        shard = "model-00001-of-00001.safetensors"
        (model_dir / SAFETENSORS).rename(model_dir / shard)
        names = [n for n in header if n != "__metadata__"]
        index = {"metadata": {}, "weight_map": {n: weight_map_value(shard) for n in names}}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    return mutate


def _duplicate_shard(model_dir: Path) -> None:
    """Two shards that both hold every tensor (a sibling of overlapping ranges, across files)."""
    header, _ = read_raw(model_dir / SAFETENSORS)
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        shutil.copyfile(model_dir / SAFETENSORS, model_dir / shard)
    (model_dir / SAFETENSORS).unlink()
    names = [n for n in header if n != "__metadata__"]
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


SAFETENSORS_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("offsets-short", _shift_offsets(0, -4), "needs"),
    ("offsets-long", _shift_offsets(0, 4), "needs"),
    ("offsets-reversed", _tensor(_reverse), "needs"),
    ("offsets-negative", _shift_offsets(-10**6, 0), "not two non-negative integers"),
    ("offsets-float", _tensor(lambda m: m.__setitem__("data_offsets", [float(x) for x in m["data_offsets"]])), "not two non-negative integers"),
    ("offsets-missing", _tensor(lambda m: m.pop("data_offsets")), "data_offsets"),
    ("offsets-overlap", _edit(_overlap), "overlap"),
    ("offsets-past-end", _edit(_past_end), "truncated"),
    ("float-relabelled-int32", _set("dtype", "I32"), "must be floating point"),
    ("float-relabelled-int8", _tensor(lambda m: m.update(dtype="I8", shape=[m["shape"][0], m["shape"][1] * 4])), "must be floating point"),
    ("dtype-unknown", _set("dtype", "F4"), "unsupported dtype"),
    ("dtype-not-string", _set("dtype", 7), "unsupported dtype"),
    ("shape-negative", _tensor(lambda m: m.__setitem__("shape", [-m["shape"][0], -m["shape"][1]])), "non-negative integers"),
    ("shape-strings", _tensor(lambda m: m.__setitem__("shape", [str(d) for d in m["shape"]])), "non-negative integers"),
    ("shape-not-list", _set("shape", 4096), "non-negative integers"),
    ("record-empty", _tensor(lambda m: m.clear()), "unsupported dtype"),
    ("record-not-object", _edit(lambda h, d: ({**h, "model.norm.weight": [1, 2]}, d)), "no dtype/shape/data_offsets record"),
    ("header-length-2^62", _edit(lambda h, d: (h, d), size=2**62), "header length"),
    ("header-length-2^64-1", _edit(lambda h, d: (h, d), size=2**64 - 1), "header length"),
    ("header-list", _edit(lambda h, d: ([1, 2, 3], d)), "JSON list"),
    ("header-number", _edit(lambda h, d: (42, d)), "JSON int"),
    ("header-not-json", _fixed_bytes(struct.pack("<Q", 4) + b"{{{{" + b"\0" * 64), "not valid JSON"),
    ("file-empty", _fixed_bytes(b""), "shorter than its header"),
    ("nan-in-weights", _edit(_nan_values), "NaN or Inf"),
    ("zip-named-safetensors", _torch_zip, "pickle/zip checkpoint"),
    ("pickle-named-safetensors", _fixed_bytes(pickle.dumps({"w": [0.0] * 8}, protocol=4)), "pickle/zip checkpoint"),
    ("gguf-named-safetensors", _fixed_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 64), "GGUF file"),
    ("index-climbs-out", _sharded(lambda shard: f"../../../{shard}"), "outside the model directory"),
    ("index-absolute", _sharded(lambda shard: f"/etc/{shard}"), "outside the model directory"),
    ("index-not-strings", _sharded(lambda shard: 3), "not a valid safetensors index"),
    ("tensor-in-two-shards", _duplicate_shard, "is also in"),
]


# ----------------------------------------------------------------------------- manifests


def _manifest(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    """A mutation of manifest.json: `edit` changes the parsed dict in place."""

    def mutate(directory: Path) -> None:
        path = directory / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))

    return mutate


def _whole_manifest(value: Any) -> Callable[[Path], None]:
    return lambda directory: (directory / "manifest.json").write_text(json.dumps(value))


def _part(manifest: dict, block: str = "layers.1", tensor: str = "wqkv", part: str = "qweight") -> dict:
    return manifest["blocks"][block]["tensors"][tensor]["parts"][part]


def _block(manifest: dict, block: str = "layers.1") -> dict:
    return manifest["blocks"][block]


MANIFEST_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("manifest-list", _whole_manifest([]), "JSON list"),
    ("manifest-number", _whole_manifest(7), "JSON int"),
    ("manifest-not-json", lambda d: (d / "manifest.json").write_text("{"), "unreadable manifest"),
    ("manifest-old-format", _manifest(lambda m: m.update(format_version=1)), "format version"),
    ("blocks-list", _manifest(lambda m: m.update(blocks=list(m["blocks"]))), "blocks is a list"),
    ("blocks-empty", _manifest(lambda m: m.update(blocks={})), "no blocks"),
    ("block-missing", _manifest(lambda m: m["blocks"].pop("layers.1")), "'layers.1' is missing"),
    ("block-extra", _manifest(lambda m: m["blocks"].update({"layers.99": {"offset": 0, "nbytes": 0, "crc32": [], "tensors": {}}})), "unexpected block"),
    ("tensor-missing", _manifest(lambda m: _block(m)["tensors"].pop("wo")), "does not hold exactly"),
    ("block-offset-negative", _manifest(lambda m: _block(m).update(offset=-4096)), "not a non-negative integer"),
    ("block-offset-string", _manifest(lambda m: _block(m).update(offset="0")), "not a non-negative integer"),
    ("block-past-file-end", _manifest(lambda m: _block(m).update(offset=m["weights_bytes"])), "past the end"),
    ("blocks-overlap", _manifest(lambda m: _block(m).update(offset=_block(m, "layers.0")["offset"])), "overlap"),
    ("weights-bytes-wrong", _manifest(lambda m: m.update(weights_bytes=m["weights_bytes"] + 1)), "wrong size"),
    ("checksums-missing", _manifest(lambda m: _block(m).pop("crc32")), "no checksum"),
    ("checksums-not-ints", _manifest(lambda m: _block(m).update(crc32=["x"] * len(_block(m)["crc32"]))), "32-bit"),
    ("checksum-algorithm", _manifest(lambda m: m.update(checksum={"algorithm": "none", "chunk_bytes": 1})), "checksum"),
    ("part-dtype-unknown", _manifest(lambda m: _part(m).update(dtype="complex64")), "unknown dtype"),
    ("part-offset-negative", _manifest(lambda m: _part(m).update(offset=-64)), "not a non-negative integer"),
    ("part-outside-block", _manifest(lambda m: _part(m).update(offset=_block(m)["nbytes"])), "outside its"),
    ("part-size-lies", _manifest(lambda m: _part(m).update(nbytes=_part(m)["nbytes"] // 2)), "needs"),
    ("part-shape-negative", _manifest(lambda m: _part(m).update(shape=[-1, 64])), "non-negative integers"),
    ("parts-overlap", _manifest(lambda m: _part(m, part="scales").update(offset=_part(m)["offset"])), "overlap"),
    ("shape-transposed", _manifest(lambda m: _part(m).update(shape=_part(m)["shape"][::-1])), "expected float"),
    ("shape-not-config", _manifest(lambda m: _part(m, tensor="attn_norm", part="data").update(shape=[8, 8])), "config.json implies"),
    ("encoding-unknown", _manifest(lambda m: _block(m)["tensors"]["wqkv"].update(encoding="int3")), "unknown encoding"),
    ("encoding-part-missing", _manifest(lambda m: _block(m)["tensors"]["wqkv"]["parts"].pop("scales")), "expected"),
    ("plain-as-int", _manifest(lambda m: _part(m, tensor="attn_norm", part="data").update(dtype="int8", shape=[_part(m, tensor="attn_norm", part="data")["nbytes"]])), "plain tensor stored as int8"),
    ("group-size-string", _manifest(lambda m: _block(m)["tensors"]["wqkv"]["meta"].update(group_size="32")), "group_size"),
    ("alias-dangling", _manifest(lambda m: _block(m, "head").update(aliases={"head": "embed/nothing"}, tensors={})), "alias"),
]


# An INT4 artifact's records (packed nibbles, fp16 scales and offsets: tierlm/quant/int4.py).
INT4_MANIFEST_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("int4-packed-as-int8", _manifest(lambda m: _part(m, part="packed").update(dtype="int8")), "expected 2-D uint8"),
    ("int4-half-chunk", _manifest(lambda m: _part(m, part="packed").update(
        shape=[_part(m, part="packed")["nbytes"] // 8, 8])), "16-byte chunks"),
    ("int4-scales-fp32", _manifest(lambda m: _part(m, part="scales").update(
        dtype="float32", shape=[_part(m, part="scales")["shape"][0] // 2, _part(m, part="scales")["shape"][1]])), "expected float16"),
    ("int4-group-48", _manifest(lambda m: _block(m)["tensors"]["wqkv"]["meta"].update(group_size=48)), "multiple of 32"),
    ("int4-group-missing", _manifest(lambda m: _block(m)["tensors"]["wqkv"]["meta"].pop("group_size")), "multiple of 32"),
]  # fmt: skip

# ----------------------------------------------------------------------------- LoRA adapters

LORA_MODULE = "base_model.model.model.layers.0.self_attn.q_proj"


def write_adapter(directory: Path, hidden: int, *, rank: int = 4, config: dict | None = None,
                  tensors: dict | None = None, seed: int = 0) -> Path:
    """A PEFT LoRA adapter on layer 0's q_proj, written by hand (no peft needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    factors = {
        f"{LORA_MODULE}.lora_A.weight": 0.05 * torch.randn(rank, hidden, generator=generator),
        f"{LORA_MODULE}.lora_B.weight": 0.05 * torch.randn(hidden, rank, generator=generator),
    }
    factors.update(tensors or {})
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"], **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in factors.items()}, str(directory / "adapter_model.safetensors"))
    return directory


def _factor(kind: str, value: float, hidden: int) -> dict:
    shape = (4, hidden) if kind == "A" else (hidden, 4)
    return {f"{LORA_MODULE}.lora_{kind}.weight": torch.full(shape, value)}


def adapter_cases(hidden: int, vocab: int) -> list[tuple[str, dict, float, str]]:
    """(id, write_adapter keyword arguments, --lora weight, expected substring)."""
    nan_in_a = 0.05 * torch.randn(4, hidden)
    nan_in_a[1, 2] = float("nan")
    return [
        ("lora_A-nan", {"tensors": {f"{LORA_MODULE}.lora_A.weight": nan_in_a}}, 1.0, "lora_A.weight' holds NaN or Inf"),
        ("lora_B-inf", {"tensors": _factor("B", float("inf"), hidden)}, 1.0, "lora_B.weight' holds NaN or Inf"),
        ("lora_B-1e30", {"tensors": _factor("B", 1e30, hidden)}, 1.0, "lora_B.weight' holds values as large as 1e+30"),
        ("saved-weight--1e30", {"config": {"modules_to_save": ["lm_head"]},
                                "tensors": {"base_model.model.lm_head.weight": torch.full((vocab, hidden), -1e30)}},
         1.0, "lm_head.weight' holds values as large as 1e+30"),
        ("lora_A-int32", {"tensors": {f"{LORA_MODULE}.lora_A.weight": torch.ones(4, hidden, dtype=torch.int32)}}, 1.0, "must be floating point"),
        ("lora_alpha-1e300", {"config": {"lora_alpha": 1e300}}, 1.0, "scale of 2.5e+299"),
        ("lora_alpha-nan", {"config": {"lora_alpha": float("nan")}}, 1.0, "not a finite number"),
        ("alpha_pattern-inf", {"config": {"alpha_pattern": {"q_proj": float("inf")}}}, 1.0, "not a finite number"),
        ("rank-zero", {"config": {"r": 0}}, 1.0, "at least 1"),
        ("rank_pattern-negative", {"config": {"rank_pattern": {"q_proj": -4}}}, 1.0, "at least 1"),
        ("user-weight--1e30", {}, -1e30, "beyond any usable scale"),
        # Each input in range, the product not: caught on the merged tensor, before quantizing.
        ("merged-overflows", {"tensors": {**_factor("A", 300.0, hidden), **_factor("B", 300.0, hidden)}},
         1000.0, "gives a tensor that holds values as large as"),
    ]
