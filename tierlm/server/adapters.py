"""The LoRA variants a server serves beside its base: listed by /v1/models, picked by a request's
`model`, added while it serves (POST /v1/adapters: checked at once, converted on a thread of
its own with progress) and removed (DELETE: retired by the worker once no request uses it).

States: "converting" (not yet servable), "ready", "failed" (the conversion's error is kept for
GET /v1/adapters), "removing" (no new requests; in-flight ones finish, then it is dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tierlm.errors import TierlmError
from tierlm.server.adapter_sources import AdapterSources
from tierlm.server.schemas import ApiError

CONVERTING, READY, FAILED, REMOVING = "converting", "ready", "failed", "removing"


@dataclass
class Variant:
    name: str
    adapters: tuple[tuple[Path, float], ...]  # its own; the base's merged adapters come first
    status: str
    created: int = field(default_factory=lambda: int(time.time()))
    phase: str = ""  # the conversion step under way
    done: int = 0
    total: int = 0
    error: str | None = None
    overlay: object = None  # store/variants.py's Overlay once ready: its mode and bytes

    def progress(self, label: str, unit: str = ""):
        """A ProgressFactory's callback for the step `label`: GET /v1/adapters shows it."""
        self.phase, self.done, self.total = label, 0, 0

        def report(done: int, total: int) -> None:
            self.done, self.total = done, total

        return report

    def card(self, parent: str) -> dict:
        """How GET /v1/adapters (and the POST's 202) describe it."""
        overlay = self.overlay
        return {
            "id": self.name, "object": "adapter", "created": self.created, "parent": parent,
            "status": self.status,
            "adapters": [{"path": str(path), "weight": weight} for path, weight in self.adapters],
            "progress": {"phase": self.phase, "done": self.done, "total": self.total},
            "mode": getattr(overlay, "mode", None),  # merged or unmerged, and why the cost model chose it
            "why": getattr(overlay, "why", None),
            "bytes": getattr(overlay, "nbytes", None),
            "error": self.error,
        }


class Variants:
    """The server's variant registry over `session` (runtime.session.Session), whose store it
    makes a VariantStore before the worker starts. Handlers call it; only `worker` removes.
    `sources` (adapter_sources.py) says which adapters a client may add."""

    def __init__(self, session, model_id: str, aliases: tuple[str, ...], worker, sources: AdapterSources):
        self.session = session
        self.model_id = model_id
        self.aliases = aliases
        self.worker = worker
        self.sources = sources
        self._lock = threading.Lock()
        session.variant_store()  # now, not while the worker runs: the model's store is swapped
        self._variants = {name: Variant(name, own, READY, overlay=overlay)
                          for name, (own, overlay) in session.variants.items()}
        clash = sorted(set(self._variants) & {model_id, *aliases})
        if clash:
            raise TierlmError(f"the variant name {clash[0]!r} is also the base model's name or alias",
                              "give the variant another name (--lora NAME=PATH), or the model another --model-name")

    def ready(self) -> list[Variant]:
        with self._lock:
            return [v for v in self._variants.values() if v.status == READY]

    def all(self) -> list[Variant]:
        with self._lock:
            return list(self._variants.values())

    def resolve(self, name: str | None) -> str | None:
        """The variant a request's `model` names (None: the base); else OpenAI's 404."""
        if name is None or name == self.model_id or name in self.aliases:
            return None
        with self._lock:
            variant = self._variants.get(name)
            if variant is not None and variant.status == READY:
                return name
            ready = [v.name for v in self._variants.values() if v.status == READY]
        served = ", ".join(f"`{n}`" for n in [self.model_id, *ready])
        why = f" (it is {variant.status}; see GET /v1/adapters)" if variant is not None else ""
        raise ApiError(404, f"The model `{name}` does not exist{why}; this server serves {served}",
                       param="model", code="model_not_found")

    def add(self, name: str, spec: str, weight: float) -> Variant:
        """Find the adapter the request's `spec` names (403 where the server may not read it),
        check it against the base now (400: nothing is written), then convert it on a thread;
        the variant serves once "ready". A name in use is a 409. Returns it as accepted (converting)."""
        with self._lock:
            if name == self.model_id or name in self.aliases or name in self._variants:
                raise ApiError(409, f"the name `{name}` is already in use on this server; DELETE "
                                    f"/v1/adapters/{name} first or pick another", param="name",
                               code="adapter_exists")
            variant = self._variants[name] = Variant(name, (), CONVERTING)  # the name is held while checking
        try:
            variant.adapters = ((self.sources.locate(spec), weight),)
            self.session.check_variant(variant.adapters)
        except TierlmError as err:
            with self._lock:
                del self._variants[name]
            raise ApiError(400, str(err), param="path", code="invalid_adapter") from None
        except BaseException:
            with self._lock:
                del self._variants[name]
            raise
        accepted = replace(variant)  # what the 202 reports, though a fast conversion may end first
        threading.Thread(target=self._convert, args=(variant,), name=f"tierlm-adapter-{name}", daemon=True).start()
        return accepted

    def remove(self, name: str) -> Variant:
        """Stop serving `name` now; it leaves the store once the requests using it have ended."""
        with self._lock:
            variant = self._variants.get(name)
            if variant is None or variant.status == REMOVING:
                raise ApiError(404, f"no adapter named `{name}` (GET /v1/adapters lists them)",
                               code="adapter_not_found")
            was, variant.status = variant.status, REMOVING
            if was == FAILED:
                del self._variants[name]
        if was == READY:
            self.worker.retire(name, lambda: self._drop(name))
        return variant  # one still converting is dropped when its conversion ends

    def _convert(self, variant: Variant) -> None:
        try:
            overlay = self.session.add_variant(variant.name, variant.adapters, progress=variant.progress)
        except Exception as err:  # noqa: BLE001 - kept for GET /v1/adapters, the server goes on
            logging.getLogger("tierlm.server").exception("converting adapter %s failed", variant.name)
            with self._lock:
                if variant.status == REMOVING:
                    del self._variants[variant.name]
                    return
                variant.status, variant.error = FAILED, f"{type(err).__name__}: {err}"
            return
        with self._lock:
            variant.overlay = overlay
            if variant.status != REMOVING:
                variant.status = READY
                return
        self.worker.retire(variant.name, lambda: self._drop(variant.name))  # deleted while converting

    def _drop(self, name: str) -> None:
        """On the worker thread, between steps."""
        self.session.remove_variant(name)
        with self._lock:
            self._variants.pop(name, None)
