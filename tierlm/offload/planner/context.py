"""One planning problem as the planner's modules share it: `_Context` (the model, its block sizes,
the profile, the bandwidths, the machine, and what a pipeline stage or an existing placement
adds), the residency unit `_Unit`, and a mixture-of-experts model's routed experts in the order
they fill the tiers (`_Experts`) with their split between the tiers (`_Split`).

Names with a leading underscore are the planner package's own: its modules import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from tierlm.blocks import expert_of, is_expert
from tierlm.config import ModelConfig
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.placement import DEVICE, DISK, HOST
from tierlm.offload.sizes import BlockSizes
from tierlm.profile import Profile



@dataclass(frozen=True)
class VariantCharge:
    """A LoRA variant served beside the base: its mode (merged or unmerged), the bytes it adds when
    held, `largest`: the bytes of its largest block, read per use into one slot when it is not held
    (0: `nbytes`), and `uses`: requests that named it (hotter variants are placed first)."""

    name: str
    mode: str
    nbytes: int
    largest: int = 0
    uses: int = 0

    @property
    def slot_bytes(self) -> int:
        return self.largest or self.nbytes

    @property
    def streams(self) -> bool:
        """Whether it can be read from disk per use: a merged variant has its artifact there."""
        return self.mode == "merged"


@dataclass(frozen=True)
class _Unit:
    """Blocks that become resident or cold together (a tied embedding and its head alias)."""

    blocks: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class _Context:
    config: ModelConfig
    sizes: BlockSizes
    profile: Profile
    bandwidths: Bandwidths | None  # None: fits only (no cost model), see check_fits
    accelerator: bool
    baseline: int
    routing: object = None  # RoutingCounts of an MoE model (None: uniform)
    shares: Mapping[str, float] | None = field(default=None, compare=False)  # per expert, instead of routing
    placed: Mapping[str, str] | None = field(default=None, compare=False)  # an existing placement's expert tiers
    variants: tuple[VariantCharge, ...] = ()  # LoRA variants, placed after the base (_place_variants)
    layers: range | None = None  # a pipeline stage's decoder layers (None: the whole model)
    kv_position: int = 0  # the positions a decode step attends over (0: the start of a conversation)

    @property
    def stage(self) -> range:
        """The decoder layers this process runs."""
        return range(self.config.num_hidden_layers) if self.layers is None else self.layers

    @property
    def samples(self) -> bool:
        """Whether this process holds a step's logits: the first stage samples (rank 0 owns the
        API) and the last computes them; a middle stage only passes hidden states on."""
        return self.stage.start == 0 or self.stage.stop == self.config.num_hidden_layers

    @property
    def separate_host(self) -> bool:
        return self.accelerator or self.profile.emulate_host_tier

    @cached_property
    def dense(self) -> tuple[str, ...]:
        """Every block but the routed experts, in execution order."""
        return tuple(name for name in self.sizes.names if not is_expert(name))

    @cached_property
    def experts(self) -> "_Experts | None":
        return _experts(self)

    @cached_property
    def memo(self) -> dict:
        """Expert terms by (split, tokens): the compute search prices one split many times."""
        return {}


@dataclass(frozen=True)
class _Experts:
    """An MoE model's routed experts as the planner places them.

    `order`: every expert block in the order they fill the device, then host RAM: hottest first
    (expected share of its layer's picks), ties by expert then layer, so that uniform counts
    spread the resident experts evenly over the layers. `share[block]`: that expected share.
    `layers`: sparse layer -> its expert blocks by index. Slots are sized for the largest expert.
    """

    order: tuple[str, ...]
    share: Mapping[str, float]
    layers: Mapping[int, tuple[str, ...]]
    top_k: int
    slot_bytes: int
    stream_slots: int
    prefix: tuple[int, ...]  # prefix[n]: stored bytes of the first n experts of `order`

    @property
    def count(self) -> int:
        return len(self.order)

    @property
    def stream_bytes(self) -> int:
        return self.stream_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.prefix[-1]


@dataclass(frozen=True)
class _Split:
    """Where the experts lie: the first `device` of `_Experts.order` resident, the next `host`
    in host RAM (computed there when `host_compute`), the rest on disk."""

    device: int = 0
    host: int = 0
    host_compute: bool = False

    def tier(self, index: int) -> str:
        return DEVICE if index < self.device else HOST if index < self.device + self.host else DISK

    def bytes_on(self, tier: str, experts: _Experts | None) -> int:
        if experts is None:
            return 0
        prefix, end = experts.prefix, experts.count
        device, host = min(self.device, end), min(self.device + self.host, end)
        return {DEVICE: prefix[device], HOST: prefix[host] - prefix[device], DISK: prefix[end] - prefix[host]}[tier]

    def on_disk(self, experts: _Experts) -> bool:
        return self.device + self.host < experts.count


def _experts(ctx: _Context) -> _Experts | None:
    """The routed experts of `ctx.sizes` (None for a dense model), with their expected shares."""
    layers: dict[int, dict[int, str]] = {}
    for name in ctx.sizes.names:
        where = expert_of(name)
        if where is not None:
            layers.setdefault(where[0], {})[where[1]] = name
    if not layers:
        return None
    share: dict[str, float] = {}
    for layer, blocks in layers.items():
        count = len(blocks)
        routing = ctx.routing
        known = routing is not None and routing.experts == count and layer in routing.layers
        shares = routing.share(layer) if known else [1.0 / count] * count
        for expert, block in blocks.items():
            share[block] = ctx.shares.get(block, 0.0) if ctx.shares is not None else shares[expert]
    rank = {DEVICE: 0, HOST: 1, DISK: 2}
    placed = ctx.placed or {}

    def key(block: str):
        layer, expert = expert_of(block)
        return rank.get(placed.get(block), 0), -share[block], expert, layer

    order = tuple(sorted(share, key=key))
    prefix = [0]
    for block in order:
        prefix.append(prefix[-1] + ctx.sizes.nbytes[block])
    moe = getattr(ctx.config, "moe", None)
    top_k = moe.top_k if moe is not None else 1
    # top_k misses of one layer in flight, and with prefetch the next layer's reads beside them.
    stream_slots = top_k * (2 if ctx.profile.prefetch_depth >= 1 else 1)
    return _Experts(
        order=order,
        share=share,
        layers={layer: tuple(blocks[e] for e in sorted(blocks)) for layer, blocks in sorted(layers.items())},
        top_k=top_k,
        slot_bytes=max(ctx.sizes.nbytes[b] for b in order),
        stream_slots=stream_slots,
        prefix=tuple(prefix),
    )
