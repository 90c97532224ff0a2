"""Cache integrity (issue 11): GGUF imports keyed by the whole file, a read-only cache, a full
disk, a bad config.json refused before hashing, and stale partial builds.

A read-only cache is real, not simulated: as root (where chmod stops nothing) the CLI runs in a
private mount namespace with the cache bind-mounted read-only; otherwise the cache is chmodded
a-w. A full disk is injected at the build's write (in-process) and, where a tmpfs can be
mounted, met for real.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_gguf_import import byte_level_vocab, tiny_hf_model, write_tiny_gguf
from tests.test_models_by_name import build_int8, cache, pinned_bandwidths  # noqa: F401
from tierlm import atomic, digests
from tierlm.cache import catalog
from tierlm.cache.entries import remove_entries, stale_builds
from tierlm.errors import TierlmError
from tierlm.runtime.source import resolve_model_dir
from tierlm.weights import embedded
from tierlm.weights.gguf_import import RECORD_NAME, gguf_content_key

MiB = 1 << 20
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
EDITED = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_sep|>{% endfor %}"  # same length
ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def aged(path: Path) -> Path:
    """Date `path` an hour back: older than digests.SETTLE_NS, so its digest is remembered."""
    past = time.time() - 3600
    os.utime(path, (past, past))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(folder / "Tiny-Chat.Q8_0.gguf", model, config)
    return aged(folder / "Tiny-Chat.Q8_0.gguf")


@pytest.fixture(scope="module")
def padded_gguf(tmp_path_factory) -> Path:
    """A 13 MiB tiny GGUF whose chat template lies at ~1.2 MiB, between the regions the old
    sampled key read (metadata padding before and after it)."""
    import gguf

    folder = tmp_path_factory.mktemp("padded")
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    original = gguf.GGUFWriter.add_chat_template

    def padded(self, template):
        self.add_description("x" * (MiB + MiB // 5))
        original(self, template)
        self.add_license("y" * (12 * MiB))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_chat_template", padded)
        write_tiny_gguf(folder / "padded.gguf", model, config)
    return folder / "padded.gguf"


def sampled_windows(size: int) -> list[tuple[int, int]]:
    """The byte ranges the old content key (IMPORT_FORMAT_VERSION < 3) read."""
    offsets = sorted({0, *(size * i // 8 for i in range(1, 8)), max(0, size - MiB)})
    return [(offset, offset + MiB) for offset in offsets]


def template_of(model_dir: Path) -> str:
    return json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]


# ----------------------------------------------------------------------------- the content key


def test_gguf_edited_in_place_is_imported_afresh(cache, padded_gguf, tmp_path):
    gguf_file = tmp_path / "model.gguf"
    shutil.copyfile(padded_gguf, gguf_file)
    first = embedded.import_gguf_to_cache(aged(gguf_file))
    assert template_of(first) == TEMPLATE

    data = gguf_file.read_bytes()
    at = data.index(TEMPLATE.encode())
    # The edit lies where the sampled key never looked: that key would have returned `first`.
    assert not any(lo < at + len(TEMPLATE) and at < hi for lo, hi in sampled_windows(len(data)))
    with gguf_file.open("r+b") as handle:  # in place: same size, same inode
        handle.seek(at)
        handle.write(EDITED.encode())
    assert gguf_file.stat().st_size == len(data)

    second = resolve_model_dir(str(gguf_file))  # --model FILE: imported afresh
    assert second != first and template_of(second) == EDITED
    assert not first.exists()  # replaced: the file's name means the new import alone
    assert catalog.resolve_model(str(gguf_file)) == second


def test_unchanged_gguf_is_not_hashed_again(cache, tiny_gguf, tmp_path, monkeypatch):
    tiny_gguf = aged(Path(shutil.copy2(tiny_gguf, tmp_path / "tiny.gguf")))
    hashed = []
    real_hash = digests.hash_file
    monkeypatch.setattr(digests, "hash_file", lambda path: hashed.append(path) or real_hash(path))
    model_dir = embedded.import_gguf_to_cache(tiny_gguf)
    assert hashed == [tiny_gguf.resolve()]
    memo = digests.digest_memo_path(tiny_gguf)
    assert json.loads(memo.read_text())["sha256"] == real_hash(tiny_gguf)

    hashed.clear()
    assert embedded.import_gguf_to_cache(tiny_gguf) == model_dir  # a re-run: the remembered digest
    assert catalog.resolve_model(str(tiny_gguf)) == model_dir
    assert hashed == []

    os.utime(tiny_gguf)  # touched: the stamp changed, so the file is read again (and not yet remembered)
    assert embedded.import_gguf_to_cache(tiny_gguf) == model_dir and hashed == [tiny_gguf.resolve()]
    assert json.loads(memo.read_text())["stamp"]["mtime_ns"] != tiny_gguf.stat().st_mtime_ns


def test_imports_keyed_by_the_old_sampled_key_are_imported_afresh(cache, tiny_gguf):
    current = embedded.import_gguf_to_cache(tiny_gguf)
    old = current.with_name(current.name[:-12] + "0123456789ab")
    shutil.copytree(current, old)
    record = json.loads((old / RECORD_NAME).read_text())
    record.pop("source_path")  # format 2 did not record it
    (old / RECORD_NAME).write_text(json.dumps({**record, "format": 2, "source_key": "0123456789abcdef"}))
    shutil.rmtree(current)

    again = embedded.import_gguf_to_cache(tiny_gguf)
    assert again != old and json.loads((again / RECORD_NAME).read_text())["source_key"] == gguf_content_key(tiny_gguf)
    by_path = {entry.path: entry for entry in catalog.catalog()}
    assert not by_path[old].current and "other import format" in by_path[old].source
    assert catalog.resolve_model(catalog.model_name(again)) == again


# ----------------------------------------------------------------------------- conversion


def test_bad_config_is_refused_before_the_weights_are_hashed(cache, tmp_path, monkeypatch):
    from tests.tiny import make_model
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    model_dir = tmp_path / "bad-config"
    make_model(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -3}))

    def no_hashing(path):
        raise AssertionError(f"{path} was hashed before config.json was checked")

    monkeypatch.setattr(digests, "hash_file", no_hashing)
    with pytest.raises(TierlmError, match="num_hidden_layers"):
        ensure_artifact(ConversionRequest(model_dir, (), "int8"))


# ----------------------------------------------------------------------------- a full disk


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def hidden_leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob(".*") if ".partial-" in p.name or ".old-" in p.name)


def test_full_disk_during_import_is_one_line_and_leaves_nothing(cache, tiny_gguf, monkeypatch):
    from tierlm.weights import gguf_import

    # Config and tokenizer written; the receipt, written last, finds the disk full.
    write_json = gguf_import.write_json
    monkeypatch.setattr(gguf_import, "write_json", lambda path, doc: (no_space() if path.name == RECORD_NAME
                                                                       else write_json(path, doc)))  # fmt: skip
    with pytest.raises(TierlmError) as caught:
        embedded.import_gguf_to_cache(tiny_gguf)
    message = str(caught.value)
    assert "no space left" in message and "\n" not in message and "TIERLM_CACHE" in message
    assert [p for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []
    assert hidden_leftovers(cache) == []
    monkeypatch.undo()
    assert (embedded.import_gguf_to_cache(tiny_gguf) / RECORD_NAME).is_file()  # room again: it imports


def test_full_disk_during_conversion_is_one_line_and_leaves_nothing(cache, tiny_gguf, monkeypatch):
    from tierlm.cache.artifact import ArtifactWriter

    model_dir = embedded.import_gguf_to_cache(tiny_gguf)
    real_end_block = ArtifactWriter.end_block
    ended = []

    def end_block_then_full(self):
        real_end_block(self)
        ended.append(1)
        if len(ended) == 2:  # two blocks written, the third finds the disk full
            no_space()

    monkeypatch.setattr(ArtifactWriter, "end_block", end_block_then_full)
    with pytest.raises(TierlmError, match="no space left") as caught:
        build_int8(model_dir)
    assert "\n" not in str(caught.value) and len(ended) == 2
    assert not (cache / "artifacts").exists() or [p.name for p in (cache / "artifacts").iterdir()
                                                   if not p.name.endswith(".lock")] == []  # fmt: skip
    assert hidden_leftovers(cache) == []


def test_rust_writers_full_disk_errors_are_recognised():
    from safetensors import SafetensorError

    rust = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert atomic.refused_errno(rust) == errno.ENOSPC
    assert atomic.refused_errno(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    unreadable_source = PermissionError(errno.EACCES, "Permission denied", "/elsewhere/model.gguf")
    assert atomic.refused_write_error(unreadable_source, Path("/cache/models")) is None


def mount_namespaces_work() -> bool:
    if not ROOT or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.e2e
@pytest.mark.skipif(not mount_namespaces_work(), reason="needs root and mount namespaces to mount a small tmpfs")
def test_a_really_full_disk_during_import(tmp_path, tiny_gguf, monkeypatch):
    # A disk with room for half of what the import writes (config, tokenizer, receipt; no weights).
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "measure"))
    needed = sum(p.stat().st_size for p in embedded.import_gguf_to_cache(tiny_gguf).iterdir())
    size_kib = max(4, needed // 2 // 4096 * 4)
    mount = tmp_path / "small-disk"
    mount.mkdir()
    script = (f'mount -t tmpfs -o size={size_kib}k tmpfs "$1" && cd "$1" || exit 99; '
              '"$2" -m tierlm import-gguf "$3"; rc=$?; ls -a "$1"/models >&2; exit $rc')  # fmt: skip
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(mount), sys.executable, str(tiny_gguf)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TIERLM_CACHE": str(mount)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left" in errors[0] and "Traceback" not in done.stderr
    listing = done.stderr.splitlines()[done.stderr.splitlines().index(errors[0]) + 1:]
    assert [name for name in listing if name not in (".", "..") and not name.endswith(".lock")] == []


# ----------------------------------------------------------------------------- a read-only cache


@pytest.fixture
def read_only_tierlm(cache):
    """Run `tierlm ARGS` against `cache` made read-only for real (see the module docstring)."""
    if ROOT:
        if not mount_namespaces_work():
            pytest.skip("as root only a read-only mount stops writes, and mount namespaces are unavailable")
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" || exit 99; shift; exec "$@"'
        wrap = ["unshare", "-m", "sh", "-c", script, "sh", str(cache)]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(cache)], check=True)
        wrap = []

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*wrap, *args], capture_output=True, text=True, timeout=300)

    refused = run("sh", "-c", f'mkdir "{cache}/probe-write"')
    assert refused.returncode != 0 and not (cache / "probe-write").exists(), "the cache is still writable"
    yield lambda *args: run(sys.executable, "-m", "tierlm", *args)
    if not ROOT:
        subprocess.run(["chmod", "-R", "u+w", str(cache)], check=True)


def snapshot(cache: Path) -> dict[str, tuple[int, int]]:
    """Every path under the cache with its size and mtime (the kernels live in $TIERLM_KERNELS)."""
    return {str(p.relative_to(cache)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in cache.rglob("*")}


@pytest.mark.e2e
def test_read_only_cache_runs_what_needs_no_writing(cache, tiny_gguf, pinned_bandwidths, read_only_tierlm):
    name = catalog.model_name(embedded.import_gguf_to_cache(tiny_gguf))
    generate = ["generate", "hello", "--model", name, "-t", "0", "-n", "4", "--quant", "int8", "--device", "cpu"]
    # A process of its own, as a user's earlier run: builds the artifact; records the baseline,
    # the use, the digests.
    writable = subprocess.run([sys.executable, "-m", "tierlm", *generate], capture_output=True, text=True, timeout=300)
    assert writable.returncode == 0 and writable.stdout.strip(), writable.stderr
    before = snapshot(cache)

    for args in (generate, ["list"], ["cache", "list"], ["show", name, "--device", "cpu"],
                 ["plan", name, "--device", "cpu"]):  # fmt: skip
        done = read_only_tierlm(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
        if args == generate:
            assert done.stdout == writable.stdout
        assert done.stdout.strip(), args
    assert snapshot(cache) == before


@pytest.mark.e2e
def test_empty_read_only_cache_says_so_in_one_line(cache, tiny_gguf, read_only_tierlm):
    for args in (["generate", "hello", "-n", "2"], ["import-gguf", str(tiny_gguf)]):
        done = read_only_tierlm(*args)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(errors) == 1 and f"the cache directory {cache} is not writable" in errors[0], done.stderr
        assert "TIERLM_CACHE" in errors[0]
    listing = read_only_tierlm("list")
    assert listing.returncode == 0 and "no models" in listing.stdout


def test_directory_lock_on_a_read_only_folder_still_serves_a_finished_target(tmp_path, monkeypatch):
    target = tmp_path / "done"
    target.mkdir()
    real_open = Path.open

    def read_only_open(self, mode="r", *args, **kwargs):
        if self.name.endswith(".lock") and mode != "r":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", read_only_open)
    with atomic.directory_lock(target):  # no lock file can be made: the finished target is reused
        assert target.is_dir()
    monkeypatch.undo()
    with atomic.directory_lock(target):  # and with the lock file present it is opened to read
        pass
    monkeypatch.setattr(Path, "open", read_only_open)
    with atomic.directory_lock(target):
        assert (tmp_path / ".done.lock").is_file()


# ----------------------------------------------------------------------------- stale partial builds


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def partial(folder: Path, name: str, pid: int, nbytes: int = MiB) -> Path:
    path = folder / f".{name}.partial-{pid}"
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"\0" * nbytes)
    return path


@pytest.mark.e2e
def test_stale_partials_are_counted_and_removed_only_when_their_process_is_gone(cache, tiny_gguf):
    from tierlm.cli.models import render_cache_list, render_list

    models, artifacts = cache / "models", cache / "artifacts"
    dead = partial(models, "killed-0123456789ab", dead_pid(), 2 * MiB)
    live = partial(models, "running-0123456789ab", os.getpid())
    held_target = artifacts / "held-int8-0123456789abcdef"
    held = partial(artifacts, held_target.name, dead_pid())
    assert stale_builds().count == 2  # the held one: its process is gone, but its target's lock is held...

    with atomic.directory_lock(held_target):
        assert (stale_builds().count, stale_builds().nbytes) == (1, 2 * MiB)
        line = "1 stale partial build, 2.0 MiB; `tierlm cache rm --all` or the next build removes them"
        assert render_list().splitlines()[-1] == line and render_cache_list().splitlines()[-1] == line
        embedded.import_gguf_to_cache(tiny_gguf)  # any build in models/ sweeps its folder
        assert not dead.exists() and live.exists() and held.exists()

        dead = partial(models, "killed-again-0123456789ab", dead_pid())
        remove_entries([], everything=True)
        assert not dead.exists() and live.exists() and held.exists()
    assert stale_builds().count == 1  # ...which counts once the lock is free
    remove_entries([], everything=True)
    assert not held.exists() and live.exists() and stale_builds().count == 0


def test_int8_kernels_fall_back_when_their_build_folder_cannot_be_written(tmp_path):
    from tierlm.quant.kernel_api import KernelUnavailable
    from tierlm.quant.native import load_native

    if shutil.which("c++") is None and shutil.which("g++") is None and not os.environ.get("CXX"):
        pytest.skip("no C++ compiler: the native kernel is unavailable for another reason")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # the cache's kernels folder cannot be created under a file
    with pytest.raises(KernelUnavailable, match="cannot build the int8 kernel"):
        load_native(blocked / "kernels")
    pytest.importorskip("numba")
    from tierlm.quant.numba_kernel import load_numba

    with pytest.raises(KernelUnavailable, match="cannot create numba's cache"):
        load_numba(blocked / "kernels")
