"""Synthetic artifacts: random weights in a real model's shape, written straight to the cache.

Benchmarks and memory-profile tests need models bigger than the machine's budget (a 7B-shaped
INT8 model is ~7 GB) without a checkpoint to convert; this writes the artifact block by block
from a seeded generator, with a tiny byte-level tokenizer so every command can run on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tierlm.atomic import atomic_directory, directory_lock
from tierlm.cache import codec
from tierlm.cache.artifact import MANIFEST_NAME, ArtifactWriter
from tierlm.cache.convert import write_layout
from tierlm.config import ModelConfig
from tierlm.progress import Progress

WEIGHT_STD = 0.02


def write_synthetic_artifact(
    raw_config: Mapping[str, Any],
    target: Path,
    *,
    quant: str = "int8",
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """An artifact directory at `target` for `raw_config` (a config.json dict), unless present."""
    import torch

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    key = json.dumps({"config": dict(raw_config), "quant": quant, "seed": seed, "codec": codec.CODEC_VERSION}, sort_keys=True)
    with directory_lock(target):
        if (target / MANIFEST_NAME).is_file() and json.loads((target / MANIFEST_NAME).read_text()).get("key") == key:
            return target
        config = ModelConfig.from_dict(raw_config)
        from tierlm.models import family_class

        family = family_class(config)
        layout, shapes = family.checkpoint_layout(config), family.canonical_shapes(config)
        mode = codec.parse_mode(quant)
        generator = torch.Generator().manual_seed(seed)
        with atomic_directory(target) as tmp:
            writer = ArtifactWriter(tmp)

            def tensor_for(block: str, name: str, sources: tuple[str, ...]):
                shape = shapes[name]
                if "norm" in name:
                    return 1.0 + 0.1 * torch.randn(shape, generator=generator)
                return WEIGHT_STD * torch.randn(shape, generator=generator)

            try:
                write_layout(writer, layout, tensor_for, mode, progress)
                writer.finish({"key": key, "model_type": config.model_type, "source": "synthetic", "quant": mode.name, "adapters": []})
            finally:
                writer.close()
            (tmp / "config.json").write_text(json.dumps(dict(raw_config), indent=1))
            _write_byte_tokenizer(tmp, config.vocab_size)
    return target


def _write_byte_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE covering 256 bytes plus ChatML specials (ids beyond decode to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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
