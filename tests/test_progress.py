"""Long phases are never silent: a piped stderr gets one line per phase with its duration."""

from __future__ import annotations

import re
import time

from tests.cli_runner import run_tierlm
from tests.tiny import make_model


def test_piped_phases_print_one_timed_line_each(capsys):
    from tierlm.cli.progress import progress_factory

    start = progress_factory()
    first, second, never_run = start("importing"), start("loading weights"), start("converting")
    for done in range(1, 4):
        time.sleep(0.02)
        first(done, 3)
    first(3, 3)  # a repeated final call must not print a second line
    second(1, 1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"importing: done in \d+\.\d s", lines[0])
    assert float(lines[0].split()[-2]) >= 0.0
    # The second phase starts where the first ended, not when it was created.
    assert re.fullmatch(r"loading weights: done in 0\.\d s", lines[1])
    del never_run


def test_convert_reports_its_phase_on_a_piped_stderr(tmp_path):
    make_model(tmp_path)
    result = run_tierlm("convert", "--model", str(tmp_path), "--quant", "int8")  # stderr is a pipe, no tty
    assert result.returncode == 0, result.stderr
    assert re.search(r"^converting: done in \d+\.\d s$", result.stderr, re.M), result.stderr
