"""What a model costs in memory: weight bytes per block, and the charges that are not weights.

Block bytes come from a compiled artifact's manifest (`sizes_from_artifact`), or are predicted
from config.json alone (`sizes_from_config`), so `tierlm plan` works for a 14B model that is not
on disk. The prediction sizes every tensor's parts as `cache/encodings.py` says `cache/codec.py`
stores them and lays them out as `cache/artifact.py` does (each part at a 64-byte boundary of
its block), so it equals the manifest's block sizes; a mixed:SIZE mode's per-weight choice is
the estimate of `cache/mixed_estimate.py`.

Non-weight charges (bytes; c = compute dtype bytes: 4 on CPUs (fp32), 2 on accelerators):

    KV cache     layers x 2 x kv_heads x context x batch x row bytes
                 (context = min(profile.context_length, max_position_embeddings);
                 row bytes: one head's position in the profile's kv_cache format, codes and
                 scales (kv/formats.py); "auto" = head_dim x c)
    workspace    one prefill step of t = batch x min(512, context) tokens, the largest the
                 engine runs (PREFILL_CHUNK, which the runtime imports from here), plus one decode's logits:
                   activations   t x (2H + qkv + q + 3I) x c   residual, normed input, fused
                                 q/k/v, attention output, gate|up (2I) and their product (I)
                   kernel        CPU: t x max_out x 4 + 1 MiB (the BLAS int8 kernel's
                                 transposed output and its dequantized block);
                                 accelerator, int8: the largest 2-D weight (head included)
                                 dequantized to c (torch-dequant kernel)
                   attention     batch x heads x chunk x context x c (scores, math path)
                                 + 2 x batch x kv_heads x context x head_dim x c when the KV
                                 cache is held in another format (one layer's keys and values
                                 read back in the compute dtype)
                                 + groups x chunk x context x (1 + c) (causal mask, bool and
                                 additive)
                   logits        batch x vocab x (c + 12)  (logits, fp32 copy, sampler's
                                 probabilities and sorted copy)
                   rope          2 x context x head_dim x c (cos/sin tables)
    host workspace  (accelerator, blocks computed on the CPU) t x (widest + max_out) x 4
                 + 1 MiB: the fp32 activations crossing over and the CPU kernel's scratch
    hot cache    min(min(vocab, 4096) x H x c, the embedding's stored bytes): decoded
                 embedding rows kept on the device when the embedding is not resident
                 (tiered_store's EmbeddingRows sizes its table from this)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Mapping

from tierlm.blocks import EMBED, HEAD
from tierlm.cache.encodings import keeps_float, logical_shape, part_bytes, record_mode
from tierlm.cache.manifest import (
    BLOCK_ALIGN,
    MANIFEST_NAME,
    PART_ALIGN,
    WEIGHTS_NAME,
    BlockRecord,
    Malformed,
    artifacts_root,
    base_directory,
    parse_manifest,
    read_manifest,
    unusable,
)
from tierlm.cache.mixed_estimate import estimated_modes
from tierlm.config import ModelConfig
from tierlm.errors import TierlmError
from tierlm.kv.formats import kv_format, model_format
from tierlm.models import family_description  # torch-free; the family is looked up, never named here
from tierlm.models.attention_blocks import query_block
from tierlm.offload.routing_counts import COUNTS_NAME, RoutingCounts
from tierlm.quant.modes import (
    AUTO,
    QuantMode,
    auto_quant,
    check_mode_name,
    concrete_mode,
    parse_quant_mode,
    source_grid_mode,
)
from tierlm.weights.import_record import recorded_sources, source_tensor_types

PREFILL_CHUNK = 512  # tokens per prefill step; the engine and the batch runner import it from here
HOT_CACHE_ROWS = 4096  # embedding rows the hot cache may hold (Zipfian tokens: most lookups)
KERNEL_BLOCK_BYTES = 1 << 20  # the CPU BLAS kernel's dequantization block (quant/torch_kernels.py)
MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class BlockSizes:
    """Stored bytes per weight block, in execution order (embed, layers.0..N-1, norm, head).

    `params`: elements of each block's 2-D (matmul) weights, for FLOP estimates.
    `aliases`: block -> the block whose bytes it uses (a tied head -> "embed"); an aliased
    block stores ~0 bytes of its own. `row_bytes`: one embedding row as stored (int8 + scale).
    """

    quant: str
    nbytes: Mapping[str, int]
    params: Mapping[str, int]
    aliases: Mapping[str, str] = field(default_factory=dict)
    row_bytes: int = 0
    source: str = "config"
    # "block/tensor" -> the concrete mode of each 2-D weight, where a mixed mode chose per weight
    tensor_modes: Mapping[str, str] = field(default_factory=dict)
    # "block/tensor" -> its stored bytes, for the same weights as `tensor_modes`
    tensor_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.nbytes)

    def source_block(self, block: str) -> str:
        return self.aliases.get(block, block)

    def bytes_used(self, block: str) -> int:
        """Bytes that must be present to compute `block` (a tied head needs the embedding's)."""
        return self.nbytes[self.source_block(block)]

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())

    def format_bytes(self, block: str) -> tuple[tuple[str, float], ...]:
        """(mode, stored bytes) of `block`'s own matrices per concrete mode, where the artifact chose
        per weight (`tensor_modes`; empty otherwise). A row stack's bytes are shared among its
        runs by their rows."""
        return self._format_bytes.get(block, ())

    @cached_property
    def _format_bytes(self) -> dict[str, tuple[tuple[str, float], ...]]:
        from tierlm.quant.modes import parse_quant_mode

        totals: dict[str, dict[str, float]] = {}
        for key, mode in self.tensor_modes.items():
            nbytes = float(self.tensor_bytes.get(key, 0))
            runs = [(run.name, count) for run, count in parse_quant_mode(mode).rows] if "*" in mode else [(mode, 1)]
            rows = sum(count for _, count in runs)
            block = totals.setdefault(key.split("/", 1)[0], {})
            for name, count in runs:
                block[name] = block.get(name, 0.0) + nbytes * count / rows
        return {block: tuple(modes.items()) for block, modes in totals.items()}

    def only(self, names) -> "BlockSizes":
        """These sizes restricted to the blocks `names` (a pipeline stage's: StageSpan.blocks),
        in this object's order. A kept alias needs its source kept too (a tied head on the last
        stage reads the embedding, which that stage then holds)."""
        wanted = set(names)
        unknown = wanted - set(self.nbytes)
        if unknown:
            raise ValueError(f"blocks {sorted(unknown)} are not among these sizes' {len(self.nbytes)} blocks")
        aliases = {name: source for name, source in self.aliases.items() if name in wanted}
        missing = {source for source in aliases.values() if source not in wanted}
        if missing:
            raise ValueError(f"{sorted(aliases)} read {sorted(missing)}, which is not kept: keep both")
        kept = [name for name in self.nbytes if name in wanted]
        return replace(self, nbytes={n: self.nbytes[n] for n in kept}, params={n: self.params[n] for n in kept},
                       aliases=aliases)  # fmt: skip


def resolve_quant(
    quant: str | QuantMode, accelerator: bool = False, model_dir: Path | None = None
) -> QuantMode:
    """A QuantMode; "none" is the weights as stored, in the mode `concrete_mode` gives them;
    "auto" is the mode `resolve_auto` picks for the model in `model_dir`."""
    if isinstance(quant, QuantMode):
        return quant
    name = resolve_auto(quant, model_dir, accelerator)
    return parse_quant_mode(concrete_mode(name, accelerator=accelerator, converted=False))


def resolve_auto(quant: str, model_dir: Path | None, accelerator: bool = False) -> str:
    """`quant` checked and lower-cased, with "auto" replaced by a concrete mode: a compiled
    artifact's own, else `auto_quant` for the tensor types a GGUF import recorded (none: float).

    Resolved before anything is keyed on the mode (artifact names and hashes, cached sizes).
    """
    name = check_mode_name(quant)
    if name != AUTO:
        return name
    if model_dir is None:  # nothing known about the source: treated as floats
        return auto_quant(accelerator=accelerator)
    if (Path(model_dir) / MANIFEST_NAME).is_file():
        return str(read_manifest(Path(model_dir))["quant"])
    return auto_quant(source_tensor_types(model_dir), accelerator=accelerator)


def sizes_from_artifact(directory: Path) -> BlockSizes:
    """Block sizes read from a compiled artifact's manifest (no weights are read; loading it,
    `Artifact.open` checks them)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    blocks = _stored_blocks(directory, manifest)
    nbytes, params, aliases = {}, {}, {}
    for name, block in blocks.items():
        nbytes[name] = block.nbytes
        params[name] = sum(_matmul_elements(t) for t in block.tensors.values())
        if block.borrowed_from is not None:
            aliases[name] = block.borrowed_from
    for name, target in aliases.items():
        params[name] = params[target]
    embed = blocks[EMBED].tensors["embed"]
    row_bytes = sum(part.nbytes // part.shape[0] for part in embed.parts.values())
    quant = str(manifest.get("quant", "unknown"))
    modes, stored = {}, {}
    if quant.startswith("mixed"):
        quantized = {f"{name}/{tensor}": record for name, block in blocks.items()
                     for tensor, record in block.tensors.items() if record.encoding != "plain"}  # fmt: skip
        modes = {key: record_mode(record) for key, record in quantized.items()}
        stored = {key: sum(part.nbytes for part in record.parts.values()) for key, record in quantized.items()}
    return BlockSizes(quant, nbytes, params, aliases, row_bytes, str(directory), modes, stored)


def _stored_blocks(directory: Path, manifest: Mapping) -> dict[str, BlockRecord]:
    """The block records of the artifact in `directory` with `manifest`, checked by
    cache/manifest.py; a variant artifact's are its base's (it stores only its changed tensors,
    each where the base's lies: cache/artifact.py VariantArtifact)."""
    if "base" in manifest:
        directory = base_directory(directory, manifest)
        manifest = read_manifest(directory)
    try:
        return parse_manifest(manifest)
    except Malformed as err:
        raise unusable(directory, f"manifest: {err}") from None


def cached_artifact(model_dir: Path, quant: str) -> Path | None:
    """The newest complete artifact in the cache built from `model_dir` in `quant` without
    adapters (its manifest's sizes are exact), or `model_dir` itself if it is an artifact."""
    model_dir = Path(model_dir)
    if (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    found = []
    for candidate in artifacts_root().glob(f"{model_dir.name}-{quant}-*"):
        try:
            manifest = read_manifest(candidate)
            parse_manifest(manifest, variant="base" in manifest)
        except Exception:  # noqa: BLE001 - unfinished or damaged entries are skipped
            continue
        weights = candidate / WEIGHTS_NAME
        if not weights.is_file() or weights.stat().st_size != manifest["weights_bytes"]:
            continue  # unfinished
        same_source = manifest.get("source") == str(model_dir.resolve())
        if same_source and manifest.get("quant") == quant and not manifest.get("adapters"):
            found.append((candidate.stat().st_mtime, candidate))
    return max(found)[1] if found else None


def sizes_from_config(
    config: ModelConfig, quant: str | QuantMode, *, accelerator: bool = False, model_dir: Path | None = None
) -> BlockSizes:
    """Predict the artifact's block sizes from config.json alone.

    A mixed mode's per-tensor choice is predicted too (`predicted_modes`): for mixed:source from
    the GGUF tensor types an import in `model_dir` recorded, for mixed:SIZE from error estimates
    (the conversion measures them, so its artifact may place int4 and int8 elsewhere, within the
    same size).

    The blocks and their tensors, in stored order and canonical shapes, are the family's own
    (`block_shapes` of its torch-free description, `tierlm.models.family_description`, the layout
    conversion writes); a tied head stores none of its own and is an alias of the embedding.
    tests/test_planner.py and tests/test_families.py check it against converted artifacts.
    """
    mode = resolve_quant(quant, accelerator)
    vocab, hidden = config.vocab_size, config.hidden_size
    blocks = family_description(config).block_shapes(config)
    if config.tie_word_embeddings:
        blocks[HEAD] = {}
    modes = predicted_modes(config, blocks, mode, model_dir)
    nbytes = {name: _block_bytes([p for tensor, shape in tensors.items()
                                  for p in part_bytes(shape, modes.get(f"{name}/{tensor}", mode), tensor)])
              for name, tensors in blocks.items()}  # fmt: skip
    params = {name: sum(s[0] * s[1] for s in tensors.values() if len(s) == 2) for name, tensors in blocks.items()}
    aliases = {HEAD: EMBED} if config.tie_word_embeddings else {}
    if aliases:
        params[HEAD] = params[EMBED]
    row_bytes = sum(part // vocab for part in part_bytes((vocab, hidden), modes.get(f"{EMBED}/embed", mode)))
    chosen = {key: m.name for key, m in modes.items()}
    stored = {}
    for key, m in modes.items():
        block, tensor = key.split("/", 1)
        stored[key] = sum(part_bytes(blocks[block][tensor], m, tensor))
    return BlockSizes(mode.name, nbytes, params, aliases, row_bytes, "config", chosen, stored)


def predicted_modes(config: ModelConfig, blocks, mode: QuantMode, model_dir: Path | None = None) -> dict[str, QuantMode]:
    """"block/tensor" -> the concrete mode a mixed `mode` is predicted to give each 2-D weight of
    `blocks` (block -> {tensor: shape}); {} for any other mode."""
    if not mode.mixed:
        return {}
    if mode.target_bytes is None:  # mixed:source
        keys = [f"{b}/{t}" for b, tensors in blocks.items() for t, shape in tensors.items()
                if not keeps_float(t, shape)]  # fmt: skip
        return {key: parse_quant_mode(name) for key, name in _source_modes(config, model_dir, keys).items()}
    chosen = estimated_modes(blocks, mode, lambda shape, m, name: _block_bytes(part_bytes(shape, m, name)), BLOCK_ALIGN)
    return {key: parse_quant_mode(name) for key, name in chosen.items()}


def _source_modes(config: ModelConfig, model_dir: Path | None, keys: list[str]) -> dict[str, str]:
    """mixed:source's prediction from an import's recorded tensor types (every weight on the
    int8 grid where none were recorded)."""
    describe = recorded_sources(model_dir)
    layout = family_description(config).checkpoint_layout(config)
    out = {}
    for key in keys:
        block, tensor = key.split("/", 1)
        out[key] = source_grid_mode(*describe(layout.get(block, {}).get(tensor, ())))
    return out


def _block_bytes(parts: list[int]) -> int:
    """A block's byte range: parts in order, each starting on a PART_ALIGN boundary."""
    end = 0
    for nbytes in parts:
        end = -(-end // PART_ALIGN) * PART_ALIGN + nbytes
    return end


def _matmul_elements(record) -> int:
    shape = logical_shape(record)
    return shape[0] * shape[1] if len(shape) == 2 else 0


# -- mixed:SIZE bounds ----------------------------------------------------------------------


def largest_mixed_size(config: ModelConfig, works, accelerator: bool) -> int | None:
    """The largest mixed:SIZE in whole MiB, between every weight at int4-g128 and twice int8,
    for which works(size) holds (it must hold for every smaller size); None where none does."""
    smallest = sizes_from_config(config, "int4-g128", accelerator=accelerator)
    low = (smallest.total + BLOCK_ALIGN * len(smallest.names)) // MiB + 1
    high = 2 * sizes_from_config(config, "int8", accelerator=accelerator).total // MiB

    def holds(size_mib: int) -> bool:
        try:
            return works(size_mib * MiB)
        except TierlmError:  # a size the allocation cannot reach
            return False

    if not holds(low):
        return None
    while high - low > 1:  # holds(low)
        mid = (low + high) // 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low * MiB


def mixed_size_text(nbytes: int) -> str:
    """A mixed:SIZE as a person writes it, rounded down so it stays within `nbytes`: 4.10GiB."""
    return f"{math.floor(nbytes / GiB * 100) / 100:.2f}GiB" if nbytes >= GiB else f"{nbytes // MiB}MiB"


# -- charges that are not weights -----------------------------------------------------------


def compute_bytes(accelerator: bool) -> int:
    """Bytes per activation element: fp32 on CPUs, bf16/fp16 on accelerators (device.compute_dtype)."""
    return 2 if accelerator else 4


def context_tokens(config: ModelConfig, profile) -> int:  # profile: tierlm.profile.Profile
    """Positions reserved per sequence: the profile's context, capped by the model's maximum; a
    `--context` past that maximum is refused."""
    check_context_asked(config, profile)
    return min(profile.context_length, config.max_position_embeddings)


def check_context_asked(config: ModelConfig, profile) -> None:
    asked = getattr(profile, "context_asked", None)
    if asked is not None and asked > config.max_position_embeddings:
        raise TierlmError(f"--context {asked} is more than this model holds ({config.max_position_embeddings:,} "
                          "positions, its max_position_embeddings)",
                          f"use --context {config.max_position_embeddings} or less")  # fmt: skip


def kv_token_bytes(config: ModelConfig, kv_cache: str, accelerator: bool, layers: int | None = None) -> int:
    """Bytes one token of one sequence holds in a KV cache of format `kv_cache` ("auto": the
    compute dtype), over `layers` decoder layers (a pipeline stage's; None: all of them)."""
    layers = config.num_hidden_layers if layers is None else layers
    held = model_format(kv_cache, accelerator, config.head_dim)  # refused at plan time as the load refuses it
    return layers * 2 * config.num_key_value_heads * held.row_bytes(config.head_dim)


def kv_cache_bytes(config: ModelConfig, profile, accelerator: bool, layers: int | None = None) -> int:
    """Keys and values for the profile's whole context and batch, in its kv_cache format, of
    `layers` decoder layers (a pipeline stage's; None: all of them)."""
    per_token = kv_token_bytes(config, profile.kv_cache, accelerator, layers)
    return per_token * context_tokens(config, profile) * profile.batch_size


def kv_read_back_bytes(config: ModelConfig, profile, accelerator: bool) -> int:
    """One layer's keys and values read back in the compute dtype (eager attention over a cache held
    in another format); 0 when the cache holds the compute dtype (views are read)."""
    held = kv_format(profile.kv_cache, accelerator)
    if held.name == kv_format("auto", accelerator).name:
        return 0
    c = compute_bytes(accelerator)
    return 2 * profile.batch_size * config.num_key_value_heads * context_tokens(config, profile) * config.head_dim * c


def _widest(config: ModelConfig) -> tuple[int, int]:
    """(activation elements per token, largest matmul output) of one decoder layer.

    A mixture-of-experts layer (widest of it and a dense MLP, which its config may also have):
    router logits, the top-k weights and indices, the combined output, one expert's gathered
    rows with its gate|up and product (experts run one at a time), and a shared expert's MLP.
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv = config.q_size + 2 * config.kv_size
    mlp, max_out = 3 * inter, max(2 * inter, qkv, hidden)
    moe = getattr(config, "moe", None)
    if moe is not None:
        shared = moe.shared_intermediate or 0
        routed = moe.experts + 2 * moe.top_k + 3 * hidden + 3 * moe.expert_intermediate + 3 * shared
        mlp = max(mlp, routed)
        max_out = max(max_out, 2 * moe.expert_intermediate, 2 * shared, moe.experts)
    return 2 * hidden + qkv + config.q_size + mlp, max_out


def workspace_bytes(config: ModelConfig, sizes: BlockSizes, profile, accelerator: bool, logits: bool = True) -> int:
    """Activations and scratch of the largest step on the compute device (formula in the module doc).
    `logits`: whether this process holds a step's logits (a pipeline's middle stages do not)."""
    c = compute_bytes(accelerator)
    context = context_tokens(config, profile)
    chunk = min(PREFILL_CHUNK, context)
    tokens = profile.batch_size * chunk
    widest, max_out = _widest(config)
    activations = tokens * widest * c
    if not accelerator:
        kernel = tokens * max_out * 4 + KERNEL_BLOCK_BYTES
    elif _quantized(sizes.quant):
        kernel = max(sizes.params.values()) * c
    else:
        kernel = 0
    heads, groups = config.num_attention_heads, config.num_attention_heads // config.num_key_value_heads
    block = query_block(profile.batch_size, heads, chunk, context)
    attention = (profile.batch_size * heads * block * context * c + groups * block * context * (1 + c)
                 + (groups * chunk * context if block < chunk else 0)  # the chunk's whole mask, sliced per block
                 + kv_read_back_bytes(config, profile, accelerator))  # fmt: skip
    logits = profile.batch_size * config.vocab_size * (c + 12) if logits else 0
    rope = 2 * context * config.head_dim * c
    return activations + kernel + attention + logits + rope


def _quantized(mode_name: str) -> bool:
    """Whether weights stored as `mode_name` are dequantized by the kernels (a manifest without
    a mode name: not)."""
    try:
        return parse_quant_mode(mode_name).quantized
    except TierlmError:
        return False


def host_workspace_bytes(config: ModelConfig, profile) -> int:
    """fp32 activations and kernel scratch for blocks computed on the CPU beside an accelerator."""
    tokens = profile.batch_size * min(PREFILL_CHUNK, context_tokens(config, profile))
    widest, max_out = _widest(config)
    return tokens * (widest + max_out) * 4 + KERNEL_BLOCK_BYTES


def hot_cache_bytes(config: ModelConfig, sizes: BlockSizes, accelerator: bool) -> int:
    """Decoded embedding rows kept on the device for a non-resident embedding: 4096 rows in the
    compute dtype, never more than the embedding's own stored bytes."""
    rows = min(config.vocab_size, HOT_CACHE_ROWS) * config.hidden_size * compute_bytes(accelerator)
    return min(rows, sizes.nbytes[EMBED])


def expected_routing(config: ModelConfig, sizes: BlockSizes):
    """The routing counts saved beside the artifact `sizes` were read from (offload/
    routing_counts.py), which the planner places experts by; None for a dense model. Sizes
    predicted from config.json have no artifact: empty counts, i.e. uniform expectations."""
    moe = getattr(config, "moe", None)
    if moe is None:
        return None
    layers = tuple(moe.sparse_layers)
    if sizes.source == "config":
        return RoutingCounts(layers, moe.experts)
    return RoutingCounts.load(Path(sizes.source) / COUNTS_NAME, layers, moe.experts)
