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


# Logits of a decode step, fused against eager: both multiply int16-quantized activations on
# x86 (quant/csrc/gemv_a16.h, each product within 2e-5 of its magnitude) in their own orders,
# which the tiny models' logits show as up to ~1.5e-4; 1e-3 is issue 26's bar against transformers.
DECODE_ATOL = 1e-3

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
    """Save a random model of `family` (llama, qwen2, qwen3, mistral, glm, and the MoE families
    mixtral, qwen2_moe, qwen3_moe: see MOE_CASES) to model_dir; returns the HF model.

    Every parameter (biases and norms included) is drawn at random so none is trivially zero
    or one, which would hide a missing bias or a mis-mapped norm.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "glm": (transformers.GlmConfig, transformers.GlmForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[family]
    if family in ("qwen3", "glm", "qwen3_moe"):
        extra.setdefault("head_dim", hidden // heads)  # their configs default to 128
    if family == "glm":
        extra.setdefault("pad_token_id", None)  # GlmConfig's default lies outside a tiny vocab
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
    model = randomize(model_cls(config).eval()).to(dtype)
    model.save_pretrained(model_dir)
    if with_tokenizer:
        write_tokenizer(Path(model_dir), vocab)
    return model


def randomize(model):
    """Draw every parameter at random: norms near 1, the rest small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    return model


def chatglm_config(
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    groups: int = 2,
    kv_channels: int = 16,
    ffn: int = 96,
    vocab: int = 320,
    seq_length: int = 512,
    rope_ratio: float = 1.0,
    qkv_bias: bool = True,
    **overrides,
) -> dict:
    """A ChatGLM2/3 config.json (its own keys, as THUDM ships them) for a tiny model."""
    return {
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "auto_map": {"AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
        "num_layers": layers,
        "padded_vocab_size": vocab,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "kv_channels": kv_channels,
        "num_attention_heads": heads,
        "multi_query_attention": True,
        "multi_query_group_num": groups,
        "add_bias_linear": False,
        "add_qkv_bias": qkv_bias,
        "apply_query_key_layer_scaling": True,
        "apply_residual_connection_post_layernorm": False,
        "attention_softmax_in_fp32": True,
        "fp32_residual_connection": False,
        "layernorm_epsilon": 1e-5,
        "rmsnorm": True,
        "post_layer_norm": True,
        "original_rope": True,
        "rope_ratio": rope_ratio,
        "seq_length": seq_length,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        **overrides,
    }


def make_chatglm(model_dir: Path, *, seed: int = 0, **config_args):
    """Save a random ChatGLM2/3-layout checkpoint (config keys and tensor names as THUDM's) to
    model_dir; return transformers' GlmForCausalLM holding the same weights under GLM's names.

    The GLM reference is built only from the documented mapping (transformers' own GLM
    conversion): config keys renamed, rope_theta = 10000 * rope_ratio, half of each head
    rotating; query_key_value split into q/k/v, dense_h_to_4h kept fused as gate_up_proj.
    """
    import transformers
    from safetensors.torch import save_file

    raw = chatglm_config(**config_args)
    heads, groups, dim = raw["num_attention_heads"], raw["multi_query_group_num"], raw["kv_channels"]
    reference = transformers.GlmConfig(
        vocab_size=raw["padded_vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["ffn_hidden_size"],
        num_hidden_layers=raw["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=dim,
        max_position_embeddings=raw["seq_length"],
        rms_norm_eps=raw["layernorm_epsilon"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0 * raw["rope_ratio"],
                         "partial_rotary_factor": 0.5},
        attention_bias=raw["add_qkv_bias"],
        tie_word_embeddings=False,
        pad_token_id=None,
        eos_token_id=raw["eos_token_id"],
    )
    torch.manual_seed(seed)
    model = randomize(transformers.GlmForCausalLM(reference).eval())
    glm = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    tensors = {
        "transformer.embedding.word_embeddings.weight": glm["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": glm["model.norm.weight"],
        "transformer.output_layer.weight": glm["lm_head.weight"],
        # ChatGLM stores its rotary frequencies; tierlm must recompute rather than read them.
        "transformer.rotary_pos_emb.inv_freq": torch.full((dim // 4,), float("nan")),
    }
    for i in range(raw["num_layers"]):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        attn = f"{src}self_attn."
        tensors[f"{dst}input_layernorm.weight"] = glm[f"{src}input_layernorm.weight"]
        tensors[f"{dst}post_attention_layernorm.weight"] = glm[f"{src}post_attention_layernorm.weight"]
        tensors[f"{dst}self_attention.query_key_value.weight"] = torch.cat(
            [glm[f"{attn}{p}_proj.weight"] for p in "qkv"])
        if raw["add_qkv_bias"]:
            tensors[f"{dst}self_attention.query_key_value.bias"] = torch.cat(
                [glm[f"{attn}{p}_proj.bias"] for p in "qkv"])
        tensors[f"{dst}self_attention.dense.weight"] = glm[f"{attn}o_proj.weight"]
        tensors[f"{dst}mlp.dense_h_to_4h.weight"] = glm[f"{src}mlp.gate_up_proj.weight"]
        tensors[f"{dst}mlp.dense_4h_to_h.weight"] = glm[f"{src}mlp.down_proj.weight"]
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(raw, indent=1))
    return model


def make_case(model_dir: Path, case: dict):
    """Write a parity case's checkpoint (`family` plus make_model / make_chatglm arguments);
    return the transformers reference over the same weights."""
    args = dict(case)
    family = args.pop("family")
    if family == "chatglm":
        return make_chatglm(model_dir, **args)
    return make_model(model_dir, family, with_tokenizer=False, **args)


def prompt(vocab: int, length: int = 24, seed: int = 1) -> torch.Tensor:
    """Random token ids [1, length], the same for a given seed."""
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(loaded, ids: torch.Tensor, steps: int, use_cache: bool) -> list[int]:
    """`steps` greedy tokens after `ids`, through the KV cache or re-running the whole sequence."""
    tokens = ids[0].tolist()
    cache = loaded.new_cache()
    logits = loaded.model.forward(ids, cache)
    out = []
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        out.append(token)
        tokens.append(token)
        if use_cache:
            logits = loaded.model.forward(torch.tensor([[token]]), cache)
        else:
            cache = loaded.new_cache()
            logits = loaded.model.forward(torch.tensor([tokens]), cache)
    return out



def write_profile(path: Path, *, context_length: int, batch_size: int) -> Path:
    """A roomy CPU profile file (no offload, weights as stored) for tests that serve a tiny model."""
    path.write_text(
        'description = "tests: a tiny model, nothing streamed"\n'
        'device_memory = "2GiB"\nhost_memory = "2GiB"\ndisk_offload = false\nheadroom = "256MiB"\n'
        'quant = "none"\nkv_cache = "auto"\nprefetch_depth = 0\n'
        f"context_length = {context_length}\nbatch_size = {batch_size}\n"
    )
    return path


# Tiny mixture-of-experts models: Mixtral (every layer sparse, top-2 of 4), Qwen2-MoE (shared
# expert, top-2 of 6, no renormalization), Qwen3-MoE (sparse layers 1 and 5 of 6: decoder_sparse_step
# 2 and mlp_only_layers [3] leave 0, 2, 3, 4 dense; top-3 of 8 renormalized).
MOE_CASES = {
    "mixtral": dict(family="mixtral", heads=4, kv_heads=2, intermediate=48, num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe-shared": dict(family="qwen2_moe", heads=4, kv_heads=2, num_experts=6, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3-moe-dense-and-sparse": dict(family="qwen3_moe", heads=4, kv_heads=2, layers=6, num_experts=8,
                                       num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=2,
                                       mlp_only_layers=[3], norm_topk_prob=True),
}  # fmt: skip


# Decode cases for the fused CPU step and the device graphs: every family and each of its
# quirks (bias, q/k norm, partial rotary, grouped KV heads, a sliding window shorter than the run).
DECODE_CASES = {
    "llama-gqa": dict(family="llama", heads=4, kv_heads=2),
    "llama-mqa-bias-head-dim-32": dict(family="llama", heads=4, kv_heads=1, head_dim=32, attention_bias=True,
                                       mlp_bias=True),
    "qwen2-bias": dict(family="qwen2", heads=4, kv_heads=2),
    "qwen3-qk-norm": dict(family="qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32),
    "glm-quarter-rotary": dict(
        family="glm", hidden=64, heads=2, kv_heads=1, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
    ),
    "chatglm": dict(family="chatglm", heads=4, groups=2, rope_ratio=2.5),
    "mistral-window-3": dict(family="mistral", heads=4, kv_heads=1, layers=3, sliding_window=3),
}  # fmt: skip


def checkpoint_maker(tmp_path_factory, cases: dict):
    """get(name) -> the folder of `cases[name]`'s checkpoint (make_case), built on first use."""
    made = {}

    def get(case):
        if case not in made:
            made[case] = tmp_path_factory.mktemp(case)
            make_case(made[case], cases[case])
        return made[case]

    return get


def decode_steps(loaded, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """(logits [steps + 1, V], greedy tokens) of a prefill of `ids` [1, T] then `steps` one-token forwards."""
    cache = loaded.new_cache()
    rows = [loaded.model.forward(ids, cache)[0, -1]]
    tokens = [int(rows[-1].argmax())]
    for _ in range(steps):
        rows.append(loaded.model.forward(torch.tensor([[tokens[-1]]]), cache)[0, -1])
        tokens.append(int(rows[-1].argmax()))
    return torch.stack(rows), tokens


def scattered_slot_prompts(vocab: int) -> tuple[list[list[int]], list[int]]:
    """Three prompts (11, 3 and 7 tokens: past a 3- or 6-token window) and the out-of-order
    slots [2, 0, 3] of a 4-slot cache they go to, for batched decode tests."""
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (11, 3, 7)], [2, 0, 3]


def paged_cache(config, max_len: int, slots: int, **options):
    """A PagedKVCache (the server's) of `slots` page tables whose pool holds each a whole context."""
    from tierlm.kv.paged import PagedKVCache, pages_for

    return PagedKVCache.for_model(config, max_len, slots, slots * pages_for(max_len), **options)


def scatter_pages(cache, seed: int = 0) -> None:
    """Make a PagedKVCache's pool hand out free pages in random order, so that no sequence's pages
    are consecutive (the pool itself keeps them in runs where it can)."""
    import random

    from tierlm.kv.paged import PoolFull

    pool, rng = cache.pool, random.Random(seed)

    def take(after=None):
        if not pool._free:
            raise PoolFull("full")
        page = rng.choice(sorted(pool._free))
        pool._free.remove(page)
        pool.holders[page] = 1
        return page

    pool.take = take


def decode_slots(loaded, cache, prompts: list[list[int]], slots: list[int], steps: int) -> torch.Tensor:
    """Logits [steps + 1, rows, V]: each prompt prefilled into its slot of a paged `cache`, then
    `steps` batched greedy steps over those slots."""
    current = [loaded.model.forward(torch.tensor([p]), cache.slot(s))[0, -1] for p, s in zip(prompts, slots)]
    out = [torch.stack(current)]
    for _ in range(steps):
        ids = torch.tensor([[int(logits.argmax())] for logits in out[-1]])
        out.append(loaded.model.forward_batch(ids, cache.batch(slots)))
    return torch.stack(out)
