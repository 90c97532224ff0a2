"""`chat --session NAME`: a conversation kept in `<cache>/sessions/NAME` with its KV rows, so a
later chat resumes it without prefilling it again.

The rows are used only by the exact weights, compute dtype, KV dtype, device type and cache
layout that computed them (`model_identity`). A file that is damaged, truncated or of another
format is not used at all; one computed by another model is whole, so its messages are kept and
computed afresh on the next turn. Either way the reason is one line and the chat goes on.
Restored ids are only a prefix the engine may reuse: a prompt that renders differently (another
template or system prompt) reuses what still matches and computes the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tierlm.atomic import make_dirs, refused_write_error, remove_stale_temporaries
from tierlm.errors import TierlmError
from tierlm.kv.prompt_cache import PromptCacheRejected, read_prompt_cache, save_prompt_cache
from tierlm.paths import cache_root

SESSIONS_DIR = "sessions"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def session_path(name: str) -> Path:
    """Where the session `name` is kept; a name that is not a plain file name is an error."""
    if not _NAME.fullmatch(name):
        raise TierlmError(f"{name!r} is not a session name",
                          "use letters, digits, '.', '_' and '-', starting with a letter or digit")  # fmt: skip
    return cache_root() / SESSIONS_DIR / name


def model_identity(loaded, cache) -> dict:
    """What the KV rows depend on: the weights' content (the artifact's key, which covers base
    weights, adapters and quant mode; or the checkpoint's digest for weights loaded as stored),
    the compute dtype and KV format, the device type, and the cache's layout."""
    from tierlm.cache.manifest import read_manifest

    source = loaded.source
    if source.compiled:
        weights = "artifact " + str(read_manifest(source.directory)["key"])
    else:
        from tierlm.cache.fingerprint import checkpoint_digest

        weights = "checkpoint " + checkpoint_digest(source.directory)
    layers, _, kv_heads, _, _ = cache.keys.shape
    return {
        "weights": weights,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv_cache": cache.format.name,
        "device": loaded.device.type,
        "layout": [layers, kv_heads, cache.head_dim],
    }


@dataclass
class SavedChat:
    """The session `name` of one chat: restores it into a ChatSession, saves it after each turn."""

    name: str
    path: Path
    identity: dict
    _saved: list | None = None  # the messages last saved or restored: an unchanged chat is not rewritten

    @classmethod
    def open(cls, name: str, session) -> "SavedChat":
        if session.pipeline is not None:
            raise TierlmError("--session keeps one process's KV cache; a pipeline's is spread over its stages",
                              "drop --stages (or --session)")  # fmt: skip
        path = session_path(name)
        return cls(name, path, model_identity(session.engine.loaded, session.engine.cache))

    def resume(self, chat) -> str:
        """Restore the saved conversation (and, when this model computed them, its KV rows) into
        `chat`, whose engine is fresh; the one line that says what happened."""
        try:
            saved = read_prompt_cache(self.path, self.identity)
        except FileNotFoundError:
            return f"new session {self.name} (kept in {self.path})"
        except PromptCacheRejected as rejected:
            if rejected.conversation is None:
                return f"session {self.name} was not used: {rejected.reason}; starting it afresh"
            restored = self._restore_messages(chat, rejected.conversation)
            return (f"session {self.name} was saved with another model ({rejected.reason}); "
                    f"its {restored} messages are kept and computed afresh")  # fmt: skip
        except OSError as err:
            return f"session {self.name} was not used: it could not be read ({err.strerror or err}); starting it afresh"
        restored = self._restore_messages(chat, saved.conversation)
        engine = chat.engine
        # Rows past the context cannot be held; chat drops the oldest exchanges and recomputes.
        length = min(len(saved.token_ids), engine.cache.max_len)
        for held, part in zip(engine.cache.rows_of(0, length), saved.parts, strict=True):
            held.copy_(part[:, :, :length])
        engine.cache.offset = length
        engine.cached_ids = saved.token_ids[:length]
        return f"resumed session {self.name}: {restored} messages, {length:,} tokens cached"

    def _restore_messages(self, chat, conversation: dict) -> int:
        messages = conversation.get("messages")
        if not (isinstance(messages, list) and all(_is_message(m) for m in messages)):
            return 0
        chat.messages[:] = [{"role": m["role"], "content": m["content"]} for m in messages]
        if chat.system is None and isinstance(conversation.get("system"), str):
            chat.system = conversation["system"]  # the saved one, unless this run gave its own
        self._saved = [dict(m) for m in chat.messages]
        return len(chat.messages)

    def save(self, chat) -> str | None:
        """Save the conversation and the KV rows its engine holds, if it changed since the last
        save; a line saying why it was not saved, or None."""
        if self._saved == chat.messages:
            return None
        engine = chat.engine
        length = min(len(engine.cached_ids), engine.cache.offset)
        conversation = {"messages": chat.messages, "system": chat.system}
        try:
            make_dirs(self.path.parent)
            remove_stale_temporaries(self.path.parent)  # what a killed save left
            save_prompt_cache(self.path, self.identity, conversation, engine.cached_ids[:length],
                              engine.cache.rows_of(0, length))  # fmt: skip
        except TierlmError as err:
            return f"session {self.name} not saved: {err}"
        except OSError as err:
            refusal = refused_write_error(err, self.path.parent)
            return f"session {self.name} not saved: {refusal or err}"
        self._saved = [dict(m) for m in chat.messages]
        return None


def _is_message(message) -> bool:
    return (isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str))  # fmt: skip
