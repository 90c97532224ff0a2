"""Progress bars on stderr (stdout stays clean for generated text)."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int, int], None]


def progress_factory() -> Callable[[str], Progress]:
    """Returns `start(label) -> update(done, total)`; a bar shows only on a terminal."""
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, Progress as RichProgress, TaskProgressColumn, TextColumn

    console = Console(stderr=True)

    def start(label: str) -> Progress:
        state: dict = {}

        def update(done: int, total: int) -> None:
            if not sys.stderr.isatty():  # keep piped stderr to real messages
                return
            if "bar" not in state:
                bar = RichProgress(
                    TextColumn(label), BarColumn(), TaskProgressColumn(), console=console, transient=True
                )
                bar.start()
                state["bar"], state["task"] = bar, bar.add_task(label, total=total)
            state["bar"].update(state["task"], completed=done, total=total)
            if done >= total:
                state.pop("bar").stop()

        return update

    return start
