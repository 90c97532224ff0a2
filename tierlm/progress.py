"""The progress of long jobs (import, conversion, calibration, the kernel build, loading), low-level
so cache/, weights/ and quant/ can import it; cli/progress.py draws it.

A caller hands a job a ProgressFactory: `start(label, unit)` names a phase and returns its
callback. The label says what runs, on what, and why it runs now ("converting smollm2 (int8,
one-time)"); `unit` what the counts count ("blocks", "weights", BYTES; "" when the job can only
say that it still runs, as a compiler's). The job calls `progress(0, total)` as it begins, so a
slow phase is announced before its first unit ends, reports after each unit (and in between
when a unit takes long: repeating a count says it still runs), and ends with `progress(total, total)`.
"""

from __future__ import annotations

from typing import Callable, Protocol

Progress = Callable[[int, int], None]  # progress(done, total)
BYTES = "bytes"  # the unit of a phase that counts bytes


class ProgressFactory(Protocol):
    def __call__(self, label: str, unit: str = "") -> Progress:
        """Start the phase `label` counting `unit`: the callback its job reports to."""
