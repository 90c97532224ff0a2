"""A Llama-3-8B-shaped Q4_K_M GGUF imports and converts with `auto` inside a 2 GiB cgroup: the GGUF
is the checkpoint (no float copy), tensors are transcoded one at a time, so the peak disk is the
artifact itself and the child's RSS stays far below the model's 3.9 GiB.

The file holds random blocks in llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for the head and for half
the layers' attn_v and ffn_down), written one tensor at a time; its byte-level vocabulary keeps the
embedding small, so the layers are 8B's and the file 3.9 GiB where a real one is 4.6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.test_gguf_carry import llama_writer, random_blocks
from tests.test_gguf_import import byte_level_vocab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a child in a cgroup; 8 GiB written and read

LIMIT = 2 << 30
HIDDEN, INTER, KV, LAYERS = 4096, 14336, 1024, 32

CHILD = r"""
import json, resource, sys
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.offload.sizes import resolve_auto
from tierlm.weights.embedded import import_gguf_to_cache

out = import_gguf_to_cache(sys.argv[1])
quant = resolve_auto("auto", out)
artifact = ensure_artifact(ConversionRequest(out, (), quant))
print(json.dumps({"quant": quant, "artifact": str(artifact),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def q4_k_m_plan(vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape, type) of an 8B-shaped Llama in llama.cpp's Q4_K_M mix."""
    plan = [("token_embd.weight", (vocab, HIDDEN), "Q4_K"), ("output_norm.weight", (HIDDEN,), "F32"),
            ("output.weight", (vocab, HIDDEN), "Q6_K")]  # fmt: skip
    for i in range(LAYERS):
        wide = "Q6_K" if i % 2 == 0 else "Q4_K"  # llama.cpp widens half the attn_v and ffn_down
        plan += [(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32"), (f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32"),
                 (f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), "Q4_K"), (f"blk.{i}.attn_k.weight", (KV, HIDDEN), "Q4_K"),
                 (f"blk.{i}.attn_v.weight", (KV, HIDDEN), wide), (f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), "Q4_K"),
                 (f"blk.{i}.ffn_gate.weight", (INTER, HIDDEN), "Q4_K"), (f"blk.{i}.ffn_up.weight", (INTER, HIDDEN), "Q4_K"),
                 (f"blk.{i}.ffn_down.weight", (HIDDEN, INTER), wide)]  # fmt: skip
    return plan


def write_streamed_gguf(path: Path) -> int:
    """The 8B-shaped file, each tensor generated and written in turn (never the whole model in
    memory); returns its tensor bytes."""
    import transformers
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    vocab = len(byte_level_vocab()[0])
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
                                      num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5)  # fmt: skip
    writer = llama_writer(path, config, "8B-shaped Q4_K_M")
    plan = q4_k_m_plan(vocab)
    total = 0
    for name, shape, kind in plan:
        if kind == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
            total += shape[0] * 4
            continue
        qtype = getattr(GGMLQuantizationType, kind)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = shape[0] * shape[1] // block * size
        writer.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, shape, kind in plan:
        data = np.ones(shape, dtype=np.float32) if kind == "F32" else random_blocks(kind, *shape, rng)
        writer.write_tensor_data(data)
    writer.close()
    return total


def allocated_bytes(root: Path) -> int:
    """Bytes the files under `root` occupy on disk (allocated blocks, not apparent sizes)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:  # a temporary file renamed or removed meanwhile
                pass
    return total


def rss_anon(pid: int) -> int:
    """A live process's anonymous resident bytes (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def own_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory, if it exists and we may make children in it."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return group if (group / "memory.limit_in_bytes").exists() and os.access(group, os.W_OK) else None
    return None


@pytest.mark.skipif(own_cgroup() is None, reason="no writable cgroup v1 memory controller on this machine")
def test_8b_shaped_q4_k_m_imports_inside_2_gib_with_the_artifact_as_peak_disk(tmp_path):
    gguf = tmp_path / "llama-8b-shaped-q4_k_m.gguf"
    tensor_bytes = write_streamed_gguf(gguf)
    cache = tmp_path / "cache"
    group = own_cgroup() / f"tierlm-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    peak, anonymous, stop = [0], [0], threading.Event()
    child: list[subprocess.Popen] = []

    def watch():  # the cache's disk use, and the child's anonymous memory (its mapped GGUF pages aside)
        while not stop.is_set():
            peak[0] = max(peak[0], allocated_bytes(cache))
            if child:
                anonymous[0] = max(anonymous[0], rss_anon(child[0].pid))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch)
    try:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        swap_limit = group / "memory.memsw.limit_in_bytes"
        if swap_limit.exists():
            swap_limit.write_text(str(LIMIT))  # no escape into swap either
        watcher.start()
        env = dict(os.environ, TIERLM_CACHE=str(cache))
        # Join the cgroup before Python starts, so every byte the child touches is charged.
        argv = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", CHILD, str(gguf)]
        child.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        stdout, stderr = child[0].communicate(timeout=1200)
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        group.rmdir()
    assert child[0].returncode == 0, f"import under a 2 GiB cap failed: {stderr[-3000:]}"
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["quant"] == "mixed-source"
    artifact = allocated_bytes(Path(result["artifact"]))
    final = allocated_bytes(cache)
    assert peak[0] <= 1.1 * artifact, (peak[0], artifact)  # no float copy, no second copy of the weights
    assert final - artifact < 16 << 20  # beside the artifact: the import's config, tokenizer, receipt
    assert artifact <= 1.03 * tensor_bytes, (artifact, tensor_bytes)  # carried at the file's own size
    # One tensor at a time, not the model: the anonymous memory (the mapped file's pages are the
    # page cache's, which the cgroup reclaims) stays a fraction of the 3.9 GiB.
    assert 0 < anonymous[0] < 1 << 30, (anonymous[0], result["peak_rss"])
