"""Measured draft acceptance per model and drafter, kept in the cache, and the decode speed it predicts.

A session that drafted records, when it closes, how many drafted positions its verification
passes decided and how many of those stood (runtime/engine.py counts them), aged so that recent
use weighs most. `tierlm plan --draft` reads the record back: with the cost model's price of a
pass (a decode step of k + 1 rows), `speculative_rate` predicts speculative decoding's speed.
Standard library only: `plan` starts without torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tierlm.atomic import optional_write, replace_file
from tierlm.paths import cache_root

DIRECTORY = "acceptance"
KEEP = 0.5  # weight of what was recorded before, against a new session's counts
PRIOR = 0.5  # the acceptance assumed before any measurement (DraftPolicy's prior)


@dataclass(frozen=True)
class Acceptance:
    """Drafted positions that stood of those verification decided, over `passes` passes, and the
    steps where the drafter found nothing to draft (`misses`), all aged."""

    stood: float
    checked: float
    passes: float
    misses: float = 0.0

    @property
    def rate(self) -> float:
        return self.stood / self.checked if self.checked else PRIOR

    @property
    def coverage(self) -> float:
        """The share of steps a draft was found for (a model always drafts; lookup only on repeats)."""
        asked = self.passes + self.misses
        return self.passes / asked if asked else 1.0


def acceptance_path(model_dir: Path, drafter: str) -> Path:
    key = hashlib.sha256(f"{Path(model_dir).resolve()}\0{drafter}".encode()).hexdigest()[:16]
    return cache_root() / DIRECTORY / f"{key}.json"


def read_acceptance(model_dir: Path, drafter: str) -> Acceptance | None:
    """The record for `model_dir` drafted by `drafter` ("lookup", or a draft model's name); None
    when there is none or it cannot be read (a statistic only ever costs a cold start)."""
    try:
        saved = json.loads(acceptance_path(model_dir, drafter).read_text())
        return Acceptance(float(saved["stood"]), float(saved["checked"]), float(saved["passes"]),
                          float(saved.get("misses", 0.0)))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_acceptance(model_dir: Path, drafter: str, counts: Acceptance) -> None:
    """Add a session's `counts` to the record, what was there weighing KEEP; written atomically, and
    nothing at all where the cache cannot be written."""
    if counts.passes <= 0:
        return
    old = read_acceptance(model_dir, drafter) or Acceptance(0.0, 0.0, 0.0)
    fields = ("stood", "checked", "passes", "misses")
    aged = Acceptance(*(KEEP * getattr(old, name) + getattr(counts, name) for name in fields))
    path = acceptance_path(model_dir, drafter)
    with optional_write():
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps({"model": str(model_dir), "drafter": drafter, "stood": aged.stood,
                                       "checked": aged.checked, "passes": aged.passes, "misses": aged.misses}))


def speculative_rate(pass_seconds, measured: Acceptance | None, limit: int) -> tuple[int, float]:
    """(drafts a pass, tokens a second) of the best pass length at the `measured` acceptance (None:
    PRIOR, a draft found at every step). `pass_seconds(k)`: what a pass of k drafts costs (k = 0:
    a plain step). A pass yields 1 + a + ... + a^k tokens; steps with nothing to draft are plain."""
    a = min(measured.rate if measured else PRIOR, 1.0)
    found = measured.coverage if measured else 1.0
    step = pass_seconds(0)
    best = (0, 1.0 / step)
    for k in range(1, limit + 1):
        tokens = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
        rate = (found * tokens + (1 - found)) / (found * pass_seconds(k) + (1 - found) * step)
        if rate > best[1]:
            best = (k, rate)
    return best
