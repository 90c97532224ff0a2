"""A draft model: a smaller model of the target's tokenizer that guesses the next tokens greedily.

`resolve_draft` checks it before anything loads: its tokenizer's vocabulary must be the target's,
token for token, and its weights fewer than the target's. It also prices what the draft will
hold (weights resident, a KV cache of up to DRAFT_CONTEXT positions per sequence drafting at once,
the scratch of its largest step), a
charge the target's plan makes room for beside its own (runtime/source.py `Beside`), so both fit
the profile together or the load is refused naming the draft.

`DraftModel` keeps one KV cache over the tokens of the sequence it last drafted for; `ModelDrafts`
drafts for one sequence: it brings that cache to the sequence's tokens (the common prefix kept, a
rejected draft's positions dropped, the rest prefilled; after a long pause, a recent window of
them), then steps greedily. A greedy draft is deterministic, which is what `Sampler.verify`'s
rejection rule takes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from tierlm.errors import TierlmError
from tierlm.offload.sizes import kv_token_bytes, workspace_bytes
from tierlm.quant.modes import AUTO
from tierlm.runtime.sequence import PREFILL_CHUNK, reusable_prefix
from tierlm.runtime.speculative import MAX_DRAFT_TOKENS
from tierlm.runtime.source import Beside, WeightSource, expected_sizes, resolve_model_dir, resolve_source
from tierlm.runtime.tokenizer import Tokenizer
from tierlm.units import format_size


# Positions a draft model's cache holds at most: it follows longer sequences on a recent window
# (DraftModel.WINDOW), so its memory stays small whatever the target's context.
DRAFT_CONTEXT = 2048


@dataclass(frozen=True)
class DraftSource:
    """A draft model checked against its target, not loaded: its weights' source, and the memory
    it will hold beside the target (`beside`)."""

    name: str  # as the user gave it
    source: WeightSource
    beside: Beside
    context: int  # positions its cache holds: the target's context, at most DRAFT_CONTEXT and the draft's maximum


def resolve_draft(name: str, target: WeightSource, tokenizer: Tokenizer, profile, *, accelerator: bool,
                  caches: int = 1) -> DraftSource:  # fmt: skip
    """The draft model `name` (a name from `tierlm list`, a directory or a .gguf) for `target`,
    whose `tokenizer` it must share, loaded beside it under `profile` with `caches` KV caches (a
    server's: one per sequence drafting at once); one TierlmError for a draft that cannot be one,
    before anything loads."""
    try:
        model_dir = resolve_model_dir(name)
    except TierlmError as err:
        raise TierlmError(f"--draft {name!r} is neither a draft source (ngram, auto, off) nor a model: {err.message}",
                          "name a smaller model of the same tokenizer from `tierlm list`, a directory or a .gguf; "
                          "or --draft ngram") from None  # fmt: skip
    check_same_vocabulary(name, Tokenizer.from_dir(model_dir), tokenizer)
    # Its own format, whatever --quant asks of the target: a draft is chosen for its size.
    source = resolve_source(model_dir, AUTO, accelerator=accelerator)
    sizes, target_sizes = expected_sizes(source, accelerator), expected_sizes(target, accelerator)
    if sizes.total >= target_sizes.total:
        raise TierlmError(f"the draft model {name} ({format_size(sizes.total)} of weights) is not smaller than the "
                          f"model it drafts for ({format_size(target_sizes.total)}): it could never save time",
                          "draft with a smaller model of the same tokenizer, or --draft ngram")  # fmt: skip
    asked = profile.context_length if profile is not None else target.config.max_position_embeddings
    context = min(asked, target.config.max_position_embeddings, source.config.max_position_embeddings, DRAFT_CONTEXT)
    kv_cache = profile.kv_cache if profile is not None else "auto"
    charge = sizes.total + caches * kv_token_bytes(source.config, kv_cache, accelerator) * context
    if profile is not None:
        one = replace(profile, batch_size=1, context_length=context, context_asked=None)
        charge += workspace_bytes(source.config, sizes, one, accelerator)
    return DraftSource(name, source, Beside(f"the draft model {name}", charge), context)


def check_same_vocabulary(name: str, draft: Tokenizer, target: Tokenizer) -> None:
    """Refuse a draft whose tokens are not the target's: an id must mean the same token to both."""
    mine, theirs = draft.backend.get_vocab(with_added_tokens=True), target.backend.get_vocab(with_added_tokens=True)
    if mine == theirs:
        return
    by_id = {i: t for t, i in theirs.items()}
    differs = [i for t, i in mine.items() if by_id.get(i) != t] + list(set(by_id) - set(mine.values()))
    first = min(differs, default=0)  # the lowest id either side means differently
    raise TierlmError(f"the draft model {name} has another tokenizer: {len(mine)} tokens against the model's "
                      f"{len(theirs)}, first differing at id {first} ({_token(mine, first)!r} vs "
                      f"{by_id.get(first)!r})",
                      "a draft model must share the model's tokenizer (the same family and vocabulary); "
                      "or --draft ngram")  # fmt: skip


def _token(vocab: dict[str, int], token_id: int) -> str | None:
    return next((t for t, i in vocab.items() if i == token_id), None)


class DraftModel:
    """A loaded draft model and its one KV cache over a stretch of some sequence's tokens: those
    from `start` on (`cached_ids`)."""

    # Tokens missing past which the cache restarts on the last this many: a draft is a guess, which
    # recent context serves.
    WINDOW = 256

    def __init__(self, loaded, name: str, vocab_limit: int):
        """`vocab_limit`: ids the target can score (a draft's padded embedding may produce more)."""
        self.loaded, self.name, self.vocab_limit = loaded, name, vocab_limit
        self.cache = loaded.new_cache()
        self.start = 0
        self.cached_ids: list[int] = []

    def twin(self) -> "DraftModel":
        """Another cache over the same weights (the server's: one per sequence drafting at once)."""
        return DraftModel(self.loaded, self.name, self.vocab_limit)

    def drafts_for(self, tokens: list[int]) -> "ModelDrafts":
        return ModelDrafts(self, tokens)

    def follow(self, tokens: list[int]) -> torch.Tensor:
        """Bring the cache to `tokens` (what it holds of them kept); the logits [V] after the last.
        With more than WINDOW tokens missing (a long prompt, a long pause) it restarts on the last
        WINDOW: a catch-up costs a bounded prefill however long the pause, and the context never runs out."""
        view = tokens[self.start :]
        common = reusable_prefix(self.cached_ids, view) if view else 0
        # The tokens and a pass's drafts fit after a restart (a short context keeps half for drafts).
        room = max(self.cache.max_len - MAX_DRAFT_TOKENS - 1, self.cache.max_len // 2)
        if len(view) - common > self.WINDOW or len(view) > room or not view:
            self.start = max(0, len(tokens) - min(self.WINDOW, room))
            view, common = tokens[self.start :], 0
        self.cache.trim(common)
        del self.cached_ids[common:]
        logits = None
        for begin in range(common, len(view), PREFILL_CHUNK):
            logits = self.step(view[begin : begin + PREFILL_CHUNK])
        return logits

    def step(self, ids: list[int]) -> torch.Tensor:
        batch = torch.tensor([ids], dtype=torch.long, device=self.loaded.device)
        logits = self.loaded.model.forward(batch, self.cache, logits="last")
        self.cached_ids.extend(ids)
        return logits[0, -1]

    def close(self) -> None:
        self.loaded.close()


class ModelDrafts:
    """Drafts for one sequence from a DraftModel: its greedy continuation of the sequence's tokens.
    Only the sequence's own tokens are added (`extend`), as for prompt lookup."""

    STEADY = 2  # tokens a pass leaves the draft's cache behind by (its own, and a replacement)

    def __init__(self, model: DraftModel, tokens: list[int]):
        self.model = model
        self.tokens = list(tokens)
        self._overhead = 0.0

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def take_overhead(self) -> float:
        """Seconds spent catching up on more than a pass's tokens (a prompt, a pause) since last
        asked: a one-time cost the policy does not charge to the pass."""
        spent, self._overhead = self._overhead, 0.0
        return spent

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` greedy tokens of the draft model after the sequence's; fewer where its
        cache ends or it proposes an id the target cannot score."""
        model = self.model
        started = time.perf_counter()
        behind = len(self.tokens) - model.start - len(model.cached_ids)
        logits = model.follow(self.tokens)
        if behind > self.STEADY:
            self._overhead += time.perf_counter() - started
        drafts: list[int] = []
        while True:
            token = int(torch.argmax(logits))
            if token >= model.vocab_limit:
                break
            drafts.append(token)
            if len(drafts) >= limit or len(model.cached_ids) + 1 >= model.cache.max_len:
                break
            logits = model.step([token])
        return drafts
