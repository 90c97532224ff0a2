"""Models by name: the catalogue's names and their resolution, `chat NAME`, `tierlm list` and
`show`, content-keyed GGUF imports, `cache rm --all` and `--version`.

Each test gets a private cache holding imports of a tiny GGUF (written once per module); the
one test of the embedded model itself uses the session's shared cache, where it is imported once.
The CLI runs in this process (tests/cli_runner.py) but where a terminal or a fresh interpreter
is the point.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runner import on_a_terminal, run_tierlm
from tests.test_gguf_import import byte_level_vocab, tiny_hf_model, write_tiny_gguf
from tierlm.cache import catalog
from tierlm.cache.artifact import FORMAT_VERSION
from tierlm.errors import TierlmError
from tierlm.runtime.session import resolve_model_dir
from tierlm.weights import embedded, gguf_import

TINY = "tiny-chat.q8_0"  # the name Tiny-Chat.Q8_0.gguf answers to


def tierlm(*args: str, stdin: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_tierlm(*args, stdin=stdin, cwd=cwd)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama GGUFs: `tiny` (Tiny-Chat.Q8_0.gguf), a byte copy under another name, and a
    different model under the same file name in another folder."""
    folder = tmp_path_factory.mktemp("ggufs")
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    (folder / "a").mkdir()
    (folder / "b").mkdir()
    write_tiny_gguf(folder / "a" / "Tiny-Chat.Q8_0.gguf", model, config)
    shutil.copyfile(folder / "a" / "Tiny-Chat.Q8_0.gguf", folder / "b" / "copy.gguf")
    other, other_config = tiny_hf_model("llama", True, vocab_size=len(tokens))  # tied: other bytes
    (folder / "c").mkdir()
    write_tiny_gguf(folder / "c" / "Tiny-Chat.Q8_0.gguf", other, other_config)
    return {
        "tiny": folder / "a" / "Tiny-Chat.Q8_0.gguf",
        "copy": folder / "b" / "copy.gguf",
        "same_name": folder / "c" / "Tiny-Chat.Q8_0.gguf",
    }


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private, empty cache for this test and the processes it starts (the compiled kernels
    live in $TIERLM_KERNELS, which tests/conftest.py shares across every test and run)."""
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("TIERLM_CACHE", str(root))
    return root


@pytest.fixture
def pinned_bandwidths(cache):
    """Fixed bandwidths wherever a CLI child may look for its probe (the path is keyed on the
    thread count), so no test measures the machine."""
    pin_bandwidths()


def pin_bandwidths() -> None:
    """Fixed bandwidths in the current cache for every thread count a run may use."""
    import torch

    from tests.test_planner import CPU
    from tierlm.probe.record import save_bandwidths

    threads = torch.get_num_threads()
    try:
        for count in range(1, (os.cpu_count() or 1) + 1):
            torch.set_num_threads(count)
            save_bandwidths(CPU, "cpu")
    finally:
        torch.set_num_threads(threads)


def entries(cache: Path, folder: str) -> list[str]:
    root = cache / folder
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def build_int8(model_dir: Path) -> Path:
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    return ensure_artifact(ConversionRequest(model_dir, (), "int8"))


# ----------------------------------------------------------------------------- content-keyed imports


def test_one_gguf_reached_by_three_routes_is_one_cache_entry(cache, ggufs):
    first = embedded.import_gguf_to_cache(ggufs["tiny"])  # `tierlm import-gguf FILE`
    assert first.parent == cache / "models" and re.fullmatch(rf"{re.escape(TINY)}-[0-9a-f]{{12}}", first.name)
    assert resolve_model_dir(str(ggufs["tiny"])) == first  # `--model FILE`
    assert resolve_model_dir(str(ggufs["copy"])) == first  # the same bytes at another path and name
    shown = tierlm("import-gguf", str(ggufs["copy"]))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == str(first) and f"already in the cache as {TINY}" in shown.stderr
    assert entries(cache, "models") == [first.name]
    assert catalog.model_name(first) == TINY  # the first import's file name, not the copy's

    different = embedded.import_gguf_to_cache(ggufs["same_name"])  # same file name, other bytes
    assert different != first and entries(cache, "models") == sorted([first.name, different.name])


def test_imports_under_older_directory_names_are_reused(cache, ggufs, monkeypatch):
    new = embedded.import_gguf_to_cache(ggufs["tiny"])
    legacy = new.with_name("Tiny-Chat.Q8_0-" + new.name.rsplit("-", 1)[1])  # the per-route naming of old
    new.rename(legacy)

    def no_reimport(*args, **kwargs):
        raise AssertionError("an existing import of the same content was imported again")

    monkeypatch.setattr(gguf_import, "import_gguf", no_reimport)
    assert embedded.import_gguf_to_cache(ggufs["copy"]) == legacy
    assert catalog.resolve_model(TINY) == legacy and catalog.model_name(legacy) == TINY
    # Two copies left by an older tierlm: one name, resolved to the copy imports reuse, and noted.
    shutil.copytree(legacy, legacy.with_name("tiny-copy-" + legacy.name.rsplit("-", 1)[1]))
    assert catalog.resolve_model(TINY) == embedded.import_gguf_to_cache(ggufs["tiny"])
    listing = tierlm("list")
    assert "holds the same GGUF as" in listing.stdout and "tierlm cache rm" in listing.stdout


@pytest.mark.slow
def test_embedded_model_is_one_entry_named_smollm2():
    """The embedded default, `import-gguf` of its file and the name `smollm2` share one import."""
    model_dir = embedded.ensure_embedded_model()  # the session cache: imported once for all tests
    assert embedded.import_gguf_to_cache(embedded.embedded_gguf_path()) == model_dir
    assert resolve_model_dir("smollm2") == model_dir == resolve_model_dir(None)
    assert resolve_model_dir("SmolLM2") == model_dir
    assert catalog.model_name(model_dir) == "smollm2"
    gguf = embedded.embedded_gguf_path()
    key = embedded.gguf_content_key(gguf)
    # A renamed copy is recognised by content; another file of the same size is not.
    assert embedded.import_name("renamed.gguf", key, gguf.stat().st_size) == "smollm2"
    assert embedded.import_name("renamed.gguf", "0" * 16, gguf.stat().st_size) == "renamed"
    models = [p for p in model_dir.parent.iterdir() if not p.name.startswith(".")]
    same = [p for p in models if (p / "tierlm-import.json").is_file()
            and json.loads((p / "tierlm-import.json").read_text())["source_key"] == key]  # fmt: skip
    assert same == [model_dir]


# ----------------------------------------------------------------------------- names


def test_names_resolve_case_insensitively_and_by_directory(cache, ggufs):
    model_dir = embedded.import_gguf_to_cache(ggufs["tiny"])
    artifact = build_int8(model_dir)
    assert catalog.resolve_model(TINY) == model_dir
    assert catalog.resolve_model(TINY.upper()) == model_dir
    assert catalog.resolve_model(f"{TINY}:int8") == artifact
    assert catalog.model_name(artifact) == f"{TINY}:int8"
    assert catalog.resolve_model(artifact.name) == artifact  # the `cache list` name
    assert catalog.resolve_model(str(artifact)) == artifact  # an artifact directory as a path


def test_artifact_names_say_quant_and_adapters(tmp_path):
    base = tmp_path / "My Model"
    base.mkdir()
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "source": str(base), "quant": "int8-g128",
        "adapters": [[str(tmp_path / "Chat-LoRA"), 1.0], [str(tmp_path / "style"), 0.5]],
    }))  # fmt: skip
    assert catalog.model_name(art) == "my-model:int8-g128+chat-lora+style@0.5"
    shutil.rmtree(base)  # a base that is gone keeps its directory name, less an import's key suffix
    (art / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "source": str(tmp_path / "smollm2-0123456789ab"), "quant": "int8"}))
    assert catalog.model_name(art) == "smollm2:int8"


def test_unknown_and_ambiguous_names_are_errors_that_list_the_choices(cache, ggufs, tmp_path, monkeypatch):
    first = embedded.import_gguf_to_cache(ggufs["tiny"])
    with pytest.raises(TierlmError) as unknown:
        catalog.resolve_model("llama3")
    message = str(unknown.value)
    assert "no model named 'llama3'" in message and f"known: smollm2, {TINY}" in message
    assert "tierlm import-gguf FILE" in message

    second = embedded.import_gguf_to_cache(ggufs["same_name"])  # another model, the same name
    with pytest.raises(TierlmError, match=rf"the name '{re.escape(TINY)}' fits 2 models") as ambiguous:
        catalog.resolve_model(TINY)
    assert first.name in str(ambiguous.value) and second.name in str(ambiguous.value)
    assert catalog.resolve_model(second.name) == second  # the directory name picks one

    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a name that is also a path here
    with pytest.raises(TierlmError, match="both a model name and a path"):
        catalog.resolve_model("smollm2")
    assert catalog.resolve_model("./smollm2") == Path("./smollm2")
    with pytest.raises(TierlmError, match="not found"):
        catalog.resolve_model("./nothing-here")


# ----------------------------------------------------------------------------- the command line


def test_chat_takes_the_model_as_its_first_argument(cache, ggufs, pinned_bandwidths):
    embedded.import_gguf_to_cache(ggufs["tiny"])
    assert tierlm("list").stdout.splitlines()[1].endswith("never")
    common = ["-t", "0", "-n", "4", "--quant", "int8"]
    by_name = tierlm("chat", TINY, *common, stdin="hello\n")
    assert by_name.returncode == 0, by_name.stderr
    assert tierlm("list").stdout.splitlines()[1].endswith("just now")  # the use is recorded
    by_option = tierlm("chat", "--model", TINY, *common, stdin="hello\n")
    assert by_option.returncode == 0 and by_option.stdout == by_name.stdout and by_name.stdout.strip()

    both = tierlm("chat", TINY, "--model", TINY, stdin="hello\n")
    assert both.returncode == 1 and "the model is given twice" in both.stderr and "Traceback" not in both.stderr
    unknown = tierlm("chat", "no-such-model", stdin="hello\n")
    assert unknown.returncode == 1 and "no model named 'no-such-model'" in unknown.stderr
    assert f"known: smollm2, {TINY}" in unknown.stderr and "import-gguf" in unknown.stderr


def test_list_is_a_table_with_a_total(cache, ggufs, tmp_path):
    from tests.tiny import make_model
    from tierlm.profile import format_size

    model_dir = embedded.import_gguf_to_cache(ggufs["tiny"])
    artifact = build_int8(model_dir)
    outside = tmp_path / "Outside-Model"
    make_model(outside)
    outside_artifact = build_int8(outside)  # an HF directory outside the cache shows through its artifact

    listing = tierlm("list")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "PARAMETERS", "SOURCE", "GGUF", "VARIANTS", "SIZE", "LAST", "USED"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {TINY, "outside-model"}
    tiny_params = catalog.parameter_count(model_dir)
    assert 90_000 < tiny_params < 100_000
    gguf_size = re.escape(format_size(ggufs["tiny"].stat().st_size))
    assert re.search(rf"^{re.escape(TINY)}\s+llama\s+{tiny_params / 1e3:.1f}K\s+gguf Tiny-Chat.Q8_0.gguf\s+{gguf_size}\s+int8\s",
                     rows[TINY])  # fmt: skip
    assert rows[TINY].endswith("never") and re.search(rf"dir {re.escape(str(outside))}\s+-\s+int8", rows["outside-model"])
    total = sum(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in (model_dir, artifact, outside_artifact))

    assert lines[-1] == f"2 models, 2 variants, {format_size(total)} in {cache}"

    old = tierlm("cache", "list")  # still one line per entry, by directory name, now with the name
    assert old.returncode == 0 and f"{artifact.name}  ({TINY}:int8)" in old.stdout
    assert f"{model_dir.name}  ({TINY})" in old.stdout and len(old.stdout.splitlines()) == 3


def test_list_on_an_empty_cache_says_how_to_add_a_model(cache):
    result = tierlm("list")
    assert result.returncode == 0 and "no models" in result.stdout and "import-gguf" in result.stdout


def test_show_prints_config_template_artifacts_and_plan(cache, ggufs, pinned_bandwidths):
    import gguf

    model_dir = embedded.import_gguf_to_cache(ggufs["tiny"])
    artifact = build_int8(model_dir)
    shown = tierlm("show", TINY, "--device", "cpu")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    for expected in (f"name        {TINY}\n", "family      llama\n", "layers      2\n", "hidden      64 (intermediate 96)\n",
                     "heads       4 query, 2 key/value, head_dim 16\n", f"vocab       {len(byte_level_vocab()[0])}\n",
                     "context     256\n", "template    chat template present:\n  {% for m in messages %}",
                     f"gguf        F32 x {len(gguf.GGUFReader(ggufs['tiny']).tensors)} (",
                     f"  {TINY}:int8", artifact.name, "plan under the 24gb profile:", "layers.0-1", "decode"):  # fmt: skip
        assert expected in out, expected
    missing = tierlm("show", "nope")
    assert missing.returncode == 1 and "no model named 'nope'" in missing.stderr


def test_version():
    from tierlm import __version__

    for flag in ("--version", "-V"):
        result = tierlm(flag)
        assert result.returncode == 0 and result.stdout == f"tierlm {__version__}\n"


# ----------------------------------------------------------------------------- cache rm


def locks_and_leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob(".*"))


@pytest.mark.e2e
def test_cache_rm_all_asks_first_and_leaves_no_locks(cache, ggufs):
    model_dir = embedded.import_gguf_to_cache(ggufs["tiny"])
    build_int8(model_dir)
    catalog.mark_used(model_dir)
    (cache / "models" / f".{model_dir.name}.partial-999999").mkdir()  # a killed build's leftover
    assert any(name.endswith(".lock") for name in locks_and_leftovers(cache))

    piped = tierlm("cache", "rm", "--all")  # stdin is not a terminal: refuse rather than hang
    assert piped.returncode == 1 and "--yes" in piped.stderr and entries(cache, "models") == [model_dir.name]

    assert answer_on_a_terminal(["cache", "rm", "--all"], "n\n") != 0
    assert entries(cache, "models") == [model_dir.name] and len(entries(cache, "artifacts")) == 1
    assert answer_on_a_terminal(["cache", "rm", "--all"], "y\n") == 0
    assert entries(cache, "models") == [] and entries(cache, "artifacts") == []
    assert locks_and_leftovers(cache) == [] and not (cache / "usage").exists()

    embedded.import_gguf_to_cache(ggufs["tiny"])
    forced = tierlm("cache", "rm", "--all", "-y")
    assert forced.returncode == 0, forced.stderr
    assert entries(cache, "models") == [] and locks_and_leftovers(cache) == []


def answer_on_a_terminal(args: list[str], answer: str) -> int:
    """Run tierlm with a pseudo-terminal as stdin, type `answer` at its prompt; its exit status."""
    done = on_a_terminal(args, answer)
    assert "Remove all 2 cache entries" in done.stdout, (done.stdout, done.stderr)
    return done.returncode


def test_cache_rm_by_name_and_a_build_in_progress(cache, ggufs):
    import fcntl

    from tierlm.cache.entries import remove_entries

    model_dir = embedded.import_gguf_to_cache(ggufs["tiny"])
    artifact = build_int8(model_dir)
    with open(model_dir.parent / f".{model_dir.name}.lock", "a") as held:  # as a builder holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(TierlmError, match="being built by another tierlm process; nothing was removed"):
            remove_entries([artifact.name, model_dir.name])
    assert entries(cache, "artifacts") == [artifact.name] and entries(cache, "models") == [model_dir.name]

    removed = tierlm("cache", "rm", f"{TINY}:int8")  # a catalogue name works as well
    assert removed.returncode == 0 and f"removed {artifact.name}" in removed.stderr
    assert entries(cache, "artifacts") == [] and entries(cache, "models") == [model_dir.name]
    assert not list((cache / "artifacts").glob(".*.lock"))
    unknown = tierlm("cache", "rm", "nope")
    assert unknown.returncode == 1 and "no cache entry named 'nope'" in unknown.stderr


@pytest.mark.e2e
def test_naming_modules_do_not_import_torch():
    code = "import sys, tierlm.cli.app, tierlm.cache.catalog, tierlm.cli.models; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
