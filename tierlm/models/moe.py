"""The mixture-of-experts MLP shared by Mixtral, Qwen2-MoE and Qwen3-MoE (mixtral.py, qwen2_moe.py,
qwen3_moe.py put `MoeLayers` before their description and their dense family's class).

A sparse layer's block `layers.{i}` holds the attention, the norms, the `router` [E, H] and (Qwen2-MoE)
the shared expert; each routed expert is its own block `experts.{i}.{e}` (`ew13` [2Ie, H] gate rows then
up rows, `ew2` [H, Ie]), borrowed through `WeightStore.experts` only when a token chooses it. Routing is
transformers': fp32 softmax over the router's logits, top-k, renormalized when `norm_topk_prob`. Rows
are grouped per expert so each chosen expert runs once for every row that chose it, and the outputs,
scaled by their routing weights, are added in ascending expert order, as transformers adds them.
"""

from __future__ import annotations

import torch

from tierlm.blocks import layer_block
from tierlm.config import ModelConfig
from tierlm.models import base


class MoeLayers:
    """Mixin over a dense family's model: the sparse layers' MLP (their layout is MoeFamily's, in
    models/families.py; families change code, not flags)."""

    def __init__(self, config: ModelConfig, *args, **kwargs):
        # Per layer once, so the forward asks a list rather than the config's tuple.
        self.sparse = [config.moe.is_sparse(i) for i in range(config.num_hidden_layers)]
        super().__init__(config, *args, **kwargs)

    def mlp(self, w, h: torch.Tensor, index: int) -> torch.Tensor:
        if not self.sparse[index]:
            return super().mlp(w, h, index)
        return sparse_mlp(self, w, h, index)


def sparse_mlp(model, w, h: torch.Tensor, layer: int) -> torch.Tensor:
    """A sparse layer's MLP on normed h [B, T, H] (w: the layer's dense block)."""
    moe, store = model.config.moe, model.store
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    logits = base.linear(x, w["router"])
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    if store.speculates:
        speculate(model, x, layer)
    if x.shape[0] == 1:
        out = _one_row(store, x, layer, weights[0], chosen[0])
    else:
        out = _rows(store, x, layer, weights, chosen, moe.top_k)
    if "shared_w13" in w:  # Qwen2-MoE: an always-on expert, gated per token
        gate = torch.sigmoid(base.linear(x, w["shared_gate"]))
        out = out + gate * base.swiglu(x, w["shared_w13"], w["shared_w2"])
    return out.view(shape)


def _one_row(store, x, layer, weights, chosen) -> torch.Tensor:
    """One token (batch-1 decode): k experts in ascending order, no grouping; O(k) Python work and
    about six torch calls per expert (the scale rides on the accumulating add)."""
    ranked = sorted(zip(chosen.tolist(), weights.tolist()))
    with store.experts(layer, {e: 1 for e, _ in ranked}) as got:
        # In the store's order: an expert cache gives its cached experts first, which compute while
        # the cold ones are still being read; the sum below keeps the ascending order.
        ys = {e: _expert(got[e], x) for e in got}
    out = None
    for e, scale in ranked:
        out = ys[e] * scale if out is None else out.add_(ys[e], alpha=scale)
    return out


def _rows(store, x, layer, weights, chosen, top_k: int) -> torch.Tensor:
    """Several rows: each chosen expert runs once on all the rows that chose it."""
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    experts, counts = experts.tolist(), counts.tolist()
    rows = (order // top_k).split(counts)
    scales = weights.reshape(-1)[order].split(counts)
    out = torch.zeros_like(x)
    with store.experts(layer, dict(zip(experts, counts))) as got:
        for e, idx, s in zip(experts, rows, scales):
            out.index_add_(0, idx, _expert(got[e], x.index_select(0, idx)) * s[:, None])
    return out


def _expert(tensors, x: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on rows x, computed where its weights live (host compute) and returned here."""
    where = base.weight_device(tensors["ew13"])
    if where == x.device:
        return base.swiglu(x, tensors["ew13"], tensors["ew2"])
    return base.swiglu(x.to(where), tensors["ew13"], tensors["ew2"]).to(x.device)


def speculate(model, x: torch.Tensor, layer: int) -> None:
    """Guess the next layer's experts from this layer's input with the next layer's router (when its
    block is resident now) and ask the store to start reading them; a wrong guess costs only bandwidth."""
    following = layer + 1
    if following not in model.span.layers or not model.sparse[following]:
        return  # the next layer is another pipeline stage's (or there is none)
    peeked = model.store.peek(layer_block(following))
    if peeked is None:
        return
    guesses = base.linear(x, peeked["router"]).topk(model.config.moe.top_k, dim=-1).indices
    model.store.hint_experts(following, guesses.unique().tolist())
