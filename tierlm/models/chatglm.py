"""ChatGLM2/3 (and GLM-4 published in the same layout), model_type "chatglm", read as stored.

No checkpoint code is run: `translate_config` maps ChatGLM's config keys to GLM's, and
`checkpoint_layout` maps its tensor names onto tierlm's blocks (both in its torch-free
description, models/families.py ChatGLMFamily). The architecture is then GLM's
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

from tierlm.models.families import ChatGLMFamily
from tierlm.models.glm import GlmModel


class ChatGLMModel(ChatGLMFamily, GlmModel):
    """GLM's forward over ChatGLM's description (translate_config, checkpoint_layout: families.py)."""


Model = ChatGLMModel
