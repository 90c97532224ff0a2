"""`tierlm ARGS` run in this process, answering as `subprocess.run([python, -m, tierlm, ...])` does.

A subprocess costs a Python start and a torch import (seconds on a busy 2-core machine); a test
that only reads what the CLI prints and its exit status gets the same answer here. The command
runs through `tierlm.cli.app.main` (so a user error is its one `error:` line and exit status 1,
as in a real process) under typer's CliRunner isolation: stdin is `stdin`, stdout and stderr are
captured apart, Python's default warning filters apply and a warning is printed to stderr, an
uncaught exception prints its traceback to stderr with exit status 1. What a command changes in
the process (torch's thread count, the environment, the working directory) is put back.

Keep a real process (and mark the test `e2e`) for what needs one: a pty, signals, memory caps
or the peak RSS of the run, cgroups, server processes, pipelines and what is imported at start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from unittest import mock

from typer.testing import CliRunner, formatting  # typer's own copy of click's formatting

# A long phase's lines on a piped stderr (tierlm/cli/progress.py): its start, how far it is, its
# end. A failing command may print them before its one error line.
PROGRESS_LINE = re.compile(r"(importing|converting|calibrating|choosing|building|loading) .*")

# What `python -W default`-less CPython installs at start (sys.warnoptions empty).
_DEFAULT_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)


def run_tierlm(*args: str, stdin: str = "", env: dict[str, str] | None = None,
               cwd: Path | str | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `tierlm *args` in-process: a CompletedProcess with returncode, stdout and stderr.

    `env` holds overrides of the current environment (a real child would inherit the rest).
    """
    from tierlm.cli import app as cli

    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    code = 0
    runner = CliRunner()
    # Help is as wide as a child with a piped stdout makes it: $COLUMNS, else shutil's fallback 80
    # (the isolation would force 80 whatever $COLUMNS says).
    env = {"COLUMNS": os.environ.get("COLUMNS", "80"), **(env or {})}
    try:
        with runner.isolation(input=stdin, env=env) as (out, err, _):
            formatting.FORCED_WIDTH = None  # put back by the isolation
            sys.argv = ["tierlm", *args]
            if cwd is not None:
                os.chdir(cwd)
            with warnings.catch_warnings(), mock.patch.object(cli, "_exit", _exit):
                warnings.resetwarnings()
                for action, category, module in reversed(_DEFAULT_FILTERS):
                    warnings.filterwarnings(action, category=category, module=module or "")
                warnings.showwarning = _show_on_stderr
                try:
                    cli.main()
                except SystemExit as done:
                    code = _status(done.code)
                except BaseException:  # noqa: BLE001 - what the interpreter does with it
                    traceback.print_exc()
                    code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            stdout = out.getvalue().decode("utf-8", "replace")
            stderr = err.getvalue().decode("utf-8", "replace")
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        if dict(os.environ) != saved_env:
            os.environ.clear()
            os.environ.update(saved_env)
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["tierlm", *args], code, stdout, stderr)


def on_a_terminal(args: list[str], answer: str) -> subprocess.CompletedProcess:
    """Run `python -m tierlm ARGS` (a real process) with a pseudo-terminal as stdin, type `answer`
    at its prompt; stdout and stderr are captured apart."""
    import pty

    primary, secondary = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "tierlm", *args], stdin=secondary,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    os.close(secondary)
    try:
        os.write(primary, answer.encode())
        out, err = child.communicate(timeout=120)
    finally:
        os.close(primary)
    return subprocess.CompletedProcess(args, child.returncode, out, err)


def _exit(code) -> None:
    """`tierlm.cli.app._exit` without its `os._exit` branch (that one ends a pipeline's process)."""
    sys.exit(code)


def _status(code) -> int:
    """The exit status a process gets from `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
