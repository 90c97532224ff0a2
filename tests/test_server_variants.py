"""Serving LoRA variants beside their base: `serve --lora NAME=PATH`, /v1/models, a request's
`model` picking a variant, mixed batches, and adding/removing adapters while serving.

The reference for each variant is what `tierlm generate --lora PATH[:WEIGHT]` gives: a session
with the adapter merged into its own full artifact, run alone on the single-sequence engine.
The server runs on a thread of this process (BackgroundServer) over a tiny model.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.test_lora_merge import save_adapter
from tests.tiers import quick
from tests.tiny import make_model, write_profile
from tierlm.errors import TierlmError
from tierlm.lora.spec import parse_variant_spec, split_variant_specs
from tierlm.profile import load_profile
from tierlm.runtime.sampling import resolve_sampling
from tierlm.runtime.session import open_session
from tierlm.server.options import ServerOptions
from tierlm.server.run import BackgroundServer

KEY = "variant-key"
BASE = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = 12
# name -> (LoraConfig kwargs, weight): different targets and ranks; rsLoRA; DoRA (never low rank: merged)
ADAPTERS = {
    "attn": (dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]), 1.0),
    "dora": (dict(r=8, lora_alpha=16, use_dora=True, target_modules=["o_proj", "up_proj", "down_proj"]), 0.7),
    "late": (dict(r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj"]), 1.0),  # added while serving
}
PROMPTS = {None: "the quick brown fox", "attn": "hello world, how are", "dora": "lazy dog jumps", "late": "how are you"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variants-serve")


@pytest.fixture(scope="module")
def base_dir(root) -> Path:
    make_model(root / BASE, vocab=320)
    return root / BASE


@pytest.fixture(scope="module")
def profile(root):
    return load_profile(str(write_profile(root / "serve.toml", context_length=128, batch_size=4)))


@pytest.fixture(scope="module")
def adapters(base_dir, root) -> dict[str, Path]:
    from peft import LoraConfig

    return {name: save_adapter(base_dir, root / f"adapter-{name}", LoraConfig(**kwargs), seed=7 + i)
            for i, (name, (kwargs, _)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def session(base_dir, profile, adapters):
    variants = {name: ((adapters[name], ADAPTERS[name][1]),) for name in ("attn", "dora")}
    with open_session(str(base_dir), profile, device="cpu", dtype="fp32", variants=variants) as opened:
        yield opened


@pytest.fixture(scope="module")
def expected(expected_runs) -> dict[str | None, str]:
    """Each variant's (and the base's) greedy reply to its prompt, as `generate --lora` gives it."""
    return {name: text for name, (_, _, text) in expected_runs.items()}


@pytest.fixture(scope="module")
def expected_runs(base_dir, profile, adapters) -> dict[str | None, tuple[list[int], list[int], str]]:
    """Each variant's (and the base's) (prompt ids, greedy token ids, reply text), as `generate
    --lora` gives them."""
    replies, runs = {}, {}
    for name, content in PROMPTS.items():
        loras = () if name is None else (f"{adapters[name]}:{ADAPTERS[name][1]}",)
        with open_session(str(base_dir), profile, device="cpu", dtype="fp32", loras=loras) as solo:
            engine = solo.engine
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
            # temperature 0 with the model's other defaults, as the server resolves a request's.
            generation = engine.generate(ids, resolve_sampling(solo.generation_defaults, temperature=0,
                                                               max_new_tokens=TOKENS))  # fmt: skip
            generation.text()  # runs it
            token_ids = generation.token_ids
            if token_ids[-1] in engine.tokenizer.eos_token_ids:  # the server flushes what the engine holds back
                token_ids = token_ids[:-1]
            replies[name] = engine.tokenizer.decode(token_ids, skip_special_tokens=True)
            runs[name] = (list(ids), list(generation.token_ids), replies[name])
    assert len(set(replies.values())) == len(replies), "the adapters must change the reply"
    return runs


@contextmanager
def running(session, **options):
    options = ServerOptions(model_id=BASE, api_key=KEY, debug_hooks=True, access_log=False, **options)
    with BackgroundServer(session, options) as server:
        with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
            yield client


def chat(client, model: str | None, content: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": TOKENS}
    if model is not None:
        body["model"] = model
    return client.post("/v1/chat/completions", json=body)


def in_background(client, model: str | None, content: str) -> tuple[threading.Thread, dict]:
    """`chat` on a thread of its own, with its own connection; the response lands in box["response"]."""
    box: dict = {}

    def ask() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=60, headers=AUTH) as own:
            box["response"] = chat(own, model, content)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, box


def reply(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def cache_files() -> set[str]:
    root = Path(os.environ["TIERLM_CACHE"])
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def wait_ready(client, name: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        card = next(c for c in client.get("/v1/adapters").json()["data"] if c["id"] == name)
        if card["status"] != "converting":
            return card
        time.sleep(0.05)
    raise AssertionError(f"{name} still converting")


@pytest.mark.slow
def test_models_lists_the_base_and_each_variant_with_its_parent(session):
    with running(session) as client:
        models = client.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(BASE, None), ("attn", BASE), ("dora", BASE)]
        assert client.get("/v1/models/dora").json()["parent"] == BASE
        cards = {c["id"]: c for c in client.get("/v1/adapters").json()["data"]}
        assert {c["status"] for c in cards.values()} == {"ready"}
        assert cards["dora"]["mode"] == "merged" and "DoRA" in cards["dora"]["why"]  # no sum of low-rank terms
        assert cards["attn"]["mode"] == "unmerged"  # so mixed batches below hold both kinds
        assert 0 < cards["attn"]["bytes"] < cards["dora"]["bytes"]


def test_each_variant_gives_the_text_of_generate_with_its_lora(session, expected):
    with running(session) as client:
        for name in (None, "attn", "dora", BASE):
            response = chat(client, name, PROMPTS[None if name == BASE else name])
            assert reply(response) == expected[None if name == BASE else name], name
            assert response.json()["model"] == (name or BASE)


def test_drafting_requests_to_variants_get_their_solo_text(session, expected_runs, monkeypatch):
    """Speculative decoding over variants: each drafting request's passes are verified with its own
    variant's weights (drafts of its solo reply, every third pass wrong), so its reply is unchanged."""
    import tierlm.server.batch as batch_module
    from tests.test_speculative import EveryPass, ScriptedDrafts
    from tierlm.runtime.speculative import DraftSettings

    replies = {tuple(prompt): prompt + ids for prompt, ids, _ in expected_runs.values()}
    monkeypatch.setattr(batch_module, "DraftPolicy", EveryPass)
    monkeypatch.setattr(batch_module, "PromptLookup",
                        lambda tokens: ScriptedDrafts(replies.get(tuple(tokens), list(tokens)), tokens))  # fmt: skip
    with running(session, draft=DraftSettings("ngram", 4)) as client:
        for name in (None, "attn", "dora"):
            assert reply(chat(client, name, PROMPTS[name])) == expected_runs[name][2], name
        speculation = client.get("/stats").json()["speculation"]
        assert 0 < speculation["accepted"] < speculation["drafted"]


@pytest.mark.slow
def test_mixed_concurrent_requests_each_get_their_solo_text(session, expected):
    order = [None, "attn", "dora", "attn"]
    with running(session) as client:
        client.post("/debug/worker", json={"action": "pause"})
        asked = [in_background(client, name, PROMPTS[name]) for name in order]
        deadline = time.monotonic() + 10
        while client.get("/health").json()["queue_depth"] < len(order) and time.monotonic() < deadline:
            time.sleep(0.02)
        client.post("/debug/worker", json={"action": "resume"})
        for thread, _ in asked:
            thread.join(60)
        assert [reply(box["response"]) for _, box in asked] == [expected[name] for name in order]
        assert client.get("/health").json()["peak_batch"] == len(order)  # one decode step held all four


@pytest.mark.slow
def test_unknown_variant_is_model_not_found(session):
    with running(session) as client:
        response = chat(client, "nope", "hi")
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and "`nope`" in error["message"] and "`attn`" in error["message"]
        assert client.get("/v1/models/nope").status_code == 404


def test_a_variant_named_as_the_base_is_refused_at_start(session):
    with pytest.raises(TierlmError, match="'attn' is also the base model's name or alias"):
        BackgroundServer(session, ServerOptions(model_id=BASE, aliases=("attn",), access_log=False))


def test_adapters_need_the_api_key(session):
    with running(session) as client:
        for method, path in (("GET", "/v1/adapters"), ("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/attn")):
            assert client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert "attn" in [m["id"] for m in client.get("/v1/models").json()["data"]]


@pytest.mark.slow
def test_adapter_of_another_base_is_400_and_writes_nothing(session, root):
    from peft import LoraConfig

    other = root / "other-base"
    make_model(other, hidden=32, heads=2, kv_heads=1, intermediate=48, vocab=320, with_tokenizer=False)
    foreign = save_adapter(other, root / "adapter-foreign", LoraConfig(r=2, target_modules=["q_proj"]), seed=3)
    with running(session, adapter_dir=root) as client:
        before = cache_files()
        response = client.post("/v1/adapters", json={"name": "foreign", "path": str(foreign)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_adapter" and "does not fit the base model" in error["message"]
        assert cache_files() == before
        assert "foreign" not in [c["id"] for c in client.get("/v1/adapters").json()["data"]]


BAD_ADAPTERS = [
    ({"name": "attn", "path": "."}, 409, "name"),  # a variant's name
    ({"name": BASE, "path": "."}, 409, "name"),  # the base's
    ({"name": "-bad", "path": "."}, 400, "name"),
    ({"name": "ok"}, 400, "path"),
    ({"name": "ok", "path": "no/such/adapter"}, 400, "path"),  # under --adapter-dir, but missing
    ({"name": "ok", "path": ".", "weight": "heavy"}, 400, "weight"),
    ({"name": "ok", "path": ".", "rank": 4}, 400, "rank"),
]


@pytest.mark.parametrize(
    "body, status, param",
    quick(BAD_ADAPTERS, fast=[BAD_ADAPTERS[0], BAD_ADAPTERS[4]]),
)
def test_bad_adapter_requests(session, root, body, status, param):
    with running(session, adapter_dir=root) as client:
        response = client.post("/v1/adapters", json=body)
        assert (response.status_code, response.json()["error"]["param"]) == (status, param), response.text


@pytest.mark.slow
def test_add_serve_and_remove_an_adapter_while_serving(session, root, adapters, expected):
    with running(session, adapter_dir=root) as client:
        response = client.post("/v1/adapters", json={"name": "late", "path": str(adapters["late"])})
        assert response.status_code == 202 and response.json()["status"] == "converting"
        card = wait_ready(client, "late")
        assert card["status"] == "ready", card
        assert "late" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert reply(chat(client, "late", PROMPTS["late"])) == expected["late"]
        assert reply(chat(client, None, PROMPTS[None])) == expected[None]  # the base is untouched

        # A request in flight when its variant is deleted finishes; new ones get 404.
        client.post("/debug/worker", json={"action": "delay", "seconds": 0.05})
        thread, box = in_background(client, "late", PROMPTS["late"])
        deadline = time.monotonic() + 10
        while client.get("/health").json()["active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        deleted = client.delete("/v1/adapters/late")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert chat(client, "late", "hi").status_code == 404
        thread.join(60)
        assert reply(box["response"]) == expected["late"]
        deadline = time.monotonic() + 10
        while "late" in session.variant_store().names() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "late" not in session.variant_store().names()
        assert "late" not in [c["id"] for c in client.get("/v1/adapters").json()["data"]]
        assert client.delete("/v1/adapters/late").status_code == 404


# -- which adapters a client may add: under --adapter-dir, or named as the cache knows them --------

REFUSED = "this server only loads adapters under --adapter-dir"


@pytest.fixture(scope="module")
def adapter_dir(root, adapters) -> Path:
    """--adapter-dir: a real adapter (a copy of `late`), a symlink leading out of it, and an
    adapter folder whose files link out of it; the `adapters` fixture's folders lie outside."""
    import shutil

    served = root / "served-adapters"
    shutil.copytree(adapters["late"], served / "late-copy")
    (served / "escape").symlink_to(adapters["late"], target_is_directory=True)
    (served / "linked-files").mkdir()
    for item in adapters["late"].iterdir():
        (served / "linked-files" / item.name).symlink_to(item)
    return served


def assert_refused(client, spec: str) -> dict:
    response = client.post("/v1/adapters", json={"name": "outsider", "path": spec})
    assert response.status_code == 403, (spec, response.text)
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("adapter_path_refused", "path"), error
    assert error["message"].startswith(REFUSED), error
    return error


def remove(client, session, name: str) -> None:
    assert client.delete(f"/v1/adapters/{name}").status_code == 200
    deadline = time.monotonic() + 10
    while name in session.variant_store().names() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert name not in session.variant_store().names()


def test_paths_leading_out_of_adapter_dir_are_refused(session, adapters, adapter_dir):
    with running(session, adapter_dir=adapter_dir) as client:
        before = cache_files()
        for spec in ("escape", str(adapter_dir / "escape"), "linked-files", "../adapter-late", "late-copy/../../adapter-late",
                     str(adapters["late"])):  # fmt: skip
            error = assert_refused(client, spec)
            assert "is not under it (symlinks followed)" in error["message"]
        assert cache_files() == before
        assert "outsider" not in [c["id"] for c in client.get("/v1/adapters").json()["data"]]


def test_without_adapter_dir_no_path_is_loaded(session, adapters, adapter_dir):
    with running(session) as client:
        for spec in (str(adapters["late"]), str(adapter_dir / "late-copy"), "./late-copy"):
            error = assert_refused(client, spec)
            assert "it was not given" in error["message"]


@pytest.mark.slow
def test_an_adapter_under_adapter_dir_loads(session, adapter_dir, expected):
    with running(session, adapter_dir=adapter_dir) as client:
        response = client.post("/v1/adapters", json={"name": "late-copy", "path": "late-copy"})
        assert response.status_code == 202, response.text
        card = wait_ready(client, "late-copy")
        assert card["status"] == "ready" and card["adapters"][0]["path"] == str((adapter_dir / "late-copy").resolve())
        assert reply(chat(client, "late-copy", PROMPTS["late"])) == expected["late"]
        remove(client, session, "late-copy")


@pytest.mark.slow
def test_without_adapter_dir_an_adapter_the_cache_knows_loads_by_name(session, base_dir, adapters, expected):
    from tests.cli_runner import run_tierlm

    built = run_tierlm("convert", "--model", str(base_dir), "--lora", str(adapters["late"]), "--quant", "none")
    assert built.returncode == 0, built.stderr
    assert "+adapter-late" in run_tierlm("list").stdout  # the name `tierlm list` shows it by
    with running(session) as client:
        response = client.post("/v1/adapters", json={"name": "late-cached", "path": "adapter-late"})
        assert response.status_code == 202, response.text
        card = wait_ready(client, "late-cached")
        assert card["status"] == "ready" and card["adapters"][0]["path"] == str(adapters["late"].resolve())
        assert reply(chat(client, "late-cached", PROMPTS["late"])) == expected["late"]
        remove(client, session, "late-cached")


def test_serve_refuses_an_adapter_dir_that_is_no_directory(tmp_path):
    from tests.cli_runner import run_tierlm

    done = run_tierlm("serve", "--adapter-dir", str(tmp_path / "missing"))
    assert done.returncode == 1
    assert done.stderr.splitlines()[0].startswith(f"error: --adapter-dir {tmp_path / 'missing'} is not a directory")


@pytest.mark.e2e
def test_serve_adapter_dir_loads_under_it_and_refuses_a_symlink_out(base_dir, root, adapters, adapter_dir):
    from tests.test_server_openai import serve_process

    args = ["--model", str(base_dir), "--profile", str(root / "serve.toml"), "--device", "cpu", "--dtype", "fp32",
            "--adapter-dir", str(adapter_dir), "--quiet"]  # fmt: skip
    with serve_process(*args) as (url, lines), httpx.Client(base_url=url, timeout=60) as client:
        assert_refused(client, "escape")
        assert_refused(client, str(adapters["late"]))
        assert client.post("/v1/adapters", json={"name": "late-copy", "path": "late-copy"}).status_code == 202
        assert wait_ready(client, "late-copy")["status"] == "ready"


def plan_with(session, variants, profile=None):
    from tierlm.offload.planner.search import plan
    from tierlm.probe.machine import load_bandwidths

    loaded = session.loaded
    baseline = loaded.placement.charges["device"]["baseline"]
    return plan(loaded.config, loaded.sizes, profile or session.profile, load_bandwidths(loaded.device),
                accelerator=False, baseline_bytes=baseline, variants=variants)


def test_the_plan_charges_the_base_once_and_each_variant_its_own_bytes(session):
    placement = session.loaded.placement
    overlays = {name: overlay for name, (_, overlay) in session.variants.items()}
    assert set(overlays) >= {"attn", "dora"}
    device = placement.charges["device"]
    assert device["variants"] == sum(o.nbytes for o in overlays.values())
    assert device["weights"] == plan_with(session, ()).charges["device"]["weights"]  # the base, once
    assert device["variants"] < device["weights"]  # not a copy of the model per variant
    note = next(n for n in placement.notes if n.startswith("LoRA variants"))
    assert "attn unmerged" in note and "dora merged" in note


def test_a_variant_that_does_not_fit_is_refused_by_the_plan(session):
    from dataclasses import replace

    from tierlm.offload.planner.context import VariantCharge

    tight = replace(session.profile, device_memory=sum(session.loaded.placement.charges["device"].values()))
    plan_with(session, (), tight)  # the base alone fits
    with pytest.raises(TierlmError, match="variants"):
        plan_with(session, (VariantCharge("huge", "merged", 64 << 20),), tight)


# Run in a fresh process so the RSS it reads is this server's own: load the base, read RSS, add
# two variants, read it again (freed memory handed back to the OS first, as a long-running server's
# allocator eventually does).
MEMORY_CHILD = """
import ctypes, gc, json, sys
from pathlib import Path
import tierlm.store.variants, tierlm.lora.merge, tierlm.cache.convert  # imported before measuring
from tierlm.profile import load_profile
from tierlm.runtime.session import open_session

def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

model, profile, *adapters = sys.argv[1:]
session = open_session(model, load_profile(profile), device="cpu", dtype="fp32")
session.variant_store()
base = rss()
for i, adapter in enumerate(adapters):
    session.add_variant(f"v{i}", ((Path(adapter), 1.0),))
after = rss()
print(json.dumps({"base": base, "after": after, "weights": session.loaded.store.base.nbytes(),
                  "variants": {n: [o.mode, o.nbytes] for n, (_, o) in session.variants.items()}}))
"""
MEMORY_MARGIN = 12 << 20  # allocator slack and lazily created buffers, well under one model copy


@pytest.mark.e2e
def test_two_attention_variants_cost_their_own_bytes_not_model_copies(root):
    import json
    import subprocess
    import sys

    from peft import LoraConfig

    model = root / "memory-base"
    make_model(model, hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1408, vocab=320)
    profile = write_profile(root / "memory.toml", context_length=64, batch_size=2)
    profile.write_text(profile.read_text().replace('quant = "none"', 'quant = "int8"'))
    configs = [LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
               LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"])]
    adapters = [save_adapter(model, root / f"memory-adapter-{i}", config, seed=40 + i) for i, config in enumerate(configs)]
    child = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(model), str(profile), *map(str, adapters)],
                           capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert child.returncode == 0, child.stderr[-3000:]
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    modes = {mode for mode, _ in figures["variants"].values()}
    assert modes == {"merged", "unmerged"}, figures
    added = sum(nbytes for _, nbytes in figures["variants"].values())
    assert added < figures["weights"] / 2  # attention only: the MLP, embedding and head stay shared
    assert figures["after"] - figures["base"] <= added + MEMORY_MARGIN, figures
    assert figures["after"] - figures["base"] < figures["weights"]  # not even one more copy of the model


def test_serve_lora_spec_parsing(tmp_path):
    adapter = tmp_path / "chat"
    adapter.mkdir()
    assert parse_variant_spec(f"support={adapter}:0.5") == ("support", adapter, 0.5)
    assert parse_variant_spec(f"v1.2_x-y={adapter}") == ("v1.2_x-y", adapter, 1.0)
    assert parse_variant_spec(f"{adapter}:0.5") == (None, adapter, 0.5)  # merged into the base
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert parse_variant_spec(str(odd)) == (None, odd, 1.0)  # an existing path is a path
    with pytest.raises(TierlmError, match="does not exist"):
        parse_variant_spec(f"name={tmp_path / 'missing'}")
    other = tmp_path / "other"
    other.mkdir()
    merged, variants = split_variant_specs([f"a={adapter}", f"{other}:0.3", f"b={other}", f"a={other}:0.5"])
    assert merged == (f"{other}:0.3",)
    assert variants == {"a": ((adapter, 1.0), (other, 0.5)), "b": ((other, 1.0),)}
