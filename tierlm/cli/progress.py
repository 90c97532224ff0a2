"""Progress on stderr (stdout stays clean for generated text): a bar on a terminal, else one line per phase."""

from __future__ import annotations

from tierlm.progress import Progress, ProgressFactory


def progress_factory() -> ProgressFactory:
    """Returns `start(label) -> update(done, total)`.

    On a terminal each phase shows a transient bar; when stderr is a pipe or a log file, a phase
    that runs prints one line with its duration when it ends, so a slow start is never silent.
    """
    import sys
    import time

    from rich.console import Console
    from rich.progress import BarColumn, Progress as RichProgress, TaskProgressColumn, TextColumn

    console = Console(stderr=True)
    # Phases are created up front but run one after another: a phase starts when it was
    # created or when the previous one ended, whichever is later.
    clock = {"last_end": time.perf_counter()}

    def start(label: str) -> Progress:
        state: dict = {"created": time.perf_counter()}

        def update(done: int, total: int) -> None:
            state.setdefault("began", max(state["created"], clock["last_end"]))
            if not sys.stderr.isatty():
                if done >= total and not state.get("reported"):
                    state["reported"] = True
                    clock["last_end"] = time.perf_counter()
                    print(f"{label}: done in {clock['last_end'] - state['began']:.1f} s", file=sys.stderr, flush=True)
                return
            if "bar" not in state:
                bar = RichProgress(
                    TextColumn(label), BarColumn(), TaskProgressColumn(), console=console, transient=True
                )
                bar.start()
                state["bar"], state["task"] = bar, bar.add_task(label, total=total)
            state["bar"].update(state["task"], completed=done, total=total)
            if done >= total:
                clock["last_end"] = time.perf_counter()
                state.pop("bar").stop()

        return update

    return start
