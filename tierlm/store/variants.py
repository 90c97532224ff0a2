"""LoRA variants at run time: one base store, several fine-tunes, a variant chosen per batch row.

A `VariantStore` wraps the base store (resident or tiered) and holds each variant as an
`Overlay`: the tensors the variant changes, either merged (decoded exactly as a `--lora`
conversion stores them) or unmerged (low-rank factors added to the base's output, S-LoRA style).
Before each forward the caller names every batch row's variant with `select`; `acquire` hands
the model the base tensors, with each tensor a selected variant changes made a `RowSwitched`
weight. Its `.linear(x, bias)` (which `models.base.linear` calls) runs the base weight once on
the rows that use it, each merged variant's weight on its own rows, and adds x·Aᵀ·Bᵀ on the
rows of an unmerged variant. A batch of one merged variant gets its tensors directly, so the
fused CPU decode keeps running; device graphs (models/graph_decode.py) replay only the base.

Each overlay lies on the tier the planner gave it (offload/planner/variants.py): `device`,
held where it computes; `host`, held in host RAM and copied over per use; `disk` (merged only),
nothing held: a block's changed tensors are read from the variant artifact when a forward
acquires it and freed with that forward, so a rarely used variant costs one block's bytes.
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from tierlm.blocks import EMBED, expert_block, is_expert
from tierlm.cache import codec
from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, ensure_variant_artifact
from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter
from tierlm.lora.merge import LoraMerger
from tierlm.models import family_description, read_config
from tierlm.models.base import embed, linear
from tierlm.store.calibration import activation_stats
from tierlm.weights.checkpoint import open_checkpoint
from tierlm.weights.store import WeightStore

MERGED, UNMERGED = "merged", "unmerged"
DEVICE, HOST, DISK = "device", "host", "disk"  # as offload/placement.py names the tiers
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Cost model defaults, a desktop CPU's order of magnitude: memory read and fp32 matmul rates.
# Callers with measured figures (runtime/machine_probe) pass their own.
DEFAULT_BANDWIDTH = 20e9  # bytes/s
DEFAULT_FLOPS = 200e9  # flop/s
DEFAULT_ROWS = 4  # rows of one variant in a mixed decode step


@dataclass(frozen=True, eq=False)
class LowRank:
    """A low-rank change to a weight [out, in]: ΔW = B @ A with A [R, in], B [out, R] (scale folded
    in). A fused tensor (wqkv, w13) concatenates its sources' ranks: B is block-diagonal, each
    source's rows reading only its own ranks."""

    A: torch.Tensor
    B: torch.Tensor

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ ΔWᵀ [..., out]."""
        # As 2-D GEMMs: a batched 3-D matmul against a transposed view runs ~8x slower on CPU.
        flat = x.reshape(-1, x.shape[-1])
        return F.linear(F.linear(flat, self.A), self.B).view(*x.shape[:-1], self.B.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of ΔW (an embedding's change) -> [..., in]."""
        return self.B[ids] @ self.A

    @property
    def nbytes(self) -> int:
        return self.A.nbytes + self.B.nbytes


@dataclass(frozen=True)
class Stored:
    """A changed tensor of a variant on disk (not held): what it takes once decoded."""

    nbytes: int
    ndim: int


@dataclass(frozen=True, eq=False)
class Overlay:
    """One variant's changes over the base, per block: {canonical tensor: weight} when merged
    (decoded as the base store decodes), {canonical tensor: LowRank} when unmerged.

    `biases` maps a changed bias to the weight it is added with (bqkv -> wqkv), so a mixed batch
    switches the pair together; `why` says why this mode was chosen; `nbytes` is what it holds
    when held (`held_bytes`: what it holds now). `tier` is where the changes lie (see the module
    docstring; on disk they are `Stored` stand-ins and `source` reads them), `device` where they
    compute. `block` gives a block's changes ready to compute with; `placed` moves the overlay.
    """

    mode: str
    changes: Mapping[str, Mapping[str, object]]
    why: str = ""
    biases: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    tier: str = DEVICE
    source: "_VariantReader | None" = None  # merged: the variant artifact its changes come from
    device: torch.device | None = None  # None: where the changes are

    def block(self, name: str) -> Mapping[str, object]:
        """Block `name`'s changes on the compute device: held ones as they are, host ones copied
        over, disk ones read and decoded now (freed with the forward that holds them)."""
        if self.tier == DISK:
            return self.source.read(name)
        changes = self.changes[name]
        if self.tier == HOST and self.device is not None and self.device.type != "cpu":
            return {tensor: _moved(weight, self.device) for tensor, weight in changes.items()}
        return changes

    def placed(self, tier: str) -> "Overlay":
        """This overlay with its changes on `tier` (read from the variant artifact for a held merged
        one; an unmerged one's factors have no copy on disk: device or host only)."""
        if tier == self.tier:
            return self
        device = self.device or torch.device("cpu")
        where = device if tier == DEVICE else torch.device("cpu")
        if self.mode == UNMERGED:
            if tier == DISK:
                raise ValueError("an unmerged variant's factors have no copy on disk")
            changes = {b: {t: _moved(w, where) for t, w in tensors.items()} for b, tensors in self.changes.items()}
        else:
            changes = self.source.stand_ins() if tier == DISK else self.source.read_all(where)
        return replace(self, changes=changes, tier=tier)

    @property
    def largest(self) -> int:
        """The bytes of its largest block's changes: what one use reads when it is not held."""
        return max((sum(_nbytes(t) for t in {id(t): t for t in tensors.values()}.values())
                    for tensors in self.changes.values()), default=0)  # fmt: skip

    @property
    def held_bytes(self) -> int:
        return 0 if self.tier == DISK else self.nbytes

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    @property
    def mixes(self) -> bool:
        """Whether rows of this variant may share a batch with other rows: not when it changes a
        routed expert (its tokens are not batch rows) or a norm (no per-row form)."""
        return not any(
            is_expert(block) or (_is_vector(t) and name not in self.biases.get(block, {}))
            for block, tensors in self.changes.items() for name, t in tensors.items()
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        unique = {id(t): t for tensors in self.changes.values() for t in tensors.values()}
        return sum(_nbytes(t) for t in unique.values())


class RowSwitched:
    """A weight that differs per batch row (dim 0 of x): the base weight, merged variants' weights
    on their rows, and low-rank deltas on the rows of unmerged variants.

    base: the base weight (tensor or quantized); base_rows: the rows computed on it (None: all);
    merged: [(rows, weight, bias or None: the caller's)]; low_rank: [(rows or None: all, LowRank)].
    """

    def __init__(self, base, base_rows, merged, low_rank, batch: int | None):
        self.base, self.base_rows, self.merged, self.low_rank = base, base_rows, merged, low_rank
        self.batch = batch

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def device(self) -> torch.device:
        return self.base.device

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, ..., in] -> [B, ..., out]; row b computed with row b's variant."""
        self._check(x)
        if not self.merged:
            out = linear(x, self.base, bias)
        else:
            out = x.new_empty(*x.shape[:-1], self.base.shape[0])
            if self.base_rows.numel():
                out.index_copy_(0, self.base_rows, linear(x.index_select(0, self.base_rows), self.base, bias))
            for rows, weight, own_bias in self.merged:
                out.index_copy_(0, rows, linear(x.index_select(0, rows), weight, bias if own_bias is None else own_bias))
        for rows, change in self.low_rank:
            if rows is None:
                out = out + change.delta(x).to(out.dtype)
            else:
                out.index_add_(0, rows, change.delta(x.index_select(0, rows)).to(out.dtype))
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding rows for ids [B, T] -> [B, T, in]; row b's from row b's variant."""
        self._check(ids)
        out = embed(self.base, ids)
        if dtype is not None:
            out = out.to(dtype)
        for rows, weight, _ in self.merged:
            out.index_copy_(0, rows, embed(weight, ids.index_select(0, rows)).to(out.dtype))
        for rows, change in self.low_rank:
            picked = ids if rows is None else ids.index_select(0, rows)
            delta = change.rows(picked).to(out.dtype)
            out = out + delta if rows is None else out.index_add_(0, rows, delta)
        return out

    def _check(self, x: torch.Tensor) -> None:
        if self.batch is not None and x.shape[0] != self.batch:
            raise ValueError(f"select() named {self.batch} rows, the forward has {x.shape[0]}")


@dataclass(frozen=True, eq=False)
class _Selection:
    """`select`'s rows: each named variant's overlay and the rows (a long tensor) that use it."""

    batch: int
    groups: tuple[tuple[str, Overlay, torch.Tensor], ...]
    uniform: bool  # every row uses the one variant in `groups`
    # merged variants' names -> the rows left on the base weight (the same for every layer's tensors)
    base_rows: dict = field(default_factory=dict)

    def rows_without(self, merged: tuple[tuple[str, torch.Tensor], ...]) -> torch.Tensor:
        key = tuple(name for name, _ in merged)
        if key not in self.base_rows:
            taken = torch.cat([rows for _, rows in merged])
            keep = torch.ones(self.batch, dtype=torch.bool, device=taken.device)
            keep[taken] = False
            self.base_rows[key] = keep.nonzero().flatten()
        return self.base_rows[key]


class VariantStore(WeightStore):
    """The base store plus variants {name: Overlay}, chosen per batch row by `select`.

    `add` / `remove` may run on another thread than the forward: a forward keeps the overlays of
    the selection it started with, so a variant removed meanwhile finishes the step it is in.
    """

    def __init__(self, base: WeightStore, variants: Mapping[str, Overlay] | None = None, *, device="cpu"):
        self.base = base
        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._variants: dict[str, Overlay] = {}
        self._selection: _Selection | None = None
        for name, overlay in (variants or {}).items():
            self.add(name, overlay)

    # -- the set of variants ------------------------------------------------------------------

    def add(self, name: str, overlay: Overlay) -> None:
        """Serve `overlay` as `name`; a name in use is a TierlmError."""
        if not NAME_PATTERN.fullmatch(name):
            raise TierlmError(f"variant name {name!r} is not usable",
                              "use letters, digits, '.', '_' or '-' (up to 64, starting with a letter or digit)")  # fmt: skip
        with self._lock:
            if name in self._variants:
                raise TierlmError(f"variant {name!r} exists already", "remove it first or pick another name")
            self._variants[name] = overlay

    def remove(self, name: str) -> Overlay:
        """Stop serving `name`; returns its overlay. An unknown name is a TierlmError."""
        with self._lock:
            if name not in self._variants:
                raise TierlmError(f"no variant named {name!r}")
            return self._variants.pop(name)

    def replace(self, name: str, overlay: Overlay) -> None:
        """Serve `name` with `overlay` (the same variant on another tier) from the next forward on."""
        with self._lock:
            if name not in self._variants:
                raise TierlmError(f"no variant named {name!r}")
            self._variants[name] = overlay

    def names(self) -> list[str]:
        with self._lock:
            return list(self._variants)

    def overlay(self, name: str) -> Overlay:
        with self._lock:
            return self._variants[name]

    def select(self, rows: Sequence[str | None]) -> None:
        """Name each batch row's variant (None: the base) for the next forward."""
        by_name: dict[str, list[int]] = {}
        for row, name in enumerate(rows):
            if name is not None:
                by_name.setdefault(name, []).append(row)
        with self._lock:
            missing = [name for name in by_name if name not in self._variants]
            if missing:
                raise TierlmError(f"no variant named {missing[0]!r}", f"served: {', '.join(self._variants) or 'none'}")
            groups = tuple(
                (name, self._variants[name], torch.tensor(picked, dtype=torch.long, device=self.device))
                for name, picked in by_name.items()
            )
            uniform = len(groups) == 1 and len(groups[0][2]) == len(rows)
            self._selection = _Selection(len(rows), groups, uniform) if groups else None

    @property
    def switched(self) -> bool:
        """Whether the next forward uses any variant's weights (device graphs replay only the base's)."""
        return self._selection is not None

    # -- the weight-store contract ---------------------------------------------------------------

    def acquire(self, block: str) -> Mapping[str, object]:
        tensors = self.base.acquire(block)
        try:
            return self._switch_block(block, tensors, self._selection)
        except BaseException:
            self.base.release(block)
            raise

    def release(self, block: str) -> None:
        self.base.release(block)

    @contextmanager
    def experts(self, layer: int, uses: Mapping[int, int]) -> Iterator[Mapping[int, Mapping[str, object]]]:
        selection = self._selection
        with self.base.experts(layer, uses) as got:
            yield _SwitchedExperts(got, lambda e, t: self._switch_block(expert_block(layer, e), t, selection, rows_known=False))

    def peek(self, block: str):
        return self.base.peek(block)

    def resident_block(self, block: str):
        # A selected variant may change the block: only the base's own weights are passed through.
        return self.base.resident_block(block) if self._selection is None else None

    def hint_experts(self, layer: int, experts: Sequence[int]) -> None:
        self.base.hint_experts(layer, experts)

    @property
    def speculates(self) -> bool:  # type: ignore[override]
        return self.base.speculates

    @property
    def placement(self):
        """The base store's placement (None for a resident one)."""
        return getattr(self.base, "placement", None)

    def block_names(self) -> list[str]:
        return self.base.block_names()

    def nbytes(self) -> int:
        """The base's bytes plus each variant's own that it holds (not those read from disk per use)."""
        with self._lock:
            overlays = list(self._variants.values())
        return self.base.nbytes() + sum(o.held_bytes for o in overlays)

    def note_forward(self, tokens: int) -> None:
        self.base.note_forward(tokens)

    def stats(self):
        return self.base.stats()

    def close(self) -> None:
        with self._lock:
            overlays = list(self._variants.values())
        for overlay in overlays:
            overlay.close()
        self.base.close()

    # -- switching ---------------------------------------------------------------------------------

    def _switch_block(self, block, tensors, selection: _Selection | None, rows_known: bool = True):
        """`tensors` with each tensor a selected variant changes replaced (see the module docstring)."""
        if selection is None:
            return tensors
        touching = [(name, o, rows) for name, o, rows in selection.groups if block in o.changes]
        if not touching:
            return tensors
        if not selection.uniform and not rows_known:
            raise TierlmError(
                f"variants {', '.join(n for n, _, _ in touching)} change {block}, whose tokens are routed, "
                "and the batch mixes variants", "run this variant's requests in batches of their own")  # fmt: skip
        # Each overlay's changes of this block, read once (from disk, for a variant not held).
        touching = [(name, o, rows, o.block(block)) for name, o, rows in touching]
        if selection.uniform and touching[0][1].mode == MERGED:
            return {**tensors, **touching[0][3]}
        out = dict(tensors)
        for tensor in _switched_weights(block, touching):
            out[tensor] = self._row_switched(block, tensor, tensors, touching, selection)
        return out

    def _row_switched(self, block, tensor, tensors, touching, selection: _Selection) -> RowSwitched:
        everyone = selection.uniform
        merged, low_rank, merged_rows = [], [], []
        for name, overlay, rows, changes in touching:
            bias = next((b for b, w in overlay.biases.get(block, {}).items() if w == tensor), None)
            if overlay.mode == MERGED:
                weight = changes.get(tensor, tensors[tensor])
                merged.append((rows, weight, changes.get(bias) if bias else None))
                merged_rows.append((name, rows))
            elif tensor in changes:
                low_rank.append((None if everyone else rows, changes[tensor]))
        base_rows = selection.rows_without(tuple(merged_rows)) if merged else None
        return RowSwitched(tensors[tensor], base_rows, merged, low_rank, None if everyone else selection.batch)


def _switched_weights(block: str, touching) -> list[str]:
    """The weights the selected overlays change in `block` (a changed bias switches its weight);
    a changed norm cannot switch per row: a mixed batch refuses it."""
    names: list[str] = []
    for name, overlay, _, changes in touching:
        biases = overlay.biases.get(block, {})
        for tensor, change in changes.items():
            target = biases.get(tensor)
            if target is None and _is_vector(change):
                raise TierlmError(f"variant {name!r} changes {block}.{tensor}, which cannot differ per row",
                                  "run this variant's requests in batches of their own")  # fmt: skip
            target = target or tensor
            if target not in names:
                names.append(target)
    return names


def _is_vector(weight) -> bool:
    if isinstance(weight, Stored):
        return weight.ndim == 1
    return isinstance(weight, torch.Tensor) and weight.dim() == 1


def _moved(weight, device: torch.device):
    """A held change on `device` (a no-op where it is already)."""
    if isinstance(weight, LowRank):
        return LowRank(weight.A.to(device), weight.B.to(device))
    return weight.to(device)


def _nbytes(weight) -> int:
    nbytes = weight.nbytes
    return nbytes() if callable(nbytes) else int(nbytes)


# -- choosing and building overlays --------------------------------------------------------------


@dataclass(frozen=True)
class VariantCost:
    """What serving a variant each way costs. merged_bytes: its changed tensors as the base stores
    them; factor_bytes: the low-rank factors (None: the change is not low rank, `not_low_rank`
    says why); flops_per_row: 2·Σ R·(in + out), the unmerged delta's work per token row."""

    merged_bytes: int
    factor_bytes: int | None
    flops_per_row: int = 0
    not_low_rank: str = ""


def choose_mode(
    cost: VariantCost,
    requested: str | None = None,
    *,
    bandwidth: float = DEFAULT_BANDWIDTH,
    flops: float = DEFAULT_FLOPS,
    rows: int = DEFAULT_ROWS,
) -> tuple[str, str]:
    """(mode, why) for one variant.

    Not low rank -> merged. Otherwise, in a decode step that mixes variants the base weights are
    read for the other rows anyway, so a merged variant costs an extra read of its changed
    weights (merged_bytes / bandwidth), an unmerged one reads its factors and does the low-rank
    work for its `rows` (factor_bytes / bandwidth + rows · flops_per_row / flops). Unmerged is
    chosen when it holds fewer bytes and costs less time; `requested` overrides where possible.
    (A batch of one merged variant costs nothing extra; unmerged layers leave the fused CPU decode.)
    """
    if cost.factor_bytes is None:
        return MERGED, f"merged: {cost.not_low_rank}, so it cannot be added unmerged"
    t_merged = cost.merged_bytes / bandwidth
    t_unmerged = cost.factor_bytes / bandwidth + rows * cost.flops_per_row / flops
    figures = (
        f"merged weights {_mib(cost.merged_bytes)} and ~{t_merged * 1e3:.2f} ms extra per mixed decode step, "
        f"low-rank factors {_mib(cost.factor_bytes)} and ~{t_unmerged * 1e3:.2f} ms for {rows} rows"
    )
    if requested in (MERGED, UNMERGED):
        return requested, f"{requested}: as asked ({figures})"
    if cost.factor_bytes < cost.merged_bytes and t_unmerged < t_merged:
        # Said because a quantized base makes it visible: the rows are close to --lora's, not bit-equal.
        return UNMERGED, f"unmerged: less memory and time ({figures}); rows add the delta to the base weights, not requantized"
    return MERGED, f"merged: unmerged saves no {'memory' if cost.factor_bytes >= cost.merged_bytes else 'time'} ({figures})"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def overlay_for(
    base_artifact: Path,
    adapters: Sequence[tuple[Path, float]],
    mode: str | None = None,
    *,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    progress=None,
    hold: bool = True,
    **cost_model,
) -> Overlay:
    """The overlay of `adapters` [(adapter dir, weight)] over the base artifact `base_artifact`,
    merged or unmerged as `choose_mode` decides (`mode` asks for one; `cost_model`: its keyword
    figures). Merged tensors are decoded for `device`/`dtype` as the base store decodes them, so a
    row of the variant computes exactly what a `--lora` artifact would. A wrong adapter raises
    before anything is converted. `hold` False: a merged overlay is returned on disk, holding
    nothing (sized block by block), for the caller to place (`Overlay.placed`); unmerged factors
    are held on `device` either way.
    """
    base = Artifact.open(Path(base_artifact))
    try:
        manifest = dict(base.manifest)
        records = {block: dict(record.tensors) for block, record in base.blocks.items()}
    finally:
        base.close()
    model_dir = Path(manifest["source"])
    base_adapters = tuple((Path(p), float(w)) for p, w in manifest.get("adapters") or ())
    config = read_config(model_dir)
    layout = family_description(config).checkpoint_layout(config)
    merger = LoraMerger([(LoraAdapter.load(Path(p)), w) for p, w in adapters])
    checkpoint = open_checkpoint(model_dir)
    merger.validate(checkpoint, tied=config.tie_word_embeddings)
    touched = merger.touched_names()
    changed = {
        block: {name: sources for name, sources in entries.items() if touched.intersection(sources)}
        for block, entries in layout.items()
    }
    changed = {block: names for block, names in changed.items() if names}
    biases = _bias_pairs(layout, changed)

    heights = {s: int(checkpoint.entry(s).shape[0]) for names in changed.values() for sources in names.values() for s in sources}
    factors, cost = _factors(merger, changed, records, heights, device, dtype)
    chosen, why = choose_mode(cost, mode, **cost_model)
    device = torch.device(device)
    if chosen == UNMERGED:
        return Overlay(UNMERGED, factors, why, {}, device=device)
    reader = _merged_reader(model_dir, base_adapters + tuple(adapters), manifest["quant"], changed, device, dtype, progress)
    cold = Overlay(MERGED, reader.stand_ins(), why, biases, tier=DISK, source=reader, device=device)
    return cold.placed(DEVICE) if hold else cold


def _bias_pairs(layout, changed) -> dict[str, dict[str, str]]:
    """{block: {changed bias: its weight}}: the weight whose sources are the bias's with .weight."""
    pairs: dict[str, dict[str, str]] = {}
    for block, names in changed.items():
        by_sources = {sources: name for name, sources in layout[block].items()}
        for name, sources in names.items():
            if all(s.endswith(".bias") for s in sources):
                weight = by_sources.get(tuple(s.removesuffix(".bias") + ".weight" for s in sources))
                if weight is not None:
                    pairs.setdefault(block, {})[name] = weight
    return pairs


def _factors(merger, changed, records, heights, device, dtype) -> tuple[dict, VariantCost]:
    """Each changed tensor's LowRank (its sources' terms concatenated, B block-diagonal) and the
    variant's cost; factors are {} when some change is not low rank."""
    merged_bytes = sum(
        sum(part.nbytes for part in records[block][name].parts.values())
        for block, names in changed.items() for name in names if name in records[block]
    )  # fmt: skip
    factors: dict[str, dict[str, LowRank]] = {}
    factor_bytes = flops = 0
    for block, names in changed.items():
        for name, sources in names.items():
            why = "it changes the embedding's rows" if block == EMBED else None
            terms = None if why else [merger.low_rank(s) for s in sources]
            if why or any(t is None for t in terms):
                why = why or f"it changes {block}.{name} other than by plain LoRA (DoRA, modules_to_save, a bias, ...)"
                return {}, VariantCost(merged_bytes, None, 0, why)
            change = _concatenated(terms, [heights[s] for s in sources], device, dtype)
            factors.setdefault(block, {})[name] = change
            factor_bytes += change.nbytes
            flops += 2 * change.A.shape[0] * (change.A.shape[1] + change.B.shape[0])
    return factors, VariantCost(merged_bytes, factor_bytes, flops)


def _concatenated(terms, heights, device, dtype) -> LowRank:
    """Per-source terms (each source `heights[i]` rows of the fused tensor) -> one LowRank."""
    a_parts = [A for source_terms in terms for A, _ in source_terms]
    rank = sum(A.shape[0] for A in a_parts)
    B = torch.zeros(sum(heights), rank)
    row = col = 0
    for height, source_terms in zip(heights, terms):
        for A, b in source_terms:
            B[row : row + height, col : col + A.shape[0]] = b
            col += A.shape[0]
        row += height
    A = torch.cat(a_parts)  # a changed tensor has at least one term
    return LowRank(A.to(device=device, dtype=dtype).contiguous(), B.to(device=device, dtype=dtype).contiguous())


def _merged_reader(model_dir, adapters, quant, changed, device, dtype, progress) -> "_VariantReader":
    """A reader of the changed tensors in the variant artifact of `adapters` (all of them, over the
    checkpoint) in the base's quant mode: exactly what the full `--lora` conversion stores."""
    directory = ensure_variant_artifact(ConversionRequest(model_dir, (), quant), tuple(adapters), progress, activation_stats)
    return _VariantReader(Path(directory), changed, torch.device(device), dtype)


class _VariantReader:
    """A merged variant's changed tensors, decoded from its artifact as the base store decodes
    them: per block on each use (`read`), all at once to hold them (`read_all`), or only their
    sizes (`stand_ins`). The artifact is opened on first read and again after `close`."""

    def __init__(self, directory: Path, changed: Mapping[str, Sequence[str]], device: torch.device, dtype):
        self.directory, self.changed, self.device, self.dtype = directory, changed, device, dtype
        self._lock = threading.Lock()
        self._artifact = None

    def read(self, block: str, device: torch.device | None = None) -> dict[str, object]:
        """Block `block`'s changed tensors on `device` (default: the compute device)."""
        return self._decoded([block], device or self.device, copy=False)[block]

    def read_all(self, device: torch.device) -> dict[str, dict[str, object]]:
        """Every changed tensor on `device`, each decoded once (a tied head is the embedding's)."""
        return self._decoded(list(self.changed), device, copy=True)

    def stand_ins(self) -> dict[str, dict[str, Stored]]:
        """Every changed tensor's decoded size, decoded one block at a time and dropped (a tied
        head's stand-in is the embedding's, as it is one tensor when held)."""
        out: dict[str, dict[str, Stored]] = {}
        seen: dict[tuple[str, str], Stored] = {}
        for block in self.changed:
            with self._lock:
                aliases = self._opened().blocks[block].alias_targets()
            decoded = self.read(block, torch.device("cpu"))
            for name, weight in decoded.items():
                source = aliases.get(name, (block, name))
                if source not in seen:
                    seen[source] = Stored(_nbytes(weight), 1 if _is_vector(weight) else 2)
                out.setdefault(block, {})[name] = seen[source]
            del decoded
        return out

    def close(self) -> None:
        with self._lock:  # not while a read is under way; a later read opens it again
            if self._artifact is not None:
                self._artifact.close()
            self._artifact = None

    def _opened(self):
        """The open artifact (call with the lock held)."""
        if self._artifact is None:
            self._artifact = Artifact.open(self.directory)
        return self._artifact

    def _decoded(self, blocks, device: torch.device, copy: bool) -> dict[str, dict[str, object]]:
        read: dict[str, dict] = {}
        decoded: dict[tuple[str, str], object] = {}
        out: dict[str, dict[str, object]] = {}
        with self._lock:
            artifact = self._opened()
            for block in blocks:
                aliases = artifact.blocks[block].alias_targets()
                for name in self.changed[block]:
                    source = aliases.get(name, (block, name))
                    if source not in decoded:
                        if source[0] not in read:
                            read[source[0]] = artifact.read_stored(source[0])
                        record, parts = read[source[0]][source[1]]
                        # Held: copies, as a view would keep the whole block's buffer alive.
                        parts = {part: view.clone() for part, view in parts.items()} if copy else parts
                        decoded[source] = codec.decode(record, parts, device=device, dtype=self.dtype)
                    out.setdefault(block, {})[name] = decoded[source]
        return out


class _SwitchedExperts(Mapping):
    """The base store's experts of one layer, each switched to the selected variant when the model
    takes it (an expert sees the tokens that chose it, not batch rows: only a whole batch switches).
    Lazily: a streamed expert's tensors are views of a slot the cache refills once the model has
    moved on, so taking every expert up front would hand out bytes that are no longer its own."""

    def __init__(self, got: Mapping, switch: Callable):
        self._got, self._switch = got, switch

    def __getitem__(self, expert: int):
        return self._switch(expert, self._got[expert])

    def __iter__(self):
        return iter(self._got)

    def __len__(self) -> int:
        return len(self._got)
