"""ChatGLM2/3 (and GLM-4 published in the same layout), model_type "chatglm", read as stored.

No checkpoint code is run: `translate_config` maps ChatGLM's config keys to GLM's, and
`checkpoint_layout` maps its tensor names onto tierlm's blocks. The architecture is then GLM's
(models/glm.py), which transformers' own GLM conversion relies on too:

    transformer.embedding.word_embeddings        -> embed
    encoder.layers.N.input_layernorm             -> attn_norm
    encoder.layers.N.self_attention.query_key_value.{weight,bias}
                                                 -> wqkv, bqkv: already [q; k; v] with
                                                    multi_query_group_num KV heads
    encoder.layers.N.self_attention.dense        -> wo (no bias)
    encoder.layers.N.post_attention_layernorm    -> mlp_norm
    encoder.layers.N.mlp.dense_h_to_4h           -> w13: already [gate; up]
    encoder.layers.N.mlp.dense_4h_to_h           -> w2
    transformer.encoder.final_layernorm          -> norm
    transformer.output_layer                     -> head (never tied)
    transformer.rotary_pos_emb.inv_freq          -> not read (recomputed)

Differences found, and how they resolve:
- RoPE. ChatGLM builds its rotary embedding with dim = kv_channels / 2 and applies it to the
  first half of each head, viewed as [..., D/4, 2]: pairs (2i, 2i + 1), the rest passing
  through. That is GLM's partial_rotary_factor = 0.5 with interleaved pairs, with frequency i
  = base^(-2i / (D/2)), as GLM computes it for dim = D/2.
- Rope base. ChatGLM3 and GLM-4 multiply the base by `rope_ratio` (10000 * rope_ratio, what
  transformers' conversion writes as rope_theta). ChatGLM2-6B-32K instead divided positions by
  its rope_ratio; config.json cannot tell the two apart, so such a checkpoint is read the
  ChatGLM3 way and would not match its own code.
- RMSNorm. ChatGLM multiplies the weight in fp32 and rounds once; GLM (and tierlm) round the
  normalized value to the compute dtype first. Identical in fp32; in bf16/fp16 they can differ
  in the last bit.
- Attention scale. ChatGLM's apply_query_key_layer_scaling divides scores by the layer number
  and multiplies them back before an fp32 softmax: the plain 1/sqrt(D) scale.
- Refused (`translate_config`): multi_query_attention false (its fused q/k/v is interleaved per head),
  LayerNorm instead of RMSNorm, no final norm, residual taken after the norm, biases on
  every linear, and the first ChatGLM-6B (a different architecture).
- Tokenizer. ChatGLM2/3 ship their tokenizer as Python code (tokenization_chatglm.py); tierlm
  needs a tokenizer.json and says so (runtime/tokenizer.py).
"""

from __future__ import annotations

from typing import Any

from tierlm.blocks import EMBED, HEAD, NORM, CheckpointLayout, layer_block
from tierlm.config import MAX_ROPE_THETA, ModelConfig
from tierlm.errors import TierlmError
from tierlm.models.glm import GlmModel


# ChatGLM2/3 switches tierlm cannot honour: (key, ChatGLMConfig's default, the value it needs).
_REQUIRED_SWITCHES = (
    ("multi_query_attention", False, True),
    ("rmsnorm", True, True),
    ("post_layer_norm", True, True),
    ("apply_residual_connection_post_layernorm", False, False),
    ("add_bias_linear", False, False),
)


class ChatGLMModel(GlmModel):
    @staticmethod
    def translate_config(fields) -> dict[str, Any]:
        """A ChatGLM2/3 (or GLM-4 in ChatGLM layout) config.json under the keys GlmConfig uses.

        ChatGLM keeps its own names (num_layers, padded_vocab_size, ffn_hidden_size, kv_channels,
        multi_query_group_num, add_qkv_bias, layernorm_epsilon, seq_length); its RoPE is GLM's with
        half of each head rotating and base 10000 * rope_ratio (the module docstring says why).
        Values are checked here, under ChatGLM's names, so errors name the key the file has.
        """
        raw = fields.raw
        if "position_encoding_2d" in raw or "padded_vocab_size" not in raw:
            raise TierlmError(
                "config.json describes the first ChatGLM-6B (2-D positions, GELU), which tierlm does not run",
                "tierlm runs ChatGLM2/3 and GLM-4 checkpoints",
            )
        for key, default, needed in _REQUIRED_SWITCHES:
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


Model = ChatGLMModel
