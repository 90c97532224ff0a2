"""What `tierlm serve` can be told, with the defaults it uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierlm.cache.catalog import model_name
from tierlm.errors import TierlmError
from tierlm.runtime.speculative import DraftSettings


@dataclass(frozen=True)
class ServerOptions:
    """Server settings; the model, device and memory profile come with the session."""

    model_id: str | None = None  # the name /v1/models reports (default: the model's catalogue name)
    aliases: tuple[str, ...] = ()  # other names requests may give the model (answered under model_id)
    api_key: str | None = None  # when set, every route but /health and the chat page (/) needs `Bearer KEY`
    # Sequences decoded together; default the profile's batch_size. (`serve --batch-size` sets the
    # profile's instead, so the planner reserves KV memory for that many.)
    batch_size: int | None = None
    # The most sequences decoded at once, as long as their pages fit the KV pool (None: 4 per batch_size).
    parallel: int | None = None
    max_queue: int = 64  # requests waiting for a slot before new ones get 429
    default_timeout: float | None = 600.0  # a request's deadline in seconds unless it sends `timeout`
    stall_timeout: float = 60.0  # seconds without a worker heartbeat before it is restarted
    restart_backoff: float = 1.0  # seconds the server reports unhealthy before the restart
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_messages: int = 512  # chat messages per request
    # A chat request that does not fit drops its oldest exchanges (runtime/context_shift.py) instead of a 400.
    context_shift: bool = False
    access_log: bool = True  # one line per request on stderr (`serve --quiet` turns it off)
    debug_hooks: bool = False  # POST /debug/worker (kill, stall, delay, pause): tests only
    adapter_dir: Path | None = None  # POST /v1/adapters loads adapters only under it (or cached ones by name)
    # Disk for idle conversations' KV rows past the host RAM the plan leaves (kv/spill.py); 0: none.
    kv_spill_disk: int = 2 << 30
    # How requests draft tokens unless they say (`draft`, `draft_tokens`): serve --draft, --draft-tokens.
    draft: DraftSettings = DraftSettings()

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise TierlmError("--batch-size must be at least 1")
        if self.parallel is not None and self.parallel < 1:
            raise TierlmError("--parallel must be at least 1")
        if self.max_queue < 0:
            raise TierlmError("--max-queue must not be negative")
        if self.default_timeout is not None and self.default_timeout <= 0:
            raise TierlmError("--timeout must be positive (0 on the command line means none)")
        if self.stall_timeout <= 0:
            raise TierlmError("--stall-timeout must be positive")
        if self.api_key is not None and not self.api_key:
            raise TierlmError("--api-key must not be empty")
        if self.model_id is not None and not self.model_id.strip():
            raise TierlmError("--model-name must not be empty")
        if not all(isinstance(a, str) and a.strip() for a in self.aliases):
            raise TierlmError("--alias must not be empty")
        if self.kv_spill_disk < 0:
            raise TierlmError("--kv-spill-disk must not be negative", "give a size such as 2GiB, or 0 for none")
        if self.adapter_dir is not None and not Path(self.adapter_dir).expanduser().is_dir():
            raise TierlmError(f"--adapter-dir {self.adapter_dir} is not a directory",
                              "give the directory holding the adapters that API clients may add")  # fmt: skip

    def served_name(self, model_dir: Path) -> str:
        """The model's name on the API: --model-name, else its catalogue name (`smollm2`)."""
        return self.model_id if self.model_id is not None else model_name(model_dir)
