"""A Placement: where every weight block lives, what each tier is charged, what speed to expect.

The planner produces it (a pure function of sizes, profile and bandwidths); the tiered store
obeys it; the ledger compares its planned bytes with measured ones. `placement_to_dict` is its
JSON form (`tierlm plan --json`); the human text is cli/plan_view.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class BlockPlacement:
    """One block: its home tier, its bytes there, and where it is computed.

    tier   device: resident on the compute device, loaded once.
           host:   kept in host RAM; streamed to the device through the ring (compute "device")
                   or computed where it lies (compute "host", llama.cpp-style partial offload).
           disk:   read from the artifact file through the ring every time it is used.
    """

    name: str
    tier: str
    nbytes: int
    compute: str = DEVICE

    @property
    def streamed(self) -> bool:
        return self.tier == DISK or (self.tier == HOST and self.compute == DEVICE)


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer's routed experts as planned.

    `hit_rate`: expected share of the router's picks landing on the resident experts (the
    routing counts' shares summed over them). `bytes_per_token[tier]`: expected expert bytes one
    token reads from each tier (top_k x the tier's share of picks x an expert's bytes).
    `host_computed`: cold experts the CPU computes where they lie (accelerator with a host tier).
    """

    layer: int
    experts: int
    resident: int
    hit_rate: float
    bytes_per_token: Mapping[str, float]
    host_computed: int = 0


@dataclass(frozen=True)
class FigureSource:
    """One figure a decode prediction rests on and the measurement it comes from: `label` ("RAM",
    "disk", ...), the probe figure's `name` and the `value` used for the step's `path`; `source`
    and `at`: the measured run that corrected it for that path (None: the probe's own)."""

    label: str
    name: str
    value: float
    path: str
    source: str | None = None
    at: float | None = None


@dataclass(frozen=True)
class VariantPlacement:
    """A LoRA variant served beside the base (store/variants.py): its mode, the bytes it adds
    when held, and its tier. device: held where it computes; host: held in host RAM, copied to
    the device per use; disk: its changed tensors read from its variant artifact per use."""

    name: str
    mode: str
    nbytes: int
    tier: str


@dataclass(frozen=True)
class Placement:
    """The planner's answer for one model under one profile.

    `charges[tier][item]`: planned bytes per tier, itemised (baseline, weights, kv_cache,
    workspace, staging, hot_cache; for MoE models experts, expert_stream). `budgets[tier]`: what
    the profile grants (None = unbounded, e.g. disk). Streamed blocks pass through `ring_slots`
    buffers of `ring_slot_bytes` each; routed experts never do (they have their own slots).

    Mixture-of-experts models: `expert_slots` experts of up to `expert_slot_bytes` each may be on
    the device at once (initially the resident ones, the hottest by routing counts; the expert
    cache swaps within them), and cold experts are read through `expert_stream_slots` slots of
    the same size (>= top_k). `expert_layers`: per sparse layer, the expected hit rate and bytes.
    """

    blocks: tuple[BlockPlacement, ...]
    budgets: Mapping[str, int | None]
    charges: Mapping[str, Mapping[str, int]]
    ring_slots: int = 0
    ring_slot_bytes: int = 0
    hot_cache_bytes: int = 0
    predicted_prefill_tokens_per_s: float = 0.0
    predicted_decode_tokens_per_s: float = 0.0  # at the start of a conversation
    predicted_decode_full_context_tokens_per_s: float = 0.0  # every sequence at its last position
    binding_limit: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    expert_slots: int = 0
    expert_stream_slots: int = 0
    expert_slot_bytes: int = 0
    expert_layers: tuple[ExpertLayer, ...] = ()
    variants: tuple[VariantPlacement, ...] = ()  # LoRA variants beside the base, in the order given
    # A mixed mode's choice: (mode, weights in it) most first; empty for a single mode.
    weight_modes: tuple[tuple[str, int], ...] = ()
    weight_mode_bytes: tuple[tuple[str, int], ...] = ()  # the same modes' stored bytes, same order
    # The largest mixed:SIZE (bytes) that would hold every block on the device; 0: not asked.
    resident_mixed_bytes: int = 0
    # The figures the decode prediction rests on, the binding limit's first, with their sources.
    decode_sources: tuple[FigureSource, ...] = ()
    # (KV format, tokens): the most context per sequence the device budget holds beside these
    # weights in each format (planner/context_room.py); empty: not computed.
    context_room: tuple[tuple[str, int], ...] = ()
    context_limit: int = 0  # the model's most positions (max_position_embeddings), the room's cap

    def block(self, name: str) -> BlockPlacement:
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> dict[str, BlockPlacement]:
        # An MoE model has thousands of expert blocks: look them up by name, not by scanning.
        return {placed.name: placed for placed in self.blocks}

    def tier_of(self, name: str) -> str:
        return self.block(name).tier

    def total(self, tier: str) -> int:
        return sum(self.charges.get(tier, {}).values())

    def block_bytes_by_tier(self) -> dict[str, int]:
        """Weight bytes of the blocks placed on each tier, in first-seen order."""
        totals: dict[str, int] = {}
        for placed in self.blocks:
            totals[placed.tier] = totals.get(placed.tier, 0) + placed.nbytes
        return totals

    @property
    def streamed_blocks(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks if b.streamed)

    @property
    def fully_resident(self) -> bool:
        return all(b.tier == DEVICE for b in self.blocks)


def placement_to_dict(placement: Placement) -> dict:
    """The Placement as plain JSON-able data (`tierlm plan --json`)."""
    return {
        "blocks": [
            {"name": b.name, "tier": b.tier, "nbytes": b.nbytes, "compute": b.compute, "streamed": b.streamed}
            for b in placement.blocks
        ],
        "budgets": dict(placement.budgets),
        "charges": {tier: dict(items) for tier, items in placement.charges.items()},
        "totals": {tier: placement.total(tier) for tier in placement.charges},
        "ring_slots": placement.ring_slots,
        "ring_slot_bytes": placement.ring_slot_bytes,
        "hot_cache_bytes": placement.hot_cache_bytes,
        "predicted_prefill_tokens_per_s": placement.predicted_prefill_tokens_per_s,
        "predicted_decode_tokens_per_s": placement.predicted_decode_tokens_per_s,
        "predicted_decode_full_context_tokens_per_s": placement.predicted_decode_full_context_tokens_per_s,
        "binding_limit": placement.binding_limit,
        "notes": list(placement.notes),
        "expert_slots": placement.expert_slots,
        "expert_stream_slots": placement.expert_stream_slots,
        "expert_slot_bytes": placement.expert_slot_bytes,
        "expert_layers": [
            {"layer": x.layer, "experts": x.experts, "resident": x.resident, "hit_rate": x.hit_rate,
             "bytes_per_token": dict(x.bytes_per_token), "host_computed": x.host_computed}
            for x in placement.expert_layers
        ],
        "variants": [{"name": v.name, "mode": v.mode, "nbytes": v.nbytes, "tier": v.tier} for v in placement.variants],
        "weights_bytes": sum(b.nbytes for b in placement.blocks),
        "weight_modes": dict(placement.weight_modes),
        "weight_mode_bytes": dict(placement.weight_mode_bytes),
        "resident_mixed_bytes": placement.resident_mixed_bytes,
        "decode_sources": [vars(f) for f in placement.decode_sources],
        "context_room": dict(placement.context_room),
        "context_limit": placement.context_limit,
    }
