"""Long phases are never silent: on a piped stderr a phase says what it is as it starts (what, on
which model, why now), how far it is at most every interval (and, while its job reports, at least
as often), and when it ends. Through the real commands: convert (with mixed:SIZE's calibration),
import-gguf, and the one-time kernel build of a CPU load."""

from __future__ import annotations

import re
import stat

import pytest

from tests.cli_runner import run_tierlm
from tests.tiny import make_model


class StepClock:
    """A clock that moves `step` seconds at every reading."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def every_report(monkeypatch, tmp_path):
    """The CLI's progress with a clock that moves one interval per reading, so every report of a
    running phase is a line (the real interval is 10 s; no test waits for it); in a private cache,
    since artifacts and imports are keyed by content: an earlier test's build of the same tiny
    model would be reused without a phase to report."""
    from tierlm.cli import progress

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "private-cache"))
    real = progress.progress_factory
    monkeypatch.setattr(progress, "progress_factory", lambda: real(interval_s=10.0, clock=StepClock(10.0)))


def _phase_lines(stderr: str, label: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(label)]


def _counts(lines: list[str], label: str, unit: str) -> list[tuple[int, int]]:
    """(done, total) of each how-far line of the phase `label` counting `unit`."""
    found = [re.fullmatch(rf"{re.escape(label)}: (\d+)/(\d+) {unit} \((\d+)%\), \d+ s", line) for line in lines[1:-1]]
    assert all(found), lines
    for match in found:
        done, total, percent = map(int, match.groups())
        assert percent == 100 * done // total
    return [(int(m.group(1)), int(m.group(2))) for m in found]


def test_a_piped_phase_says_it_starts_how_far_it_is_at_most_every_interval_and_when_it_ends(capsys):
    from tierlm.cli.progress import progress_factory
    from tierlm.progress import BYTES

    now = [0.0]
    start = progress_factory(interval_s=10.0, clock=lambda: now[0])
    convert = start("converting m (int8, one-time)", "blocks")
    for done, at in [(0, 1.0), (1, 4.0), (2, 10.9), (3, 11.0), (4, 16.0), (5, 21.4), (6, 22.0)]:
        now[0] = at
        convert(done, 6)
    convert(6, 6)  # a repeated end says nothing more
    gguf = start("importing x.gguf (one-time)", BYTES)
    now[0] = 30.0
    gguf(0, 3 * 2**20)
    now[0] = 42.0
    gguf(3 * 2**19, 3 * 2**20)
    now[0] = 43.0
    gguf(3 * 2**20, 3 * 2**20)
    build = start("building the int8 kernels for this CPU (one-time, ~35 s)")
    now[0] = 50.0
    build(0, 1)
    now[0] = 60.0
    build(0, 1)  # the compiler still runs
    now[0] = 65.0
    build(1, 1)
    # First heard of after some of its work: it began when the phase before it ended.
    loading = start("loading weights")
    now[0] = 68.0
    loading(2, 2)
    assert capsys.readouterr().err.splitlines() == [
        "converting m (int8, one-time): 6 blocks",
        "converting m (int8, one-time): 3/6 blocks (50%), 10 s",
        "converting m (int8, one-time): 5/6 blocks (83%), 20 s",
        "converting m (int8, one-time): done in 21.0 s",
        "importing x.gguf (one-time): 3.0 MiB",
        "importing x.gguf (one-time): 1.5/3.0 MiB (50%), 12 s",
        "importing x.gguf (one-time): done in 13.0 s",
        "building the int8 kernels for this CPU (one-time, ~35 s)",
        "building the int8 kernels for this CPU (one-time, ~35 s): 10 s",
        "building the int8 kernels for this CPU (one-time, ~35 s): done in 15.0 s",
        "loading weights",
        "loading weights: done in 3.0 s",
    ]


def _blocks(model_dir) -> int:
    from tierlm.models import family_description, read_config

    config = read_config(model_dir)
    return len(family_description(config).checkpoint_layout(config))


def test_convert_announces_its_phase_and_reports_every_block(tmp_path, every_report):
    make_model(tmp_path / "m")
    result = run_tierlm("convert", "--model", str(tmp_path / "m"), "--quant", "int8")  # stderr is a pipe, no tty
    assert result.returncode == 0, result.stderr
    label, blocks = "converting m (int8, one-time)", _blocks(tmp_path / "m")
    lines = result.stderr.splitlines()
    assert lines[0] == f"{label}: {blocks} blocks"
    assert re.fullmatch(rf"{re.escape(label)}: done in \d+\.\d s", lines[-1])
    counts = _counts(lines, label, "blocks")
    assert {done for done, _ in counts} == set(range(blocks)) and {total for _, total in counts} == {blocks}
    assert [done for done, _ in counts] == sorted(done for done, _ in counts)
    # Done once: the cached artifact is reused without a word.
    again = run_tierlm("convert", "--model", str(tmp_path / "m"), "--quant", "int8")
    assert again.returncode == 0 and again.stderr == "" and again.stdout == result.stdout


def test_a_mixed_conversion_reports_its_calibration_block_by_block(tmp_path, every_report):
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.mixed_estimate import mixed_floor
    from tierlm.models import read_config
    from tierlm.quant.modes import mode_text, parse_quant_mode

    make_model(tmp_path / "m", hidden=128, intermediate=256, layers=3)
    quant = f"mixed:{2 * mixed_floor(read_config(tmp_path / 'm'))}"
    result = run_tierlm("convert", "--model", str(tmp_path / "m"), "--quant", quant)
    assert result.returncode == 0, result.stderr
    blocks, why = _blocks(tmp_path / "m"), f"{mode_text(parse_quant_mode(quant))}, one-time"
    calibrating = f"calibrating m on 512 tokens ({why})"
    choosing = f"choosing int4 or int8 per weight of m ({why})"
    converting = f"converting m ({why})"
    labels = [line.split(": ")[0] for line in result.stderr.splitlines()]
    # The phases run one after another, each announced as it starts.
    assert list(dict.fromkeys(labels)) == [calibrating, choosing, converting], result.stderr
    lines = _phase_lines(result.stderr, calibrating)
    assert lines[0] == f"{calibrating}: {blocks} blocks" and " done in " in lines[-1]
    # Which block the forward has reached, of how many: each one as it goes.
    assert [done for done, _ in _counts(lines, calibrating, "blocks")] == list(range(blocks))
    lines = _phase_lines(result.stderr, choosing)
    weights = int(re.fullmatch(rf"{re.escape(choosing)}: (\d+) weights", lines[0]).group(1))
    assert [done for done, _ in _counts(lines, choosing, "weights")] == list(range(1, weights))  # 0: the start line
    assert Artifact.open(result.stdout.strip()).manifest["mixed"]["sensitivity"].startswith("activations")


def test_import_gguf_reports_bytes(tmp_path, every_report):
    from tests.test_gguf_import import byte_level_vocab, tiny_hf_model, write_tiny_gguf

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, config)
    result = run_tierlm("import-gguf", str(tmp_path / "tiny.gguf"), env={"TIERLM_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    label = "importing tiny.gguf (one-time)"
    lines = _phase_lines(result.stderr, label)
    total = re.fullmatch(rf"{re.escape(label)}: (\d+\.\d) MiB", lines[0]).group(1)
    assert re.fullmatch(rf"{re.escape(label)}: done in \d+\.\d s", lines[-1])
    how_far = [re.fullmatch(rf"{re.escape(label)}: (\d+\.\d)/{total} MiB \((\d+)%\), \d+ s", line) for line in lines[1:-1]]
    assert how_far and all(how_far), lines
    assert [float(m.group(1)) for m in how_far] == sorted(float(m.group(1)) for m in how_far)


# A C++ compiler standing in for the real one: it answers --version, runs 1.5 s (longer than the
# build's 1 s poll, so the build reports while it runs), and writes the machine's real library
# (or, on a machine without a compiler, bytes no loader accepts, as a failed build would leave none).
FAKE_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "stand-in c++ 1.0"; exit 0; fi
sleep 1.5
for output; do :; done
if [ -n "$REAL_LIBRARY" ]; then cp "$REAL_LIBRARY" "$output"; else echo "not a library" > "$output"; fi
"""


def test_a_cpu_load_builds_the_kernels_as_a_phase_of_its_own(tmp_path, every_report):
    from tierlm.quant.kernel_api import KernelUnavailable
    from tierlm.quant.native import BUILD_RECORD, FIRST_BUILD_GUESS_S, built_library

    try:
        real = str(built_library())  # the machine's, built once for every test (tests/conftest.py)
    except KernelUnavailable:
        real = ""
    compiler = tmp_path / "c++"
    compiler.write_text(FAKE_COMPILER)
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    make_model(tmp_path / "m")
    env = {"CXX": str(compiler), "TIERLM_KERNELS": str(tmp_path / "kernels"), "REAL_LIBRARY": real}
    args = ("generate", "the quick", "--raw", "--model", str(tmp_path / "m"), "--quant", "none", "-t", "0", "-n", "2")
    result = run_tierlm(*args, env=env)
    assert result.returncode == 0, result.stderr
    label = f"building the int8 kernels for this CPU (one-time, ~{FIRST_BUILD_GUESS_S} s)"
    lines = result.stderr.splitlines()
    built = _phase_lines(result.stderr, label)
    assert lines[: len(built)] == built  # the first phase of the load, not hidden in a later one
    assert built[0] == label and re.fullmatch(rf"{re.escape(label)}: done in \d+\.\d s", built[-1])
    assert len(built) >= 3 and all(re.fullmatch(rf"{re.escape(label)}: \d+ s", line) for line in built[1:-1]), built
    assert (tmp_path / "kernels" / BUILD_RECORD).is_file()  # the next build's estimate
    again = run_tierlm(*args, env=env)
    assert again.returncode == 0 and "building" not in again.stderr  # one-time
