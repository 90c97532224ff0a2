"""Help is one consistent source: every command's help, the README and errors list the same quant
modes, flags show no type placeholder, and the command list never cuts a sentence short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli_runner import run_tierlm
from tierlm.quant.modes import MODE_NAMES

COMMANDS = ["chat", "generate", "run", "convert", "list", "show", "import-gguf", "rm", "ps", "pull", "profiles", "plan",
            "bench", "serve", "doctor", "cache", "cache list", "cache rm", "cache verify"]  # fmt: skip
WITH_QUANT = ["chat", "generate", "run", "convert", "plan", "bench", "serve"]
README = Path(__file__).resolve().parents[1] / "README.md"


def help_text(command: str, columns: int = 80) -> str:
    done = run_tierlm(*command.split(), "--help", env={"COLUMNS": str(columns)})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return {command: help_text(command) for command in ["", *COMMANDS]}


def test_every_command_lists_the_same_quant_modes(helps):
    for command in WITH_QUANT:
        flat = " ".join(helps[command].split())  # help wraps lines anywhere
        for mode in MODE_NAMES:
            assert re.search(rf"(?<![\w-]){re.escape(mode)}(?![\w-])", flat), f"{command} --help lacks {mode}"


@pytest.mark.slow
def test_the_readme_and_the_error_list_the_same_modes():
    readme = README.read_text()
    error = run_tierlm("plan", "--quant", "int7").stderr
    for mode in MODE_NAMES:
        assert f"`{mode}`" in readme, f"README does not document quant mode {mode}"
        assert re.search(rf"(?<![\w-]){re.escape(mode)}(?![\w-])", error), f"the error omits {mode}"


def test_flags_have_no_type_placeholder(helps):
    for command, text in helps.items():
        assert "<bool>" not in text, f"`tierlm {command} --help` shows a <bool> placeholder"


@pytest.mark.parametrize("columns", [80, 200])
def test_the_command_lists_never_cut_a_sentence(columns):
    for group in ("", "cache"):
        listing = help_text(group, columns).split("Commands:", 1)[1]
        assert "..." not in listing, listing
        assert all(line.rstrip().endswith(".") for line in listing.strip().splitlines()), listing


def test_the_readme_documents_every_command_and_option(helps):
    readme = README.read_text()
    for command in COMMANDS:
        assert f"tierlm {command}" in readme or f"run {command}" in readme, f"README never shows `tierlm {command}`"
        for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", helps[command]):
            if option != "--help":
                assert option in readme, f"README does not document `tierlm {command} {option}`"
