"""The one progress callback type: long jobs (conversion, GGUF import, loading) call
`progress(done, total)`; cli/progress.py draws it. Low-level so cache/ and weights/ can import it."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int, int], None]
ProgressFactory = Callable[[str], Progress]  # start(label) -> the callback for that phase
