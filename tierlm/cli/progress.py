"""Progress on stderr (stdout stays clean for generated text): a bar per phase on a terminal; when
stderr is a pipe or a log file, lines: one as a phase starts, then one at most every
`LINE_INTERVAL_S` (at least as often, while its job keeps reporting) saying how far it is, and one
when it ends, so a slow start is never silent."""

from __future__ import annotations

from typing import Callable

from tierlm.progress import BYTES, Progress, ProgressFactory

LINE_INTERVAL_S = 10.0
_MIB = 2**20


def progress_factory(interval_s: float = LINE_INTERVAL_S, clock: Callable[[], float] | None = None) -> ProgressFactory:
    """Returns `start(label, unit) -> update(done, total)` (tierlm/progress.py says what jobs report).

    `clock` (seconds; default the monotonic clock) and `interval_s` time the lines; tests pass a
    clock of their own.
    """
    import sys
    import time

    clock = clock or time.monotonic
    # Phases are created up front but run one after another: one first heard of after some of its
    # work was done began when the previous one ended (or when it was created, if later).
    timeline = {"last_end": clock()}

    def start(label: str, unit: str = "") -> Progress:
        if sys.stderr.isatty():
            return _bar(label, timeline, clock)
        return _lines(label, unit, interval_s, timeline, clock)

    return start


def _lines(label: str, unit: str, interval_s: float, timeline: dict, clock) -> Progress:
    """A phase on a piped stderr: a start line, a line of how far at most every `interval_s`, an end line."""
    import sys

    created = clock()
    state: dict = {}

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def update(done: int, total: int) -> None:
        if state.get("ended"):
            return
        now = clock()
        if "began" not in state:
            state["began"] = now if done == 0 else max(created, timeline["last_end"])
            state["said"] = now
            amount = _amount(total, unit)
            say(f"{label}: {amount}" if amount else label)
        if done >= total:
            state["ended"], timeline["last_end"] = True, now
            say(f"{label}: done in {now - state['began']:.1f} s")
        elif now - state["said"] >= interval_s:
            state["said"] = now
            elapsed = f"{now - state['began']:.0f} s"
            say(f"{label}: {', '.join(filter(None, (_how_far(done, total, unit), elapsed)))}")

    return update


def _amount(total: int, unit: str) -> str:
    """What a phase has to do: "30 blocks", "140.2 MiB"; "" when its count says nothing."""
    if unit == BYTES:
        return f"{total / _MIB:.1f} MiB"
    return f"{total} {unit}" if unit else ""


def _how_far(done: int, total: int, unit: str) -> str:
    """"12/30 blocks (40%)", "56.1/140.2 MiB (40%)", "40%"; "" for a phase of one step."""
    if total <= 1 and not unit:
        return ""
    percent = f"{100 * done // max(total, 1)}%"
    if unit == BYTES:
        return f"{done / _MIB:.1f}/{total / _MIB:.1f} MiB ({percent})"
    return f"{done}/{total} {unit} ({percent})" if unit else percent


def _bar(label: str, timeline: dict, clock) -> Progress:
    """A phase on a terminal: a transient bar from its first report to its last."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress as RichProgress, TaskProgressColumn, TextColumn

    state: dict = {}

    def update(done: int, total: int) -> None:
        if "bar" not in state:
            if state.get("ended"):
                return
            bar = RichProgress(TextColumn(label), BarColumn(), TaskProgressColumn(),
                               console=Console(stderr=True), transient=True)  # fmt: skip
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(label, total=total)
        state["bar"].update(state["task"], completed=done, total=total)
        if done >= total:
            state["ended"], timeline["last_end"] = True, clock()
            state.pop("bar").stop()

    return update
