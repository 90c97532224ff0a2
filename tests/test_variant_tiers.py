"""LoRA variants placed in the tiers like any other block (issue 15): resident while they fit
beside the base, else in host RAM, else (merged) read from their variant artifact per use.

The planner's rules on a 7B shape (pure, fixed bandwidths); then a served tiny model whose budget
holds the base and one variant but not two: the other is read from disk per use, both give the
greedy text of `tierlm generate --lora`, and measured RSS grows by one variant, not two.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_lora_merge import save_adapter
from tests.test_planner import BASELINE, CPU, GPU, MODELS
from tests.tiny import make_model
from tierlm.models import read_config
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, HOST
from tierlm.offload.planner.search import plan
from tierlm.offload.planner.context import VariantCharge
from tierlm.offload.sizes import sizes_from_config
from tierlm.profile import load_profile

MiB, GiB = 2**20, 2**30
TOKENS = 12


@pytest.fixture(scope="module")
def llama7b(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-2-7b")
    (directory / "config.json").write_text(json.dumps(MODELS["llama-2-7b"]))
    return read_config(directory)


def plan_7b(config, profile, variants=(), accelerator=False):
    sizes = sizes_from_config(config, "int8", accelerator=accelerator)
    return plan(config, sizes, profile, GPU if accelerator else CPU, accelerator=accelerator,
                baseline_bytes=BASELINE, variants=variants)  # fmt: skip


def attention_variant(name: str, uses: int = 0, mode: str = "merged") -> VariantCharge:
    """A merged variant of all 32 layers' attention (int8: 4 x 4096² bytes a layer, 2 GiB)."""
    per_layer = 4 * 4096 * 4096
    return VariantCharge(name, mode, 32 * per_layer, per_layer, uses)


def room_for(config, profile, n_variants: float, accelerator=False):
    """`profile` with a device budget of the base's charges plus `n_variants` variants' bytes."""
    base = plan_7b(config, profile, accelerator=accelerator)
    extra = int(n_variants * attention_variant("x").nbytes)
    return replace(profile, device_memory=base.total(DEVICE) + extra), base


def test_variants_fill_the_device_then_stream_and_never_move_the_base(llama7b):
    profile, base = room_for(llama7b, load_profile("24gb"), 1.5)
    placement = plan_7b(llama7b, profile, [attention_variant("a"), attention_variant("b"), attention_variant("c")])
    assert [b.tier for b in placement.blocks] == [b.tier for b in base.blocks]  # the base first, untouched
    assert [(v.name, v.tier) for v in placement.variants] == [("a", DEVICE), ("b", DISK), ("c", DISK)]
    device = placement.charges[DEVICE]
    assert device["variants"] == attention_variant("a").nbytes
    assert device["variant_stream"] == attention_variant("a").largest  # one slot: one block per use
    assert placement.total(DEVICE) <= profile.device_memory
    assert "b merged 2048.00 MiB on disk" in next(n for n in placement.notes if n.startswith("LoRA variants"))


def test_hot_variants_are_placed_before_cold_ones(llama7b):
    profile, _ = room_for(llama7b, load_profile("24gb"), 1.5)
    placement = plan_7b(llama7b, profile, [attention_variant("cold", uses=1), attention_variant("hot", uses=50)])
    assert {v.name: v.tier for v in placement.variants} == {"hot": DEVICE, "cold": DISK}
    assert [v.name for v in placement.variants] == ["cold", "hot"]  # listed in the order given


def test_accelerator_keeps_a_variant_in_host_ram_before_disk(llama7b):
    profile, _ = room_for(llama7b, load_profile("24gb"), 0.5, accelerator=True)
    placement = plan_7b(llama7b, profile, [attention_variant("a")], accelerator=True)
    assert placement.variants[0].tier == HOST
    assert placement.charges[HOST]["variants"] == attention_variant("a").nbytes
    assert placement.charges[DEVICE]["variant_stream"] == attention_variant("a").largest


def test_what_cannot_even_stream_is_refused_naming_the_variant(llama7b):
    profile, _ = room_for(llama7b, load_profile("24gb"), 0.01)  # less than one layer's slot
    with pytest.raises(TierlmError, match=r"LoRA variant 'big' \(merged.*slot reading it from disk") as err:
        plan_7b(llama7b, profile, [attention_variant("big")])
    assert "larger --profile" in str(err.value)
    roomy, _ = room_for(llama7b, load_profile("24gb"), 0.5)
    with pytest.raises(TierlmError, match="unmerged variant's low-rank factors have no copy on disk"):
        plan_7b(llama7b, roomy, [attention_variant("lowrank", mode="unmerged")])
    with pytest.raises(TierlmError, match="disk_offload is false"):
        plan_7b(llama7b, replace(roomy, disk_offload=False), [attention_variant("big")])


# -- serving: one variant resident, one read from disk per use ----------------------------------

PROFILE = """description = "tests: a tiny model, variants beside it"
device_memory = "2GiB"
host_memory = "2GiB"
disk_offload = true
headroom = "64MiB"
quant = "int8"
kv_cache = "auto"
prefetch_depth = 0
context_length = 64
batch_size = 2
"""
# DoRA is never low rank: both variants are merged, so either can be read from disk.
CONFIGS = [dict(r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
           dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "o_proj"])]  # fmt: skip
PROMPTS = {None: "the quick brown fox", "v0": "hello world, how are", "v1": "lazy dog jumps"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, profile path, adapter dirs): a model whose variants' bytes stand out in RSS
    (the attention of 8 layers of 1024: 32 and 24 MiB in int8, a layer's 4 and 3 MiB)."""
    from peft import LoraConfig

    root = tmp_path_factory.mktemp("variant-tiers")
    model = root / "base"
    make_model(model, hidden=1024, layers=8, heads=8, kv_heads=8, intermediate=1024, vocab=320)
    profile = root / "tiers.toml"
    profile.write_text(PROFILE)
    adapters = [save_adapter(model, root / f"adapter-{i}", LoraConfig(**c), seed=60 + i) for i, c in enumerate(CONFIGS)]
    return model, profile, adapters


def tight_session(model, profile_path, adapters):
    """A session over `model` whose device budget, once the base is loaded, holds the base and the
    first adapter's variant (with a slot to read the second's per use) but not both held; also
    both variants as sized before anything is held. The RSS child runs it too."""
    from tierlm.runtime.session import open_session
    from tierlm.store.variants import overlay_for

    session = open_session(str(model), load_profile(str(profile_path)), device="cpu", dtype="fp32")
    sized = [overlay_for(session.loaded.artifact_dir, ((Path(a), 1.0),), device="cpu", hold=False) for a in adapters]
    base = session.loaded.placement.total(DEVICE)
    low = base + sized[0].nbytes + sized[1].largest  # the first held, a slot to read the second
    high = base + sized[0].nbytes + sized[1].nbytes  # both held
    assert low < high, (low, high)
    # As a tighter profile would be (the base still fully resident under it).
    session.profile = replace(session.profile, device_memory=(low + high) // 2)
    session.variant_store()
    return session, sized


def generate_lora_text(model, profile_path, adapter, content: str) -> str:
    """What `tierlm generate --lora ADAPTER` replies (greedy, the model's other defaults such as
    its repetition penalty, as the server resolves a request's), as the server flushes it."""
    from tierlm.runtime.sampling import resolve_sampling
    from tierlm.runtime.session import open_session

    loras = () if adapter is None else (f"{adapter}:1.0",)
    with open_session(str(model), load_profile(str(profile_path)), device="cpu", dtype="fp32", loras=loras) as solo:
        engine = solo.engine
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
        params = resolve_sampling(solo.generation_defaults, temperature=0, max_new_tokens=TOKENS)
        generation = engine.generate(ids, params)
        generation.text()
        token_ids = generation.token_ids
        if token_ids[-1] in engine.tokenizer.eos_token_ids:
            token_ids = token_ids[:-1]
        return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_a_variant_beyond_the_budget_is_read_from_disk_and_gives_its_lora_text(served):
    from tests.test_server_variants import chat, reply, running

    model, profile, adapters = served
    expected = {name: generate_lora_text(model, profile, None if name is None else adapters[int(name[1])], content)
                for name, content in PROMPTS.items()}  # fmt: skip
    assert len(set(expected.values())) == len(expected), "the adapters must change the reply"
    session, _ = tight_session(model, profile, adapters)
    with session:
        for i, adapter in enumerate(adapters):
            session.add_variant(f"v{i}", ((adapter, 1.0),))
        placement = session.loaded.placement
        assert {v.name: v.tier for v in placement.variants} == {"v0": DEVICE, "v1": DISK}
        assert placement.total(DEVICE) <= session.profile.device_memory
        held = session.variants["v1"][1]
        assert held.tier == DISK and held.held_bytes == 0
        assert session.loaded.store.nbytes() == session.loaded.store.base.nbytes() + session.variants["v0"][1].nbytes
        with running(session) as client:
            for name, content in PROMPTS.items():
                assert reply(chat(client, name, content)) == expected[name], name
        # Removing the held variant frees its room: the one read from disk moves into it.
        session.remove_variant("v0")
        assert session.variants["v1"][1].tier == DEVICE
        assert [(v.name, v.tier) for v in session.loaded.placement.variants] == [("v1", DEVICE)]


@pytest.mark.slow
def test_a_variant_that_cannot_even_stream_is_refused_and_not_served(served):
    model, profile, adapters = served
    session, sized = tight_session(model, profile, adapters)
    with session:
        base = session.loaded.placement.total(DEVICE)
        session.profile = replace(session.profile, device_memory=base + sized[1].largest // 2)
        with pytest.raises(TierlmError, match=r"variant v1 cannot be served: LoRA variant 'v1' \(merged"):
            session.add_variant("v1", ((adapters[1], 1.0),))
        assert session.variant_store().names() == [] and session.variants == {}


# Run in a fresh process so the RSS it reads is this session's own; freed memory is handed back to
# the OS before each reading, as a long-running server's allocator eventually does.
MEMORY_CHILD = """
import ctypes, gc, json, sys
from pathlib import Path
import torch
import tierlm.store.variants, tierlm.lora.merge, tierlm.cache.convert  # imported before measuring
from tests.test_variant_tiers import tight_session

def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

def run(store, model, name):
    from tierlm.kv.cache import KVCache
    store.select([name])
    type(model)(model.config, store, 32, "cpu", torch.float32).forward(torch.tensor([[5, 17, 99, 3, 41]]),
                                                                       KVCache.for_model(model.config, 32))

model_dir, profile_path, *adapters = sys.argv[1:]
session, sized = tight_session(model_dir, profile_path, adapters)
store = session.variant_store()
run(store, session.loaded.model, None)  # the base's first forward allocates what every forward reuses
base = rss()
for i, adapter in enumerate(adapters):
    session.add_variant(f"v{i}", ((Path(adapter), 1.0),))
added = rss()
for name in ("v0", "v1", "v1", None):
    run(store, session.loaded.model, name)
used = rss()
print(json.dumps({"base": base, "added": added, "used": used, "sizes": [[o.nbytes, o.largest] for o in sized],
                  "tiers": {v.name: v.tier for v in session.loaded.placement.variants}}))
"""
MEMORY_MARGIN = 12 << 20  # allocator slack and lazily created buffers, as in test_server_variants


@pytest.mark.e2e
def test_rss_grows_by_the_held_variant_not_both(served):
    model, profile, adapters = served
    child = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(model), str(profile), *map(str, adapters)],
                           capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert child.returncode == 0, child.stderr[-3000:]
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    (held, _), (streamed, slot) = figures["sizes"]
    assert figures["tiers"] == {"v0": DEVICE, "v1": DISK}, figures
    assert slot + MEMORY_MARGIN < streamed  # else the bound below could not tell one variant from two
    for moment in ("added", "used"):  # after adding both; after forwards on each (v1's blocks read and freed)
        assert figures[moment] - figures["base"] <= held + slot + MEMORY_MARGIN, (moment, figures)


# -- the cache: a base artifact is not removed from under its variants ------------------------


def test_cache_rm_of_a_base_takes_its_variants_and_list_hides_orphans(tmp_path, monkeypatch):
    import shutil

    from peft import LoraConfig

    from tierlm.cache.convert import ConversionRequest, ensure_variant_artifact
    from tierlm.cli.models import remove_from_cache, render_cache_list

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))  # removals here touch no other test's cache
    model = tmp_path / "base"
    make_model(model, vocab=320)
    adapters = [save_adapter(model, tmp_path / f"adapter-{i}", LoraConfig(r=2, lora_alpha=4, target_modules=[t]), seed=i)
                for i, t in enumerate(["q_proj", "v_proj"])]  # fmt: skip
    variants = [ensure_variant_artifact(ConversionRequest(model, (), "int8"), ((a, 1.0),)) for a in adapters]
    base = variants[0].parent / json.loads((variants[0] / "manifest.json").read_text())["base"]
    assert all(v.is_dir() for v in variants) and base.is_dir()

    # Not a terminal and no --yes: refused, naming the variants; nothing removed.
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    with pytest.raises(TierlmError, match="pass --yes") as err:
        remove_from_cache([base.name], False, False)
    assert all(v.name in str(err.value) for v in variants)
    assert base.is_dir() and all(v.is_dir() for v in variants)

    removed = remove_from_cache([base.name], False, True)
    assert sorted(p.name for p in removed) == sorted([base.name, *(v.name for v in variants)])
    assert not base.exists() and not any(v.exists() for v in variants)
    assert not [line for line in render_cache_list().splitlines() if line.startswith("variant")]

    # A base removed by hand (or an older tierlm): its variant is not listed, a note says how to remove it.
    orphan = ensure_variant_artifact(ConversionRequest(model, (), "int8"), ((adapters[0], 1.0),))
    shutil.rmtree(base)
    listing = render_cache_list()
    assert not [line for line in listing.splitlines() if line.startswith("variant")]
    assert "whose base artifact is gone (not listed" in listing and f"tierlm cache rm {orphan.name}" in listing
    assert [p.name for p in remove_from_cache([orphan.name], False, False)] == [orphan.name]
    assert "base artifact is gone" not in render_cache_list()
