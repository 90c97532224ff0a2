"""Merging LoRA adapters into base weights one tensor at a time, in fp32.

The conversion pipeline reads one base tensor, asks `LoraMerger.merge` for the merged fp32
tensor and quantizes it, so the model is never held in float as a whole.

Semantics (peft 0.21's `merge_and_unload` is the reference):

- One adapter with weight 1 gives exactly peft's merge of that adapter, computed in fp32:
  W + s·B@A (Linear), W + s·(B@A)ᵀ (Embedding), b + s·lora_B.bias (lora_bias), DoRA's
  m / ‖W + s·B@A‖ · (W + s·B@A) with the norm per output row (per embedding column), and a
  modules_to_save copy in place of W. Base tensors peft saved with the adapter
  (`base_layer.*`) replace the base tensor before the LoRA delta is added, as peft loads them.
  fan_in_fan_out is ignored: tierlm's families use nn.Linear, for which peft resets it to False.
  (peft on a bf16 model rounds to bf16 after each step; tierlm stays in fp32 until quantizing.)
- Mixture-of-experts: LoRA on fused expert parameters (peft's target_parameters on transformers 5)
  is sliced per expert onto the checkpoint's per-expert tensors (tierlm.lora.expert_slices), so each
  expert merges, and later quantizes, on its own; per-expert Linear LoRA needs nothing special.
- Several adapters, each with a user weight wᵢ: W' = W + Σ wᵢ·(Mᵢ(W) − W), where Mᵢ is peft's
  merge of adapter i alone. For plain LoRA wᵢ scales the delta (the same as scaling its alpha);
  for DoRA it scales DoRA's whole change to W (not peft's `set_scale`, which would also move the
  norm); for a modules_to_save copy R it interpolates, W + wᵢ·(R − W). The sum does not depend
  on the adapters' order. (peft merging several DoRA adapters into one model in turn is order
  dependent and is not reproduced.) Two adapters that both replace one tensor whole are refused.
- Tied embeddings (tie_word_embeddings: the head reads `model.embed_tokens.weight`, and the
  checkpoint may lack `lm_head.weight`). peft merges into the shared tensor in place, so LoRA on
  `lm_head` and on `embed_tokens` both land on `model.embed_tokens.weight`, embedding first; the
  merged model stays tied. modules_to_save copies of either module make peft untie the two,
  which a tied checkpoint cannot hold: refused, unless the adapter was trained with
  ensure_weight_tying (then the one shared copy replaces the tied tensor). With
  ensure_weight_tying and LoRA on the embedding, peft saves `lm_head`'s LoRA as the same
  (transposed) factors and its merge_and_unload adds that delta twice; tierlm adds it once,
  which is what the adapter computes before merging.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter, ModuleLora
from tierlm.lora.expert_slices import per_expert_loras
from tierlm.lora.patterns import any_target
from tierlm.weights.checkpoint import MAX_WEIGHT, Checkpoint, check_finite

# The tied pair in every family tierlm runs.
EMBED_MODULE = "model.embed_tokens"
HEAD_MODULE = "lm_head"
# Bumped whenever the merge of identical inputs would produce different tensors.
MERGE_VERSION = b"tierlm-lora-merge/1"


@dataclass(frozen=True, eq=False)
class _Step:
    """One change to a base tensor, applied in peft's order.

    kind: "replace" (tensor replaces it), "linear" / "embedding" (module's LoRA or DoRA on a
    weight), "bias" (module's lora_B bias on a bias).
    """

    kind: str
    module: ModuleLora | None = None
    tensor: "torch.Tensor | None" = None

    @property
    def additive(self) -> bool:
        """Whether the step adds a delta that does not depend on the tensor it is applied to."""
        return self.kind == "bias" or (
            self.kind in ("linear", "embedding") and self.module.magnitude is None
        )


@dataclass(frozen=True, eq=False)
class _Contribution:
    """One adapter's steps on one base tensor, with the user's weight for that adapter."""

    weight: float
    steps: tuple[_Step, ...]


class LoraMerger:
    """Merges several LoRA adapters, each with a user weight, into base tensors one at a time.

    Call `validate(checkpoint)` once before `merge`: it checks every adapter against the base
    model and plans which steps touch which tensor (tied embeddings need the base's config).
    """

    def __init__(self, adapters: Sequence[tuple[LoraAdapter, float]]):
        for adapter, weight in adapters:
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise TierlmError(
                    f"LoRA weight {weight!r} for {adapter.path} is not a finite number",
                    "use --lora PATH[:WEIGHT] with a number such as 0.5",
                )
            if abs(weight) > MAX_WEIGHT:
                # Any such weight overflows the merged tensors; refused before conversion starts.
                raise TierlmError(
                    f"LoRA weight {weight:g} for {adapter.path} is beyond any usable scale",
                    "use --lora PATH[:WEIGHT] with a weight such as 0.5 (1 applies the adapter as trained)",
                )
        self.adapters: tuple[tuple[LoraAdapter, float], ...] = tuple(
            (adapter, float(weight)) for adapter, weight in adapters
        )
        self._plan: dict[str, tuple[_Contribution, ...]] | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}

    def validate(self, checkpoint: "Checkpoint", tied: bool | None = None) -> None:
        """Check every adapter against `checkpoint`; raise TierlmError naming the first mismatch.

        tied: whether the base ties lm_head to embed_tokens; read from the checkpoint's
        config.json (tie_word_embeddings) when None.
        """
        names = checkpoint.names()
        shapes = {name: tuple(checkpoint.entry(name).shape) for name in names}
        if tied is None:
            tied = _tied(Path(checkpoint.model_dir), shapes)
        plan: dict[str, list[_Contribution]] = {}
        replaced_by: dict[str, Path] = {}
        for adapter, weight in self.adapters:
            steps = _adapter_steps(adapter, shapes, tied, checkpoint.model_dir)
            for tensor, tensor_steps in steps.items():
                plan.setdefault(tensor, []).append(_Contribution(weight, tuple(tensor_steps)))
            for tensor in _whole_replacements(adapter, tied):
                if tensor in replaced_by:
                    raise TierlmError(
                        f"LoRA adapters {replaced_by[tensor]} and {adapter.path} both replace "
                        f"{tensor!r} whole (modules_to_save); tierlm cannot combine two replacements",
                        "pass only one of them",
                    )
                replaced_by[tensor] = adapter.path
            _check_targets(adapter, shapes, tied, checkpoint.model_dir)
        self._plan = {name: tuple(c) for name, c in plan.items()}
        self._shapes = {name: shapes[name] for name in self._plan}

    def touched_names(self) -> set[str]:
        """Base tensor names that `merge` changes (adapters with weight 0 change nothing)."""
        return {name for name, contribs in self._planned().items() if any(c.weight for c in contribs)}

    def merge(self, name: str, base: "torch.Tensor") -> "torch.Tensor":
        """The merged tensor `name`, float32, same shape as `base` (the base tensor as stored).

        An untouched tensor is returned cast to float32 (the same object when already float32).
        A merged tensor holding NaN/Inf or values beyond ±MAX_WEIGHT is a TierlmError naming it.
        """
        contribs = [c for c in self._planned().get(name, ()) if c.weight]
        with torch.no_grad():
            original = base.to(torch.float32)
            if not contribs:
                return original
            if tuple(base.shape) != self._shapes[name]:
                raise ValueError(
                    f"{name}: base tensor is {list(base.shape)}, "
                    f"the checkpoint said {list(self._shapes[name])}"
                )
            merged = _combine(contribs, original)
        _check_merged(name, merged, [adapter.path for adapter, _ in self.adapters])
        return merged

    def low_rank(self, name: str) -> "list[tuple[torch.Tensor, torch.Tensor]] | None":
        """`merge(name, W) − W` as low-rank terms [(A [r, in], B [out, r])], fp32, each adapter's
        scale (alpha/r, rsLoRA alpha/√r) and user weight folded into B, so the change is Σ B @ A;
        [] when nothing changes `name`. None where the change is no such sum: DoRA (its norm
        depends on W), a whole-tensor replacement (modules_to_save, a saved base weight), an
        Embedding's LoRA, a lora_B bias. Served unmerged, x @ Aᵀ @ Bᵀ is added to the base's x @ Wᵀ.
        """
        terms = []
        for contrib in self._planned().get(name, ()):
            if not contrib.weight:
                continue
            for step in contrib.steps:
                if step.kind != "linear" or not step.additive:
                    return None
                lora = step.module
                scale = lora.scaling * contrib.weight
                terms.append((lora.lora_A.to(torch.float32), lora.lora_B.to(torch.float32) * scale))
        return terms

    def content_fingerprint(self) -> str:
        """A hex digest of the adapters' files (configs and weights), their order and weights."""
        digest = hashlib.sha256(MERGE_VERSION)
        for adapter, weight in self.adapters:
            digest.update(adapter.digest.encode())
            digest.update(float(weight).hex().encode())
        return digest.hexdigest()

    def _planned(self) -> dict[str, tuple[_Contribution, ...]]:
        if self._plan is None:
            raise RuntimeError("LoraMerger.validate(checkpoint) must run before merging")
        return self._plan


def _tied(model_dir: Path, shapes: dict[str, tuple[int, ...]]) -> bool:
    """tie_word_embeddings from config.json, as the model reads it; guessed from the tensors without one."""
    config = model_dir / "config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            pass
    return f"{HEAD_MODULE}.weight" not in shapes and f"{EMBED_MODULE}.weight" in shapes


def _owner(module: str, tied: bool) -> str:
    """The module whose tensors hold `module`'s weights in the base checkpoint."""
    return EMBED_MODULE if tied and module == HEAD_MODULE else module


def _is_tied_pair(module: str) -> bool:
    return module in (EMBED_MODULE, HEAD_MODULE)


def _whole_replacements(adapter: LoraAdapter, tied: bool) -> set[str]:
    out = set()
    for tensor in adapter.saved_modules:
        module, _, param = tensor.rpartition(".")
        out.add(f"{_owner(module, tied)}.{param}")
    return out


def _adapter_steps(
    adapter: LoraAdapter, shapes: dict[str, tuple[int, ...]], tied: bool, model_dir: Path
) -> dict[str, list[_Step]]:
    """Base tensor name -> this adapter's steps on it, in the order peft applies them."""
    steps: dict[str, list[_Step]] = {}
    # Whole tensors first: peft loads saved base weights before merging, and a modules_to_save
    # module carries no LoRA. One replacement per tensor: a modules_to_save copy over a saved
    # base weight, and on a tied pair the embedding's over lm_head's (peft shares one copy).
    sources = [(True, n, t) for n, t in adapter.saved_modules.items()]
    sources += [(False, n, t) for n, t in adapter.base_weights.items()]
    replacements: dict[str, torch.Tensor] = {}
    for whole_module, source, tensor in sorted(
        sources, key=lambda s: (not s[0], s[1].startswith(HEAD_MODULE + "."))
    ):
        module, _, param = source.rpartition(".")
        if tied and whole_module and _is_tied_pair(module) and not adapter.config.ensure_weight_tying:
            raise TierlmError(
                f"LoRA adapter {adapter.path} replaces {module!r} (modules_to_save) but the base "
                "model ties lm_head to embed_tokens; peft's merge unties them, which a tied "
                "checkpoint cannot hold",
                "train the adapter with ensure_weight_tying=True, or untie the base model "
                "(tie_word_embeddings=false and a saved lm_head.weight) and use that",
            )
        target = f"{_owner(module, tied)}.{param}"
        _expect_shape(adapter, source, target, tuple(tensor.shape), shapes, model_dir)
        replacements.setdefault(target, tensor)
    for target, tensor in replacements.items():
        steps[target] = [_Step("replace", tensor=tensor)]

    # LoRA in peft's module order: the tied embedding merges before lm_head.
    for module in sorted(adapter.modules, key=lambda m: m == HEAD_MODULE):
        lora = adapter.modules[module]
        if tied and module == HEAD_MODULE and _tied_copy(adapter):
            continue
        owner = _owner(module, tied)
        weight = f"{owner}.weight"
        _expect_shape(adapter, module, weight, lora.weight_shape, shapes, model_dir)
        if lora.magnitude is not None:
            wanted = (lora.weight_shape[1] if lora.kind == "embedding" else lora.weight_shape[0],)
            if tuple(lora.magnitude.shape) != wanted:
                raise _misfit(adapter, module, f"its DoRA magnitude is {list(lora.magnitude.shape)}, "
                              f"{weight!r} needs {list(wanted)}")
        steps.setdefault(weight, []).append(_Step(lora.kind, module=lora))
        if lora.bias is not None:
            bias = f"{owner}.bias"
            if bias not in shapes:
                raise TierlmError(
                    f"LoRA adapter {adapter.path} has a lora_B bias on {module!r} (lora_bias) but the "
                    f"base model has no {bias!r} to add it to",
                    "peft cannot merge such an adapter either; retrain it with lora_bias=False",
                )
            _expect_shape(adapter, module, bias, (lora.weight_shape[0],), shapes, model_dir)
            steps.setdefault(bias, []).append(_Step("bias", module=lora))
    # LoRA on fused expert parameters (target_parameters): each expert's slice on its own tensors.
    for parameter in adapter.parameters.values():
        for tensor, lora in per_expert_loras(parameter, shapes, adapter.path).items():
            steps.setdefault(tensor, []).append(_Step("linear", module=lora))
    return steps


def _tied_copy(adapter: LoraAdapter) -> bool:
    """True when lm_head's LoRA is ensure_weight_tying's copy of the embedding's.

    peft then holds one set of factors for both modules, so the delta belongs on the tied
    tensor once (its merge_and_unload adds it twice).
    """
    head, embed = adapter.modules.get(HEAD_MODULE), adapter.modules.get(EMBED_MODULE)
    if not adapter.config.ensure_weight_tying or head is None or embed is None:
        return False
    if head.magnitude is not None or embed.magnitude is not None:
        raise TierlmError(
            f"LoRA adapter {adapter.path} ties DoRA on lm_head to embed_tokens (ensure_weight_tying); "
            "tierlm cannot merge that",
            "merge it with peft's merge_and_unload and pass the merged model",
        )
    same = torch.equal(head.lora_A, embed.lora_B.T) and torch.equal(head.lora_B, embed.lora_A.T)
    if not same:
        raise TierlmError(
            f"LoRA adapter {adapter.path} sets ensure_weight_tying but its lm_head and embed_tokens "
            "LoRA factors differ",
            "re-save the adapter with peft",
        )
    return True


def _check_targets(
    adapter: LoraAdapter, shapes: dict[str, tuple[int, ...]], tied: bool, model_dir: Path
) -> None:
    """peft refuses an adapter whose target_modules match nothing in the base; so does tierlm."""
    config = adapter.config
    if config.target_modules is None or (not config.target_modules and config.target_parameters):
        return  # target_parameters alone: each is matched to base tensors when its steps are planned
    modules = {name.rpartition(".")[0] for name in shapes if name.endswith(".weight")}
    if tied:
        modules.add(HEAD_MODULE)
    fields = dict(
        target_modules=config.target_modules,
        exclude_modules=config.exclude_modules,
        modules_to_save=config.modules_to_save,
        layers_to_transform=config.layers_to_transform,
        layers_pattern=config.layers_pattern,
    )
    if not any_target(sorted(modules), **fields):
        raise TierlmError(
            f"LoRA adapter {adapter.path} targets {config.target_modules!r}, which match no module "
            f"of the base model {model_dir}",
            _trained_on(adapter),
        )


def _expect_shape(
    adapter: LoraAdapter,
    module: str,
    tensor: str,
    expected: tuple[int, ...],
    shapes: dict[str, tuple[int, ...]],
    model_dir: Path,
) -> None:
    actual = shapes.get(tensor)
    if actual is None:
        raise TierlmError(
            f"LoRA adapter {adapter.path} adapts {module!r}, but the base model {model_dir} has no "
            f"tensor {tensor!r}",
            _trained_on(adapter),
        )
    if tuple(actual) != tuple(expected):
        raise _misfit(
            adapter, module, f"it needs {tensor!r} to be {list(expected)}, the base has {list(actual)}"
        )


def _misfit(adapter: LoraAdapter, module: str, why: str) -> TierlmError:
    return TierlmError(
        f"LoRA adapter {adapter.path} does not fit the base model at {module!r}: {why}",
        _trained_on(adapter),
    )


def _trained_on(adapter: LoraAdapter) -> str:
    base = adapter.config.base_model
    made_for = f" (it names {base!r} as its base)" if base else ""
    return f"the adapter was trained for a different model{made_for}; pass that model with --model"


def _combine(contribs: list[_Contribution], original: "torch.Tensor") -> "torch.Tensor":
    """W + Σ wᵢ·(Mᵢ(W) − W) over the contributions (see the module docstring)."""
    if len(contribs) == 1 and contribs[0].weight == 1.0:
        # Exactly peft's arithmetic, with no W + (M - W) round trip.
        return _run(contribs[0].steps, original)
    merged = original.clone()
    for contrib in contribs:
        if all(step.additive for step in contrib.steps):
            for step in contrib.steps:
                merged.add_(_additive_delta(step), alpha=contrib.weight)
        else:
            merged.add_(_run(contrib.steps, original) - original, alpha=contrib.weight)
    return merged


def _check_merged(name: str, merged: "torch.Tensor", paths: list[Path]) -> None:
    """Inputs in range can still overflow together (large factors times a large weight, a DoRA
    norm near zero): the merged tensor is checked before anything quantizes or caches it."""
    adapters = ", ".join(str(p) for p in paths)
    check_finite(
        merged, f"merging LoRA adapter(s) {adapters} into {name!r} gives a tensor that",
        "the adapter's factors, lora_alpha or --lora weight are out of range; nothing was cached",
        limit=MAX_WEIGHT,
    )


def _run(steps: tuple[_Step, ...], base: "torch.Tensor") -> "torch.Tensor":
    """peft's merge of one adapter's steps into `base` (fp32); `base` itself is left unchanged."""
    current = base
    for step in steps:
        current = _apply(step, current)
    return current


def _apply(step: _Step, current: "torch.Tensor") -> "torch.Tensor":
    if step.kind == "replace":
        # A copy: the caller owns what merge returns, the adapter keeps its tensor.
        return step.tensor.to(torch.float32, copy=True)
    if step.additive:
        return current + _additive_delta(step)
    return _dora(step.module, current, _lora_delta(step.module))


def _additive_delta(step: _Step) -> "torch.Tensor":
    if step.kind == "bias":
        # (out,), added to the base bias exactly as peft: bias + lora_B.bias * scaling.
        return step.module.bias.to(torch.float32) * step.module.scaling
    return _lora_delta(step.module)


def _lora_delta(lora: ModuleLora) -> "torch.Tensor":
    """s·B@A, shape (out, in); for an embedding s·(B@A)ᵀ, shape (num_embeddings, embedding_dim)."""
    lora_A, lora_B = lora.lora_A.to(torch.float32), lora.lora_B.to(torch.float32)
    product = lora_B @ lora_A
    return (product.T if lora.kind == "embedding" else product) * lora.scaling


def _dora(lora: ModuleLora, current: "torch.Tensor", delta: "torch.Tensor") -> "torch.Tensor":
    """DoRA's merge: magnitude / ‖W + ΔW‖ · (W + ΔW), as peft's DoraLinearVariant computes it.

    The norm is taken per output row of a Linear weight (out, in) -> (out,), and per embedding
    column of an Embedding weight (num_embeddings, dim) -> (dim,), on the weight the adapter
    was applied to (`current`), and treated as a constant as peft does (no gradient here anyway).
    """
    magnitude = lora.magnitude.to(torch.float32)
    if lora.kind == "embedding":
        norm = torch.linalg.norm(current.T + delta.T, dim=1)
        return (magnitude / norm).view(1, -1) * (current + delta)
    norm = torch.linalg.norm(current + delta, dim=1)
    return (magnitude / norm).view(-1, 1) * (current + delta)
