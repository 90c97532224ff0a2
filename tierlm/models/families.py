"""Each family's description, without torch: what its config.json means and how its checkpoint's
tensors fill tierlm's blocks, with their shapes.

Config parsing (config.py, handed these classes by the registry in models/__init__.py), the sizes
offload/ predicts and the planner read a family from here, so `tierlm list`, `show` and `plan`
start without torch. Each torch model class (llama.py, qwen2.py, ...) inherits its description,
so `Model.checkpoint_layout(config)` is this module's answer too. Families change code, not flags:
a family refines the one it derives from (Qwen2 is Llama with q/k/v biases, ...).
"""

from __future__ import annotations

from typing import Any, Mapping

from tierlm.blocks import EMBED, HEAD, NORM, BlockLayout, CheckpointLayout, expert_block, layer_block, layer_index
from tierlm.config import MAX_ROPE_THETA, ModelConfig, read_moe
from tierlm.errors import TierlmError


class LlamaFamily:
    """Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral (sliding window): the description
    every other family refines.

    Block tensors use tierlm's canonical names: per layer `attn_norm`, `wqkv` [(Hq+2Hkv)*D, H]
    (`bqkv`), `wo` (`bo`), `mlp_norm`, `w13` [2I, H] (`b13`), `w2` (`b2`), and Qwen3's
    `q_norm`, `k_norm` [D]; `embed`, `norm`, `head` for the other blocks.
    """

    model_module = "tierlm.models.llama"  # the torch implementation (its `Model`); models.family_class imports it

    # -- what this family's config.json means: config.py asks while it parses -------------------

    partial_rotary_default = 1.0  # share of each head's channels RoPE rotates unless config.json says

    @staticmethod
    def translate_config(fields) -> Mapping[str, Any]:
        """config.json under the keys ModelConfig reads (`fields`: config.py's checked reads of it)."""
        return fields.raw

    @staticmethod
    def sliding_window_in_force(fields) -> bool:
        """Whether a sliding_window that config.json sets applies (else attention is full)."""
        return True

    @staticmethod
    def default_layer_types(fields, layers: int) -> list[str] | None:
        """Each layer's attention kind when config.json has no layer_types; None: every layer slides."""
        return None

    @staticmethod
    def rotated_channels(config: ModelConfig) -> int:
        """How many of each head's channels RoPE rotates: all of them."""
        return config.head_dim

    @staticmethod
    def moe_config(fields, layers: int):
        """The mixture-of-experts routing config.json sets (config.MoeConfig); None: a dense model."""
        return None

    # -- the checkpoint's tensors, blocks and shapes ---------------------------------------------

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig) -> CheckpointLayout:
        """Map each block's canonical tensors to the checkpoint tensors they are built from.

        A tuple of several names is concatenated along the output dimension (fused q/k/v,
        fused gate/up), so one matmul replaces two or three.
        """
        layout: CheckpointLayout = {EMBED: {"embed": ("model.embed_tokens.weight",)}}
        for i in range(config.num_hidden_layers):
            layout[layer_block(i)] = cls.layer_layout(config, i)
        layout[NORM] = {"norm": ("model.norm.weight",)}
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        layout[HEAD] = {"head": (head,)}
        return layout

    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        """Layer `i`'s canonical tensors and their checkpoint sources (HF Llama names)."""
        attn = f"model.layers.{i}.self_attn."
        mlp = f"model.layers.{i}.mlp."
        block = {
            "attn_norm": (f"model.layers.{i}.input_layernorm.weight",),
            "wqkv": tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            "wo": (f"{attn}o_proj.weight",),
            "mlp_norm": (f"model.layers.{i}.post_attention_layernorm.weight",),
            "w13": (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),
            "w2": (f"{mlp}down_proj.weight",),
        }
        block.update(cls.bias_layout(config, attn, mlp))
        return block

    @staticmethod
    def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The shape of every canonical block tensor this family may use."""
        hidden, inter, qkv = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
        return {
            "embed": (config.vocab_size, hidden),
            "head": (config.vocab_size, hidden),
            "norm": (hidden,),
            "attn_norm": (hidden,),
            "mlp_norm": (hidden,),
            "wqkv": (qkv, hidden),
            "bqkv": (qkv,),
            "wo": (hidden, config.q_size),
            "bo": (hidden,),
            "w13": (2 * inter, hidden),
            "b13": (2 * inter,),
            "w2": (hidden, inter),
            "b2": (hidden,),
        }

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        biases: BlockLayout = {}
        if config.attention_bias:
            biases["bqkv"] = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
            biases["bo"] = (f"{attn}o_proj.bias",)
        if config.mlp_bias:
            biases["b13"] = (f"{mlp}gate_proj.bias", f"{mlp}up_proj.bias")
            biases["b2"] = (f"{mlp}down_proj.bias",)
        return biases

    @classmethod
    def block_shapes(cls, config: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
        """Each block's canonical tensors and their shapes, in the order conversion stores them
        (offload/sizes.py predicts an artifact's block sizes from this; no tensor is made)."""
        shapes = cls.canonical_shapes(config)
        return {block: {name: shapes[name] for name in tensors} for block, tensors in cls.checkpoint_layout(config).items()}


class QwenWindow:
    """Qwen2's and Qwen3's sliding-window rule (their configs' keys; shared by both families)."""

    @staticmethod
    def sliding_window_in_force(fields) -> bool:
        # Qwen configs carry a sliding_window that is inactive unless use_sliding_window is set...
        return fields.flag("use_sliding_window", False)

    @staticmethod
    def default_layer_types(fields, layers: int) -> list[str]:
        # ...and then it applies only to the layers from max_window_layers on.
        first = fields.integer("max_window_layers", 28, low=0, limit="num_hidden_layers")  # Qwen2/3Config's default
        return ["full_attention"] * min(first, layers) + ["sliding_attention"] * max(layers - first, 0)


class Qwen2Family(QwenWindow, LlamaFamily):
    """Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections (none on o_proj)."""

    model_module = "tierlm.models.qwen2"

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        # Qwen2 checkpoints always carry q/k/v biases; config.json does not announce them.
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")}


class Qwen3Family(QwenWindow, LlamaFamily):
    """Qwen3 (dense): Llama plus `q_norm`, `k_norm` [head_dim], Qwen2's sliding-window rule."""

    model_module = "tierlm.models.qwen3"

    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        block = super().layer_layout(config, i)
        attn = f"model.layers.{i}.self_attn."
        block["q_norm"] = (f"{attn}q_norm.weight",)
        block["k_norm"] = (f"{attn}k_norm.weight",)
        return block

    @staticmethod
    def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = LlamaFamily.canonical_shapes(config)
        return {**shapes, "q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}


class GlmFamily(LlamaFamily):
    """GLM-4 in the transformers-native layout: partial RoPE, q/k/v biases only, gate and up
    stored fused as `mlp.gate_up_proj` (models/glm.py says more)."""

    model_module = "tierlm.models.glm"
    partial_rotary_default = 0.5  # GlmConfig's

    @staticmethod
    def rotated_channels(config: ModelConfig) -> int:
        return int(config.head_dim * config.rope.partial_rotary_factor)

    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        block = super().layer_layout(config, i)
        block["w13"] = (f"model.layers.{i}.mlp.gate_up_proj.weight",)
        return block

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        if not config.attention_bias:
            return {}
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")}


# ChatGLM2/3 switches tierlm cannot honour: (key, ChatGLMConfig's default, the value it needs).
_CHATGLM_REQUIRED_SWITCHES = (
    ("multi_query_attention", False, True),
    ("rmsnorm", True, True),
    ("post_layer_norm", True, True),
    ("apply_residual_connection_post_layernorm", False, False),
    ("add_bias_linear", False, False),
)


class ChatGLMFamily(GlmFamily):
    """ChatGLM2/3 (and GLM-4 published in the same layout): GLM under ChatGLM's config keys and
    tensor names (models/chatglm.py's docstring maps them and says what is refused)."""

    model_module = "tierlm.models.chatglm"

    @staticmethod
    def translate_config(fields) -> dict[str, Any]:
        """A ChatGLM2/3 (or GLM-4 in ChatGLM layout) config.json under the keys GlmConfig uses.

        ChatGLM keeps its own names (num_layers, padded_vocab_size, ffn_hidden_size, kv_channels,
        multi_query_group_num, add_qkv_bias, layernorm_epsilon, seq_length); its RoPE is GLM's with
        half of each head rotating and base 10000 * rope_ratio (models/chatglm.py says why).
        Values are checked here, under ChatGLM's names, so errors name the key the file has.
        """
        raw = fields.raw
        if "position_encoding_2d" in raw or "padded_vocab_size" not in raw:
            raise TierlmError(
                "config.json describes the first ChatGLM-6B (2-D positions, GELU), which tierlm does not run",
                "tierlm runs ChatGLM2/3 and GLM-4 checkpoints",
            )
        for key, default, needed in _CHATGLM_REQUIRED_SWITCHES:
            if fields.flag(key, default) != needed:
                raise TierlmError(
                    f"config.json sets {key} = {str(not needed).lower()}, which tierlm does not support",
                    f"tierlm runs ChatGLM checkpoints with {key} = {str(needed).lower()} (as ChatGLM2/3 ship)",
                )
        hidden = fields.integer("hidden_size")
        heads = fields.integer("num_attention_heads")
        return {
            "model_type": "chatglm",
            "vocab_size": fields.integer("padded_vocab_size", limit="vocab_size"),
            "hidden_size": hidden,
            "intermediate_size": fields.integer("ffn_hidden_size", limit="intermediate_size"),
            "num_hidden_layers": fields.integer("num_layers", limit="num_hidden_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": fields.integer("multi_query_group_num", 1, limit="num_key_value_heads"),
            "head_dim": fields.integer("kv_channels", None, limit="head_dim"),
            "rms_norm_eps": fields.number("layernorm_epsilon", 1e-5, low=0.0, high=1.0, open_low=True),
            "max_position_embeddings": fields.integer("seq_length", 2048, limit="max_position_embeddings"),
            # ChatGLM never ties: output_layer is its own tensor whatever the config says.
            "tie_word_embeddings": False,
            "attention_bias": fields.flag("add_qkv_bias", False),
            # rope_ratio >= 1e-4 keeps the base >= 1, as rope_theta is bounded.
            "rope_theta": 10000.0 * fields.number("rope_ratio", 1.0, low=1e-4, high=MAX_ROPE_THETA / 1e4),
            "partial_rotary_factor": 0.5,
            "bos_token_id": raw.get("bos_token_id"),
            "eos_token_id": raw.get("eos_token_id"),
            "torch_dtype": raw.get("torch_dtype") or raw.get("dtype"),
        }

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig) -> CheckpointLayout:
        layout: CheckpointLayout = {EMBED: {"embed": ("transformer.embedding.word_embeddings.weight",)}}
        for i in range(config.num_hidden_layers):
            layer = f"transformer.encoder.layers.{i}."
            block = {
                "attn_norm": (f"{layer}input_layernorm.weight",),
                "wqkv": (f"{layer}self_attention.query_key_value.weight",),
                "wo": (f"{layer}self_attention.dense.weight",),
                "mlp_norm": (f"{layer}post_attention_layernorm.weight",),
                "w13": (f"{layer}mlp.dense_h_to_4h.weight",),
                "w2": (f"{layer}mlp.dense_4h_to_h.weight",),
            }
            if config.attention_bias:  # add_qkv_bias
                block["bqkv"] = (f"{layer}self_attention.query_key_value.bias",)
            layout[layer_block(i)] = block
        layout[NORM] = {"norm": ("transformer.encoder.final_layernorm.weight",)}
        layout[HEAD] = {"head": ("transformer.output_layer.weight",)}
        return layout


# ---------------------------------------------------------------------------- mixture of experts


class MoeFamily:
    """Mixin over a dense family: each sparse layer's block `layers.{i}` keeps the attention, the
    norms, the `router` [E, H] and (Qwen2-MoE) the shared expert, and is followed by one block per
    routed expert `experts.{i}.{e}` (`ew13` [2Ie, H] gate rows then up rows, `ew2` [H, Ie])."""

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig) -> CheckpointLayout:
        """The dense family's blocks, each sparse layer followed by its experts' blocks."""
        layout: CheckpointLayout = {}
        for block, tensors in super().checkpoint_layout(config).items():
            layout[block] = tensors
            layer = layer_index(block)
            if layer is not None and config.moe.is_sparse(layer):
                for e in range(config.moe.experts):
                    layout[expert_block(layer, e)] = cls.expert_layout(config, layer, e)
        return layout

    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        block = super().layer_layout(config, i)
        if config.moe.is_sparse(i):
            for name in ("w13", "w2", "b13", "b2"):
                block.pop(name, None)
            block.update(cls.router_layout(config, i))
        return block

    @staticmethod
    def router_layout(config: ModelConfig, i: int) -> BlockLayout:
        """A sparse layer's router (and shared expert) sources; Qwen-MoE names."""
        return {"router": (f"model.layers.{i}.mlp.gate.weight",)}

    @staticmethod
    def expert_layout(config: ModelConfig, i: int, e: int) -> BlockLayout:
        """Expert `e` of layer `i`: its sources (Qwen-MoE names)."""
        expert = f"model.layers.{i}.mlp.experts.{e}."
        return {"ew13": (f"{expert}gate_proj.weight", f"{expert}up_proj.weight"), "ew2": (f"{expert}down_proj.weight",)}

    @classmethod
    def canonical_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        moe, hidden = config.moe, config.hidden_size
        shapes = super().canonical_shapes(config)
        shapes.update(router=(moe.experts, hidden), ew13=(2 * moe.expert_intermediate, hidden),
                      ew2=(hidden, moe.expert_intermediate))  # fmt: skip
        if moe.shared_intermediate:
            shapes.update(shared_w13=(2 * moe.shared_intermediate, hidden), shared_w2=(hidden, moe.shared_intermediate),
                          shared_gate=(1, hidden))  # fmt: skip
        return shapes


class MixtralFamily(MoeFamily, LlamaFamily):
    """Mixtral: Mistral whose every MLP is top-k of `num_local_experts` experts, always renormalized;
    `intermediate_size` is each expert's width. Tensors live under `block_sparse_moe`: `gate` is the
    router, expert `w1` the gate, `w3` the up and `w2` the down projection."""

    model_module = "tierlm.models.mixtral"

    @staticmethod
    def moe_config(fields, layers: int):
        return read_moe(fields, layers, expert_intermediate="intermediate_size", shared=False,
                        norm_topk_prob=True, sparse_rule=False)  # fmt: skip

    @staticmethod
    def router_layout(config: ModelConfig, i: int) -> BlockLayout:
        return {"router": (f"model.layers.{i}.block_sparse_moe.gate.weight",)}

    @staticmethod
    def expert_layout(config: ModelConfig, i: int, e: int) -> BlockLayout:
        expert = f"model.layers.{i}.block_sparse_moe.experts.{e}."
        return {"ew13": (f"{expert}w1.weight", f"{expert}w3.weight"), "ew2": (f"{expert}w2.weight",)}


class Qwen2MoeFamily(MoeFamily, Qwen2Family):
    """Qwen2-MoE: Qwen2 with routed experts plus a shared expert per sparse layer; `qkv_bias`
    (default true) says whether q/k/v carry biases; `decoder_sparse_step` and `mlp_only_layers`
    say which layers keep a dense MLP."""

    model_module = "tierlm.models.qwen2_moe"

    @staticmethod
    def translate_config(fields) -> Mapping[str, Any]:
        return {**fields.raw, "attention_bias": fields.flag("qkv_bias", True)}

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        # Biases on q/k/v only, as Qwen2's, but switchable by qkv_bias (read as attention_bias).
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")} if config.attention_bias else {}

    @staticmethod
    def default_layer_types(fields, layers: int) -> list[str]:
        # Qwen2MoeConfig's rule: even-indexed layers below max_window_layers slide.
        first = fields.integer("max_window_layers", 28, low=0, limit="num_hidden_layers")
        return ["sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(layers)]

    @staticmethod
    def moe_config(fields, layers: int):
        return read_moe(fields, layers, expert_intermediate="moe_intermediate_size", shared=True,
                        norm_topk_prob=None, sparse_rule=True)  # fmt: skip

    @staticmethod
    def router_layout(config: ModelConfig, i: int) -> BlockLayout:
        mlp = f"model.layers.{i}.mlp."
        shared = f"{mlp}shared_expert."
        return {
            "router": (f"{mlp}gate.weight",),
            "shared_w13": (f"{shared}gate_proj.weight", f"{shared}up_proj.weight"),
            "shared_w2": (f"{shared}down_proj.weight",),
            "shared_gate": (f"{mlp}shared_expert_gate.weight",),
        }


class Qwen3MoeFamily(MoeFamily, Qwen3Family):
    """Qwen3-MoE: Qwen3 (q/k head norms) with routed experts, no shared expert."""

    model_module = "tierlm.models.qwen3_moe"

    @staticmethod
    def default_layer_types(fields, layers: int) -> None:
        return None  # Qwen3MoeConfig: with use_sliding_window, every layer slides

    @staticmethod
    def moe_config(fields, layers: int):
        return read_moe(fields, layers, expert_intermediate="moe_intermediate_size", shared=False,
                        norm_topk_prob=None, sparse_rule=True)  # fmt: skip
