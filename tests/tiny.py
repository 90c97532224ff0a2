"""Tiny random models in the Hugging Face layout, built on the fly with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE with specials at ids 0-2, trained on a small corpus to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog. hello world, how are you?"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    byte_level_tokenizer(vocab_size).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML})
    )


def make_model(
    model_dir: Path,
    family: str = "llama",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 96,
    vocab: int = 320,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    **extra,
):
    """Save a random model of `family` (llama, qwen2, mistral) to model_dir; returns the HF model.

    Every parameter (biases and norms included) is drawn at random so none is trivially zero
    or one, which would hide a missing bias or a mis-mapped norm.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[family]
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model = model.to(dtype)
    model.save_pretrained(model_dir)
    if with_tokenizer:
        write_tokenizer(Path(model_dir), vocab)
    return model
