"""Multi-turn chat over an engine, with an explicit policy for histories that outgrow the context.

Truncation policy: when the rendered conversation plus the reply budget (max_new_tokens)
exceeds the context, the oldest user/assistant exchanges are dropped (a system message is
always kept) until it fits. If the newest message alone cannot fit, the turn is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierlm.errors import TierlmError
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
        """Add the user's message and start the reply; the reply joins the history once consumed.

        A message that cannot fit leaves the history exactly as it was.
        """
        kept, prompt = self._fitting_prompt(self.messages + [{"role": "user", "content": text}],
                                            params.max_new_tokens)
        self.dropped_messages += len(self.messages) + 1 - len(kept)
        self.messages[:] = kept
        generation = self.engine.generate(prompt, params)
        generation.deltas = self._recorded(generation.deltas)
        return generation

    def _recorded(self, deltas):
        pieces: list[str] = []
        try:
            for delta in deltas:
                pieces.append(delta)
                yield delta
        finally:
            # An interrupted reply still enters the history as far as it got.
            self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def _conversation(self, messages: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        prefix = [{"role": "system", "content": self.system}] if self.system else []
        return prefix + (self.messages if messages is None else messages)

    def _fitting_prompt(self, messages: list[dict[str, str]], reply_budget: int):
        """The messages that fit (oldest exchanges dropped) and their prompt ids."""
        context = self.engine.context_length
        budget = max(context - reply_budget, context // 2)
        tokenizer = self.engine.tokenizer
        while True:
            ids = tokenizer.encode_chat(self._conversation(messages), add_generation_prompt=True)
            if len(ids) <= budget or len(messages) <= 1:
                break
            # Drop the oldest exchange: a user message and the assistant reply after it.
            drop = 2 if len(messages) > 2 and messages[1]["role"] == "assistant" else 1
            messages = messages[drop:]
        if len(ids) >= context:
            raise TierlmError(
                f"the message is {len(ids)} tokens with the chat template, but the context "
                f"holds {context}",
                "send a shorter message, or use a profile with a larger context_length",
            )
        return messages, ids
