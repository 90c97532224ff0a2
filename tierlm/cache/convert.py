"""Conversion: base checkpoint (+ LoRA adapters) -> merged, quantized artifact in the cache.

Tensor by tensor: read one base tensor, merge the adapters into it in fp32, fuse it with its
block partners (q/k/v, gate/up), quantize, append to the artifact, let it go. The model is
never held in float as a whole. The artifact is keyed by a content hash of everything that
determines its bytes and built in a temporary directory that is renamed into place when done.

A variant (`ensure_variant_artifact`) is the same conversion restricted to the blocks whose
tensors the adapters change, over the adapter-free base artifact it names: those blocks are byte
for byte the ones a full `--lora` conversion writes, and the base's blocks serve the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from tierlm.atomic import atomic_directory, directory_lock, make_dirs
from tierlm.cache import codec
from tierlm.cache.artifact import BLOCK_ALIGN, FORMAT_VERSION, MANIFEST_NAME, Artifact, ArtifactWriter
from tierlm.cache.catalog import model_name
from tierlm.cache.fingerprint import checkpoint_digest
from tierlm.cache.manifest import artifacts_root
from tierlm.cache.mixed_estimate import aligned_bytes, check_mixed_size
from tierlm.cache.sensitivity import CALIBRATION_TOKENS, Calibrate, choose_modes
from tierlm.config import ModelConfig
from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter
from tierlm.lora.merge import LoraMerger
from tierlm.models import family_description, read_config
from tierlm.progress import Progress, ProgressFactory
from tierlm.quant.mixed import ALLOCATOR_VERSION, OPTIONS
from tierlm.quant.modes import mode_text, source_grid_mode
from tierlm.weights.checkpoint import check_finite, open_checkpoint
from tierlm.weights.import_record import recorded_sources

# Files besides the weights that make an artifact directory a complete model for the runtime.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ConversionRequest:
    """What to build: a base model directory, adapters with weights, and a quant mode name."""

    model_dir: Path
    adapters: tuple[tuple[Path, float], ...] = ()
    quant: str = "int8"


def artifact_key(request: ConversionRequest, merger=None, calibrated: bool = False) -> str:
    """sha256 of the base weights' content, the adapters' content and weights, quant, format;
    for mixed:SIZE also the choice's rules and whether a calibration forward weighed it."""
    parts = {
        "format": FORMAT_VERSION,
        "codec": codec.CODEC_VERSION,
        "base": checkpoint_digest(request.model_dir),
        "adapters": merger.content_fingerprint() if merger is not None else None,
        "quant": codec.parse_mode(request.quant).key,
    }
    if codec.parse_mode(request.quant).target_bytes is not None:  # mixed:SIZE: the choice's rules too
        parts["mixed"] = [ALLOCATOR_VERSION, list(OPTIONS), CALIBRATION_TOKENS if calibrated else None]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def ensure_artifact(request: ConversionRequest, progress: ProgressFactory | None = None,
                    calibrate: Calibrate | None = None) -> Path:  # fmt: skip
    """The artifact directory for `request`, converting first if no finished one exists, with its
    phases reported to `progress`; `calibrate`: mixed:SIZE's calibration forward
    (tierlm/store/calibration.py), else weights alone."""
    mode = codec.parse_mode(request.quant)
    # A bad config.json, or a mixed:SIZE below the model's floor, fails now, not after hashing the weights.
    check_mixed_size(read_config(request.model_dir), mode, model_name(request.model_dir))
    merger = _merger(request.adapters)
    key = artifact_key(request, merger, calibrated=calibrate is not None)
    target = artifacts_root() / f"{Path(request.model_dir).name}-{mode.name}-{key[:16]}"
    make_dirs(target.parent)
    with directory_lock(target):
        if _is_complete(target, key):
            return target
        with atomic_directory(target) as tmp:
            convert(request, tmp, key, merger, progress, calibrate)
    return target


def convert(request: ConversionRequest, out_dir: Path, key: str, merger=None, progress: ProgressFactory | None = None,
            calibrate: Calibrate | None = None) -> None:
    """Write the artifact for `request` into `out_dir` (which the caller renames into place);
    its phases (a mixed:SIZE's calibration and choice, then the blocks) go to `progress`."""
    model_dir = Path(request.model_dir)
    config = read_config(model_dir)
    mode = codec.parse_mode(request.quant)
    layout, tensor_for = _sources(model_dir, config, merger)
    header = _header(key, config, model_dir, mode, request.adapters)
    name, why = model_name(model_dir), f"{mode_text(mode)}, one-time"
    modes = None
    if mode.mixed and mode.target_bytes is not None:
        phases = (progress(f"calibrating {name} on {CALIBRATION_TOKENS} tokens ({why})", "blocks"),
                  progress(f"choosing int4 or int8 per weight of {name} ({why})", "weights")) if progress else (None, None)  # fmt: skip
        choice = choose_modes(config, model_dir, layout, tensor_for, mode, aligned_bytes, BLOCK_ALIGN, calibrate, *phases)
        modes = {key: codec.parse_mode(name) for key, name in choice.modes.items()}
        header["mixed"] = {"target_bytes": mode.target_bytes, "sensitivity": choice.sensitivity,
                           "tensor_modes": dict(choice.modes)}  # fmt: skip
    carried = None
    if mode.name == codec.MIXED_SOURCE:
        # Weights the adapters leave alone are carried from the GGUF as they are; changed ones are
        # re-quantized into the format their sources are carried in (a variant stores the same).
        touched = merger.touched_names() if merger is not None else set()
        carried = _carried_reader(model_dir, config, touched)
        modes = _source_modes_of(model_dir, layout, touched) or None
    writer = ArtifactWriter(out_dir)
    try:
        write_layout(writer, layout, tensor_for, mode, progress(f"converting {name} ({why})", "blocks") if progress else None, modes,
                     carried)  # fmt: skip
        writer.finish(header)
    finally:
        writer.close()
    _copy_model_files(model_dir, out_dir)


def _sources(model_dir: Path, config: ModelConfig, merger):
    """(the family's block layout, tensor_for(block, name, sources) -> merged fp32 tensor); the
    adapters are validated against the checkpoint first."""
    family = family_description(config)
    layout, shapes = family.checkpoint_layout(config), family.canonical_shapes(config)
    checkpoint = open_checkpoint(model_dir)
    if merger is not None:
        merger.validate(checkpoint, tied=config.tie_word_embeddings)

    def merged(name: str) -> torch.Tensor:
        base = checkpoint.get(name)
        return merger.merge(name, base) if merger is not None else base.float()

    def tensor_for(block: str, name: str, sources: tuple[str, ...]) -> torch.Tensor:
        tensor = torch.cat([merged(s) for s in sources]) if len(sources) > 1 else merged(sources[0])
        if tuple(tensor.shape) != shapes[name]:
            raise TierlmError(
                f"weight {block}.{name} has shape {tuple(tensor.shape)}, config.json implies {shapes[name]}",
                "the checkpoint does not match its config.json",
            )
        return tensor

    return layout, tensor_for


def _source_modes_of(model_dir: Path, layout, touched: set[str]) -> dict:
    """"block/name" -> the concrete mode mixed:source carries the sources of each weight a LoRA
    adapter changes in (their GGUF types as the import recorded them; floats: int8-g32-asym)."""
    describe = recorded_sources(model_dir)
    return {f"{block}/{name}": codec.parse_mode(source_grid_mode(*describe(sources)))
            for block, entries in layout.items() for name, sources in entries.items()
            if touched.intersection(sources)}  # fmt: skip


def _carried_reader(model_dir: Path, config: ModelConfig, touched: set[str]):
    """mixed:source on a GGUF import: (block, name, sources) -> the encoding that holds the GGUF's
    blocks exactly, read from them (tierlm/weights/gguf_carry.py), or None where the float path
    carries the weight (int4 for Q4_0/Q4_1, floats, weights read from a `touched` source, any
    checkpoint but a GGUF's)."""
    checkpoint = open_checkpoint(model_dir)
    read = getattr(checkpoint, "read_carried", None)
    if read is None:
        return None
    shapes = family_description(config).canonical_shapes(config)

    def carried(block: str, name: str, sources: tuple[str, ...]):
        if codec.keeps_float(name, shapes[name]) or touched.intersection(sources):
            return None
        weight = read(sources)
        if weight is None:
            return None
        if tuple(weight.shape) != shapes[name]:
            raise TierlmError(
                f"weight {block}.{name} has shape {tuple(weight.shape)}, config.json implies {shapes[name]}",
                "the checkpoint does not match its config.json",
            )
        return codec.encode_carried(weight)

    return carried


def _header(key: str, config: ModelConfig, model_dir: Path, mode, adapters) -> dict:
    return {
        "key": key,
        "model_type": config.model_type,
        "source": str(Path(model_dir).resolve()),
        "quant": mode.name,
        "adapters": [[str(Path(p).resolve()), w] for p, w in adapters],
    }


def _copy_model_files(model_dir: Path, out_dir: Path) -> None:
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)


def _link_model_files(base_dir: Path, out_dir: Path) -> None:
    """The base artifact's model files, hard-linked where the disk allows (a variant then adds no
    bytes for its tokenizer), else copied."""
    for name in MODEL_FILES:
        if (base_dir / name).is_file():
            try:
                os.link(base_dir / name, out_dir / name)
            except OSError:
                shutil.copyfile(base_dir / name, out_dir / name)


# ----------------------------------------------------------------------------- variants


def ensure_variant_artifact(
    base: ConversionRequest, adapters: tuple[tuple[Path, float], ...], progress: Progress | None = None,
    calibrate: Calibrate | None = None,
) -> Path:
    """The variant artifact of `base` (no adapters) with `adapters`, building its base first.

    The adapters are checked against the checkpoint before anything is written to the cache, so
    an adapter for another model leaves the cache as it was. `progress(done, total)` counts the
    base's blocks (when it is built) and then the variant's.
    """
    if base.adapters:
        raise ValueError("a variant's base request carries no adapters; pass them as `adapters`")
    config = read_config(base.model_dir)
    merger = _merger(adapters)
    if merger is None:
        raise TierlmError("a variant needs at least one LoRA adapter")
    layout, tensor_for = _sources(Path(base.model_dir), config, merger)  # validates the adapters
    base_dir = ensure_artifact(base, (lambda label, unit="": progress) if progress else None, calibrate)
    base_key = Artifact.open(base_dir).manifest["key"]
    key = variant_key(base_key, merger)
    mode = codec.parse_mode(base.quant)
    target = artifacts_root() / f"{Path(base.model_dir).name}-{mode.name}-{key[:16]}"
    with directory_lock(target):
        if _is_complete(target, key):
            return target
        with atomic_directory(target) as tmp:
            header = _header(key, config, Path(base.model_dir), mode, adapters)
            header.update(base=base_dir.name, base_key=base_key)
            write_variant(tmp, base_dir, layout, tensor_for, merger.touched_names(), mode, header, progress)
            _link_model_files(base_dir, tmp)
    return target


def variant_key(base_key: str, merger) -> str:
    """sha256 of the base artifact's key (weights, quant, codec, format) and the adapters' content."""
    parts = {"variant": 1, "base_key": base_key, "adapters": merger.content_fingerprint()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def changed_layout(layout, touched: set[str]) -> dict[str, dict[str, tuple[str, ...]]]:
    """The part of `layout` a variant stores: per block, the entries read from a `touched` source.

    A tied head's alias stays an alias: its sources are the embedding's, which is stored earlier."""
    changed = {}
    for block, entries in layout.items():
        kept = {name: sources for name, sources in entries.items() if touched.intersection(sources)}
        if kept:
            changed[block] = kept
    return changed


def write_variant(out_dir: Path, base_dir: Path, layout, tensor_for, touched: set[str], mode, header: dict,
                  progress: Progress | None = None) -> None:
    """Write the tensors of `layout` that `touched` sources change into `out_dir`, block by block,
    each encoded exactly as convert encodes it, and a manifest naming the base's other blocks
    with the digests the base records."""
    base = Artifact.open(base_dir)
    base.close()
    changed = changed_layout(layout, touched)
    # A mixed base (mixed:SIZE, mixed:source) stored each weight in a mode of its own: the
    # variant's changed weights keep them, so each fits its place in the base's block.
    modes = {}
    if mode.mixed:
        modes = {f"{block}/{name}": codec.parse_mode(codec.record_mode(record))
                 for block in changed for name, record in base.blocks[block].tensors.items()
                 if record.encoding != "plain"}  # fmt: skip
    writer = ArtifactWriter(out_dir)
    try:
        write_layout(writer, changed, tensor_for, mode, progress, modes)
        shared = {name: base.blocks[name].digest for name in base.blocks if name not in changed}
        writer.finish({**header, "shared": shared})
    finally:
        writer.close()


def write_layout(writer: ArtifactWriter, layout, tensor_for, mode, progress: Progress | None = None,
                 modes=None, carried=None) -> None:  # fmt: skip
    """Append every block of `layout` to `writer`, one encoded tensor per distinct source tuple.
    `modes` ("block/tensor" -> QuantMode) overrides `mode` per tensor (a mixed:SIZE choice);
    `carried(block, name, sources)`: a weight's encoding read from its GGUF blocks, or None.

    `tensor_for(block, name, sources)` makes the fp32 tensor; entries whose sources were already
    written (a tied head) become aliases. Each tensor is released once encoded, so at most one
    fp32 tensor is alive at a time. Every tensor and its encoding must be finite (TierlmError
    naming it otherwise), so an artifact never stores NaN/Inf for the model to compute with.
    """
    written: dict[tuple[str, ...], tuple[str, str]] = {}
    report = progress or (lambda done, total: None)
    report(0, len(layout))
    for done, (block, entries) in enumerate(layout.items()):
        writer.begin_block(block)
        for name, sources in entries.items():
            if sources in written:
                writer.add_alias(name, *written[sources])
                continue
            chosen = modes.get(f"{block}/{name}", mode) if modes else mode
            encoded = carried(block, name, sources) if carried is not None else None
            if encoded is not None:
                _check_parts(block, name, encoded[1], chosen)
            writer.add_tensor(name, *(encoded or _encode_finite(block, name, tensor_for(block, name, sources), chosen)))
            written[sources] = (block, name)
            report(done, len(layout))  # still running: a large block's tensors take a while each
        writer.end_block()
        report(done + 1, len(layout))


def _encode_finite(block: str, name: str, tensor, mode):
    """codec.encode, refusing NaN/Inf before it (quantizing them is garbage) and after it (a
    finite fp32 value can overflow fp16)."""
    what = f"{block}.{name}"
    check_finite(tensor, f"weight {what}", "the source weights are damaged; nothing was cached")
    encoding, parts, meta = codec.encode(tensor, mode, name)
    _check_parts(block, name, parts, mode)
    return encoding, parts, meta


def _check_parts(block: str, name: str, parts, mode) -> None:
    for part, data in parts.items():
        check_finite(data, f"weight {block}.{name} stored as {mode.name} ({part})",
                     f"its values overflow {mode.name}; use a wider quant mode (int8, bf16 or fp32)")


def _merger(adapters: Sequence[tuple[Path, float]]):
    if not adapters:
        return None
    return LoraMerger([(LoraAdapter.load(Path(path)), weight) for path, weight in adapters])


def _is_complete(target: Path, key: str) -> bool:
    if not (target / MANIFEST_NAME).is_file():
        return False
    try:
        return Artifact.open(target).manifest.get("key") == key
    except (OSError, TierlmError):  # a damaged or outdated entry is simply rebuilt
        return False
