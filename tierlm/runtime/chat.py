"""Multi-turn chat over an engine, with an explicit policy for histories that outgrow the context.

Truncation policy: when the rendered conversation plus the reply budget (max_new_tokens)
exceeds the context, the oldest user/assistant exchanges are dropped (a system message is
always kept) until it fits, as `serve --context-shift` drops them (runtime/context_shift.py).
If the newest message alone cannot fit, the turn is refused.

Stopped replies: a reply closed before it ends (Ctrl-C in the REPL) joins the history as far
as it got, its stats say finish_reason "interrupted"; one stopped before any text leaves the
history as it was. After every turn the KV cache holds a prefix of the history's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierlm.errors import TierlmError
from tierlm.runtime.context_shift import drop_oldest
from tierlm.runtime.engine import Engine, Generation
from tierlm.runtime.sampling import SamplingParams


@dataclass
class ChatSession:
    engine: Engine
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    dropped_messages: int = 0  # how many old messages truncation has removed so far

    def reset(self) -> None:
        self.messages.clear()
        self.dropped_messages = 0
        self.engine.reset()

    def send(self, text: str, params: SamplingParams) -> Generation:
        """Start the reply to `text`; the exchange joins the history once the reply is consumed
        or closed. Nothing changes before that, so a message that cannot fit, or a reply never
        started, leaves the history (and the KV cache) exactly as they were.
        """
        kept, prompt = self._fitting_prompt(self.messages + [{"role": "user", "content": text}],
                                            params.max_new_tokens)
        generation = self.engine.generate(prompt, params)
        generation.deltas = self._recorded(generation.deltas, generation.stats, kept)
        return generation

    def _recorded(self, deltas, stats, kept: list[dict[str, str]]):
        pieces: list[str] = []
        finished = False
        try:
            for delta in deltas:
                pieces.append(delta)
                yield delta
            finished = True
        finally:
            deltas.close()  # the engine stops before touching the cache again
            if not finished:
                stats.finish_reason = "interrupted"
            if finished or pieces:
                self._commit(kept, "".join(pieces))
            self._sync_cache()

    def _commit(self, kept: list[dict[str, str]], reply: str) -> None:
        self.dropped_messages += len(self.messages) + 1 - len(kept)
        # One slice assignment: an interrupt cannot leave a user message without its reply.
        self.messages[:] = kept + [{"role": "assistant", "content": reply}]

    def _sync_cache(self) -> None:
        """Trim the KV cache to the longest prefix it shares with the history's tokens.

        The next prompt begins with those tokens, so they stay reusable; beyond them (a stopped
        reply's last steps, a reply that re-encodes differently) nothing would match anyway.
        Bounding by the cache's own offset also repairs an interrupt that landed between a
        forward pass and the engine's record of its ids.
        """
        engine = self.engine
        conversation = self._conversation()
        if not conversation:
            engine.reset()
            return
        try:
            history = engine.tokenizer.encode_chat(conversation, add_generation_prompt=False)
        except TierlmError:  # a template that will not render a history alone: trust the record
            history = engine.cached_ids
        keep = min(_shared_prefix(engine.cached_ids, history), engine.cache.offset)
        engine.cache.trim(keep)
        engine.cached_ids = engine.cached_ids[:keep]

    def _conversation(self, messages: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        prefix = [{"role": "system", "content": self.system}] if self.system else []
        return prefix + (self.messages if messages is None else messages)

    def _fitting_prompt(self, messages: list[dict[str, str]], reply_budget: int):
        """The messages that fit (oldest exchanges dropped) and their prompt ids."""
        context = self.engine.context_length
        budget = max(context - reply_budget, context // 2)
        tokenizer = self.engine.tokenizer
        system = self._conversation([])
        kept, ids = drop_oldest(self._conversation(messages),
                                lambda conversation: tokenizer.encode_chat(conversation, add_generation_prompt=True),
                                lambda prompt: len(prompt) <= budget)  # fmt: skip
        messages = kept[len(system):]
        if len(ids) >= context:
            raise TierlmError(
                f"the message is {len(ids)} tokens with the chat template, but the context "
                f"holds {context}",
                "send a shorter message, or raise --context (up to the model's maximum)",
            )
        return messages, ids


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
