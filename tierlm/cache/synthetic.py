"""Synthetic artifacts: random weights in a real model's shape, written straight to the cache.

Benchmarks and memory-profile tests need models bigger than the machine's budget (a 7B-shaped
INT8 model is ~7 GB, Qwen3-30B-A3B ~31 GB) without a checkpoint to convert; this writes the
artifact block by block from seeded generators, with a tiny byte-level tokenizer so every
command can run on it.

Dense families: every tensor from one seeded normal generator (std 0.02; norms 1 + 0.1 noise).

Mixture-of-experts families (config.moe set) are built so that routing can be studied:
- Each tensor has its own generator seeded from (seed, block, tensor), so the skewed and the
  unskewed artifact of one config share every expert's bytes.
- Every 2-D weight the codec quantizes, except the embedding, is drawn directly on the INT8 grid:
  uniform int8 values in [-127, 127] and one constant scale per row (or group) giving the
  tensor its std. Quantizing ~30 B random fp32 values on two cores takes most of an hour;
  drawing the bytes takes ~20 s (numpy's SFC64, 1.6 GB/s). Float quant modes store q * scale.
- Router rows have std 1/sqrt(H), so a router's logits have std ~1 at any width (Qwen3's
  H = 2048 gives 0.022, the usual 0.02) and a skew means the same at any width.
- Residual scaling (GPT-2's init): output projections (wo, w2, ew2, shared_w2) have std
  0.02 / sqrt(2 L) and embedding rows std 1, so the 2L sublayers add less to the residual
  stream than the token's own embedding holds: what a layer's router sees stays mostly the
  current token (and the shared direction below), at every depth.

Router skew (`router_skew=s`, a Zipf exponent; None: none). Random routers choose experts
almost uniformly, the expert cache's worst case. With a skew, every embedding row gets one
shared component m (std 1 per element like the rows themselves), and in each sparse layer the
router row of the expert of popularity rank k (a seeded per-layer permutation) gets its own
m-direction part replaced by  -s * ln(k) * u / c,  u = m / |m|, c = sqrt(H / 2) = u . h for an
RMS-normalized h = (row + m) / rms. So every token's logit for that expert carries a bias
-s * ln(k): under softmax-top-1 with unit Gumbel noise that is Zipf popularity k^-s; with the
router's actual noise (std ~0.7: the random rows against the token's own part of h) and top-k it is Zipf-like, and how
skewed is measured, not assumed: see tests/test_synthetic_moe.py and benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tierlm.atomic import atomic_directory, directory_lock
from tierlm.cache import codec
from tierlm.cache.artifact import BLOCK_ALIGN, MANIFEST_NAME, ArtifactWriter
from tierlm.cache.convert import write_layout
from tierlm.cache.encodings import keeps_float
from tierlm.cache.mixed_estimate import aligned_bytes, estimated_modes
from tierlm.models import config_from_dict, family_description
from tierlm.progress import Progress
from tierlm.quant.mixed import ALLOCATOR_VERSION

WEIGHT_STD = 0.02
EMBED_STD = 1.0  # MoE only: see the module docstring (residual scaling)
# MoE only: router rows of std 1/sqrt(H) give logits of std ~1 at any width (0.022 at H 2048)
OUTPUT_PROJECTIONS = ("wo", "w2", "ew2", "shared_w2")  # MoE only: std WEIGHT_STD / sqrt(2 L)
UNIFORM_INT8_STD = math.sqrt((255**2 - 1) / 12)  # std of integers uniform on [-127, 127]
MOE_GENERATOR = 2  # bump when an MoE config's bytes would change for the same key fields (2: fp32 routers)


def write_synthetic_artifact(
    raw_config: Mapping[str, Any],
    target: Path,
    *,
    quant: str = "int8",
    seed: int = 0,
    router_skew: float | None = None,
    progress: Progress | None = None,
) -> Path:
    """An artifact directory at `target` for `raw_config` (a config.json dict), unless present.

    `router_skew`: Zipf exponent of the expert popularity built into an MoE model's routers
    (module docstring); None for a dense model or uniform-ish routing.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    config = config_from_dict(raw_config)
    moe = getattr(config, "moe", None)
    if router_skew is not None and moe is None:
        raise ValueError(f"router_skew needs a mixture-of-experts config, not {config.model_type}")
    fields = {"config": dict(raw_config), "quant": quant, "seed": seed, "codec": codec.CODEC_VERSION}
    if moe is not None:
        fields.update(generator=MOE_GENERATOR, router_skew=router_skew)
    if codec.parse_mode(quant).mixed:  # the per-weight choice's rules
        fields["mixed"] = ALLOCATOR_VERSION
    key = json.dumps(fields, sort_keys=True)
    with directory_lock(target):
        if (target / MANIFEST_NAME).is_file() and json.loads((target / MANIFEST_NAME).read_text()).get("key") == key:
            return target
        family = family_description(config)
        layout, shapes = family.checkpoint_layout(config), family.canonical_shapes(config)
        mode = codec.parse_mode(quant)
        with atomic_directory(target) as tmp:
            writer = ArtifactWriter(tmp)
            try:
                if moe is None:
                    generator = torch.Generator().manual_seed(seed)

                    def tensor_for(block: str, name: str, sources: tuple[str, ...]):
                        return _normal(shapes[name], name, WEIGHT_STD, generator)

                    write_layout(writer, layout, tensor_for, mode, progress, _mixed_modes(config, shapes, layout, mode))
                else:
                    _write_moe(writer, layout, shapes, config, mode, seed, router_skew, progress)
                writer.finish({"key": key, "model_type": config.model_type, "source": "synthetic", "quant": mode.name, "adapters": []})
            finally:
                writer.close()
            (tmp / "config.json").write_text(json.dumps(dict(raw_config), indent=1))
            _write_byte_tokenizer(tmp, config.vocab_size)
    return target


def _mixed_modes(config, shapes, layout, mode):
    """A mixed:SIZE mode's per-weight choice for random weights (estimated: they are all alike);
    None for any other mode. mixed:source has no source grid here: refused."""
    if not mode.mixed:
        return None
    if mode.target_bytes is None:
        raise ValueError("a synthetic artifact has no source grid: use mixed:SIZE or a concrete mode")
    blocks = {block: {name: shapes[name] for name in entries} for block, entries in layout.items()}
    return {key: codec.parse_mode(name) for key, name in estimated_modes(blocks, mode, aligned_bytes, BLOCK_ALIGN).items()}


def _normal(shape, name: str, std: float, generator):
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return std * torch.randn(shape, generator=generator)


def _write_moe(writer, layout, shapes, config, mode, seed: int, skew: float | None, progress) -> None:
    """Every block of an MoE `layout`, tensors drawn as the module docstring describes."""
    output_std = WEIGHT_STD / math.sqrt(2 * config.num_hidden_layers)
    shared = _shared_component(config.hidden_size, seed) if skew is not None else None
    written: dict[tuple[str, ...], tuple[str, str]] = {}
    for done, (block, entries) in enumerate(layout.items(), start=1):
        writer.begin_block(block)
        for name, sources in entries.items():
            if sources in written:  # a tied head
                writer.add_alias(name, *written[sources])
                continue
            generator = _generator(seed, block, name)
            shape = shapes[name]
            if name == "embed":
                rows = _normal(shape, name, EMBED_STD, generator)
                encoded = codec.encode(rows if shared is None else rows.add_(shared), mode, name)
            elif name == "router":
                encoded = codec.encode(_router(shape, generator, shared, skew, seed, block), mode, name)
            elif not keeps_float(name, shape):
                std = output_std if name in OUTPUT_PROJECTIONS else WEIGHT_STD
                encoded = _uniform_int8(shape, std, mode, seed, block, name)
            else:
                encoded = codec.encode(_normal(shape, name, WEIGHT_STD, generator), mode, name)
            writer.add_tensor(name, *encoded)
            written[sources] = (block, name)
        writer.end_block()
        if progress:
            progress(done, len(layout))


def _seed_of(seed: int, block: str, name: str) -> int:
    return (seed << 32) ^ zlib.crc32(f"{block}/{name}".encode())


def _generator(seed: int, block: str, name: str):
    return torch.Generator().manual_seed(_seed_of(seed, block, name))


def _shared_component(hidden: int, seed: int):
    """m: the vector every embedding row shares when routing is skewed (std EMBED_STD)."""
    return EMBED_STD * torch.randn(hidden, generator=_generator(seed, "shared", "m"))


def _router(shape, generator, shared, skew: float | None, seed: int, block: str):
    """Router [E, H]: random rows; with a skew, their m-direction replaced by the Zipf bias."""
    experts, hidden = shape
    rows = torch.randn(shape, generator=generator) / math.sqrt(hidden)
    if shared is None:
        return rows
    u = shared / shared.norm()
    rank = torch.randperm(experts, generator=_generator(seed, block, "popularity")) + 1
    bias = -skew * torch.log(rank.double()).float()  # logit bias of each expert
    return rows - torch.outer(rows @ u, u) + torch.outer(bias / math.sqrt(hidden / 2), u)


def _uniform_int8(shape, std: float, mode, seed: int, block: str, name: str):
    """(encoding, parts, meta) of a random [out, in] weight drawn on the int8 grid (uniform
    values in [-127, 127], a constant scale giving std `std`); float modes store q * scale."""
    rows, columns = shape
    bits = np.random.SFC64(_seed_of(seed, block, name)).random_raw(-(-rows * columns // 8))
    q = bits.view(np.int8)[: rows * columns].reshape(rows, columns)
    np.maximum(q, -127, out=q)  # -128 is off the symmetric grid
    qweight = torch.from_numpy(q)
    scale = std / UNIFORM_INT8_STD
    if not mode.quantized:
        return codec.encode(qweight.float() * scale, mode, name)
    groups = 1 if mode.group_size is None else -(-columns // mode.group_size)
    scales = torch.full((rows, groups), scale, dtype=torch.float32)
    parts = {"qweight": qweight, "scales": scales[:, 0].contiguous() if mode.group_size is None else scales}
    if mode.asymmetric:
        parts["offsets"] = torch.zeros_like(parts["scales"])
    return "int8", parts, {"group_size": mode.group_size}


def _write_byte_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE covering 256 bytes plus ChatML specials (ids beyond decode to nothing)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": template})
    )
