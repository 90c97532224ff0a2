"""What a model costs in memory: weight bytes per block, and the charges that are not weights.

Block bytes come from a compiled artifact's manifest (`sizes_from_artifact`), or are predicted
from config.json alone (`sizes_from_config`), so `tierlm plan` works for a 14B model that is not
on disk. The prediction encodes every tensor as `cache/codec.py` stores it and lays the parts
out as `cache/artifact.py` does (each part at a 64-byte boundary of its block), so it equals the
manifest's block sizes.

Non-weight charges (bytes; c = compute dtype bytes: 4 on CPUs (fp32), 2 on accelerators):

    KV cache     layers x 2 x kv_heads x head_dim x context x batch x kv bytes
                 (context = min(profile.context_length, max_position_embeddings);
                 kv bytes: the profile's kv_dtype, "auto" = c)
    workspace    one prefill step of t = batch x min(512, context) tokens, the largest the
                 engine runs (PREFILL_CHUNK, which the runtime imports from here), plus one decode's logits:
                   activations   t x (2H + qkv + q + 3I) x c   residual, normed input, fused
                                 q/k/v, attention output, gate|up (2I) and their product (I)
                   kernel        CPU: t x max_out x 4 + 1 MiB (the BLAS int8 kernel's
                                 transposed output and its dequantized block);
                                 accelerator, int8: the largest 2-D weight (head included)
                                 dequantized to c (torch-dequant kernel)
                   attention     batch x heads x chunk x context x c (scores, math path)
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

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from tierlm.blocks import EMBED, HEAD
from tierlm.cache import codec
from tierlm.cache.artifact import MANIFEST_NAME, PART_ALIGN, Artifact
from tierlm.config import ModelConfig
from tierlm.quant.modes import AUTO, QuantMode, auto_quant, check_mode_name, concrete_mode, parse_quant_mode

PREFILL_CHUNK = 512  # tokens per prefill step; the engine and the batch runner import it from here
HOT_CACHE_ROWS = 4096  # embedding rows the hot cache may hold (Zipfian tokens: most lookups)
KERNEL_BLOCK_BYTES = 1 << 20  # the CPU BLAS kernel's dequantization block (quant/torch_kernels.py)
_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_KV_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


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
    from tierlm.weights.gguf_import import source_tensor_types

    if (Path(model_dir) / MANIFEST_NAME).is_file():
        return str(Artifact.open(Path(model_dir)).manifest["quant"])
    return auto_quant(source_tensor_types(model_dir), accelerator=accelerator)


def sizes_from_artifact(directory: Path) -> BlockSizes:
    """Block sizes read from a compiled artifact's manifest (no weights are read)."""
    artifact = Artifact.open(Path(directory))
    nbytes, params, aliases = {}, {}, {}
    for name, block in artifact.blocks.items():
        nbytes[name] = block.nbytes
        params[name] = sum(_matmul_elements(t.parts) for t in block.tensors.values())
        if block.borrowed_from is not None:
            aliases[name] = block.borrowed_from
    for name, target in aliases.items():
        params[name] = params[target]
    embed = artifact.blocks[EMBED].tensors["embed"]
    row_bytes = sum(part.nbytes // part.shape[0] for part in embed.parts.values())
    quant = str(artifact.manifest.get("quant", "unknown"))
    return BlockSizes(quant, nbytes, params, aliases, row_bytes, str(artifact.directory))


def cached_artifact(model_dir: Path, quant: str) -> Path | None:
    """The newest complete artifact in the cache built from `model_dir` in `quant` without
    adapters (its manifest's sizes are exact), or `model_dir` itself if it is an artifact."""
    from tierlm.cache.artifact import MANIFEST_NAME
    from tierlm.cache.convert import artifacts_root

    model_dir = Path(model_dir)
    if (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    found = []
    for candidate in artifacts_root().glob(f"{model_dir.name}-{quant}-*"):
        try:
            manifest = Artifact.open(candidate).manifest
        except Exception:  # noqa: BLE001 - unfinished or damaged entries are skipped
            continue
        same_source = manifest.get("source") == str(model_dir.resolve())
        if same_source and manifest.get("quant") == quant and not manifest.get("adapters"):
            found.append((candidate.stat().st_mtime, candidate))
    return max(found)[1] if found else None


def sizes_from_config(
    config: ModelConfig, quant: str | QuantMode, *, accelerator: bool = False
) -> BlockSizes:
    """Predict the artifact's block sizes from config.json alone.

    The blocks and their tensors, in stored order and canonical shapes, are the family's own
    (`block_shapes` of the class `tierlm.models.family_class` gives, the layout conversion
    writes); a tied head stores none of its own and is an alias of the embedding.
    tests/test_planner.py and tests/test_families.py check it against converted artifacts.
    """
    from tierlm.models import family_class  # the family is looked up, never named here

    mode = resolve_quant(quant, accelerator)
    vocab, hidden = config.vocab_size, config.hidden_size
    blocks = family_class(config).block_shapes(config)
    if config.tie_word_embeddings:
        blocks[HEAD] = {}
    nbytes = {name: _block_bytes([p for tensor, shape in tensors.items() for p in _stored_parts(shape, mode, tensor)])
              for name, tensors in blocks.items()}  # fmt: skip
    params = {name: sum(s[0] * s[1] for s in tensors.values() if len(s) == 2) for name, tensors in blocks.items()}
    aliases = {HEAD: EMBED} if config.tie_word_embeddings else {}
    if aliases:
        params[HEAD] = params[EMBED]
    row_bytes = sum(part // vocab for part in _stored_parts((vocab, hidden), mode))
    return BlockSizes(mode.name, nbytes, params, aliases, row_bytes, "config")


def _stored_parts(shape: tuple[int, ...], mode: QuantMode, name: str | None = None) -> list[int]:
    """Bytes of each part `cache/codec.encode` writes for a tensor of `shape` (canonical `name`)."""
    elements = 1
    for dim in shape:
        elements *= dim
    if codec.keeps_float(name, shape):
        return [elements * 4]  # norms, biases and routers stay fp32
    if not mode.quantized:
        return [elements * _FLOAT_BYTES[mode.weight_dtype]]
    out_features, in_features = shape
    groups = 1 if mode.group_size is None else -(-in_features // mode.group_size)
    scales = [out_features * groups * 4] * (2 if mode.asymmetric else 1)  # fp32 scales, offsets
    return [elements, *scales]  # int8 qweight first


def _block_bytes(parts: list[int]) -> int:
    """A block's byte range: parts in order, each starting on a PART_ALIGN boundary."""
    end = 0
    for nbytes in parts:
        end = -(-end // PART_ALIGN) * PART_ALIGN + nbytes
    return end


def _matmul_elements(parts) -> int:
    main = parts.get("qweight") or parts.get("data")
    if main is None or len(main.shape) != 2:
        return 0
    return main.shape[0] * main.shape[1]


# -- charges that are not weights -----------------------------------------------------------


def compute_bytes(accelerator: bool) -> int:
    """Bytes per activation element: fp32 on CPUs, bf16/fp16 on accelerators (device.compute_dtype)."""
    return 2 if accelerator else 4


def context_tokens(config: ModelConfig, profile) -> int:  # profile: tierlm.profile.Profile
    """Positions reserved per sequence: the profile's context, capped by the model's maximum."""
    return min(profile.context_length, config.max_position_embeddings)


def kv_cache_bytes(config: ModelConfig, profile, accelerator: bool, layers: int | None = None) -> int:
    """Keys and values for the profile's whole context and batch, in its kv_dtype, of `layers`
    decoder layers (a pipeline stage's; None: all of them)."""
    per_element = compute_bytes(accelerator) if profile.kv_dtype == "auto" else _KV_BYTES[profile.kv_dtype]
    layers = config.num_hidden_layers if layers is None else layers
    return (layers * 2 * config.num_key_value_heads * config.head_dim
            * context_tokens(config, profile) * profile.batch_size * per_element)  # fmt: skip


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
    elif sizes.quant.startswith("int8"):
        kernel = max(sizes.params.values()) * c
    else:
        kernel = 0
    heads, groups = config.num_attention_heads, config.num_attention_heads // config.num_key_value_heads
    attention = profile.batch_size * heads * chunk * context * c + groups * chunk * context * (1 + c)
    logits = profile.batch_size * config.vocab_size * (c + 12) if logits else 0
    rope = 2 * context * config.head_dim * c
    return activations + kernel + attention + logits + rope


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
    from tierlm.offload.routing_counts import COUNTS_NAME, RoutingCounts

    moe = getattr(config, "moe", None)
    if moe is None:
        return None
    layers = tuple(moe.sparse_layers)
    if sizes.source == "config":
        return RoutingCounts(layers, moe.experts)
    return RoutingCounts.load(Path(sizes.source) / COUNTS_NAME, layers, moe.experts)
