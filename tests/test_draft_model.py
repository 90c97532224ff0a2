"""Draft models (runtime/draft_model.py): a smaller model of the same tokenizer drafts, the target verifies.

The target here is a random model whose last two layers barely change the residual stream, and
the draft its first two layers alone: the draft agrees with the target most of the time but not
always, so verification sees drafts that stand and drafts that fall. Greedy output with the draft
is the output without it; a draft that cannot be one is refused with one line before anything loads.
"""

from __future__ import annotations

import pytest
import torch

from tests.cli_runner import PROGRESS_LINE, run_tierlm
from tests.tiny import make_model, write_profile, write_tokenizer
from tierlm.errors import TierlmError
from tierlm.profile import load_profile
from tierlm.runtime.draft_model import DraftModel, resolve_draft
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.session import open_session
from tierlm.runtime.source import Beside, resolve_source
from tierlm.runtime.speculative import DraftPolicy, DraftSettings
from tierlm.runtime.tokenizer import Tokenizer

TARGET_LAYERS, DRAFT_LAYERS = 4, 2


class EveryPass(DraftPolicy):
    """Drafts the full length at every step (the policy's own choices are test_speculative's)."""

    def allowed(self) -> int:
        return self.limit


@pytest.fixture(autouse=True)
def drafts_every_step(monkeypatch):
    import tierlm.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "DraftPolicy", EveryPass)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft, profile): the target with its last layers' outputs shrunk, the draft its
    first DRAFT_LAYERS layers saved as a model of their own, a roomy profile."""
    root = tmp_path_factory.mktemp("draft-model")
    target, draft = root / "target", root / "draft"
    target.mkdir()
    model = make_model(target, layers=TARGET_LAYERS, with_tokenizer=False)
    with torch.no_grad():
        for layer in model.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(target)
    write_tokenizer(target, 320)
    model.model.layers = model.model.layers[:DRAFT_LAYERS]
    model.config.num_hidden_layers = DRAFT_LAYERS
    model.save_pretrained(draft)
    write_tokenizer(draft, 320)
    profile = write_profile(root / "roomy.toml", context_length=256, batch_size=1)
    return target, draft, profile


def greedy_run(session, prompt: list[int], draft: DraftSettings | None, tokens: int = 48):
    generation = session.engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=tokens), draft=draft)
    generation.text()
    return list(generation.token_ids), generation.stats


def test_greedy_output_with_a_draft_model_is_the_output_without_it(models):
    target, draft, profile = models
    drafting = DraftSettings.parse(str(draft), 5)
    with open_session(str(target), load_profile(str(profile)), draft=drafting) as session:
        tokenizer = session.tokenizer
        for text in ("hello world, how are you?", "the lazy dog. the quick brown fox"):
            prompt = tokenizer.encode(text)
            plain, _ = greedy_run(session, prompt, DraftSettings())
            drafted, stats = greedy_run(session, prompt, drafting)
            assert drafted == plain
            assert stats.drafted > 0 and stats.verify_passes > 0
            # The draft is the target's own first layers: most of its drafts stand, not all.
            assert stats.drafted // 2 <= stats.accepted < stats.drafted, stats
            held = session.draft_model
            assert held.cache.offset == len(held.cached_ids) <= len(prompt) + len(drafted)
        # A second turn extending the first keeps the draft's cache of the common prefix.
        before = list(session.draft_model.cached_ids)
        longer = prompt + drafted + tokenizer.encode(" again")
        plain, _ = greedy_run(session, longer, DraftSettings(), tokens=16)
        assert greedy_run(session, longer, drafting, tokens=16)[0] == plain
        assert session.draft_model.cached_ids[: len(prompt)] == before[: len(prompt)]


def test_a_draft_far_behind_restarts_on_a_recent_window_and_output_is_unchanged(models, monkeypatch):
    """A catch-up longer than WINDOW tokens (a long prompt, a long pause) prefills only the last
    WINDOW into the draft's cache: the draft guesses from recent context, the output is the target's."""
    monkeypatch.setattr(DraftModel, "WINDOW", 8)
    target, draft, profile = models
    drafting = DraftSettings.parse(str(draft), 4)
    with open_session(str(target), load_profile(str(profile)), draft=drafting) as session:
        prompt = session.tokenizer.encode("the quick brown fox jumps over the lazy dog. hello world, how are you?")
        assert len(prompt) > 12
        plain, _ = greedy_run(session, prompt, DraftSettings(), tokens=24)
        drafted, stats = greedy_run(session, prompt, drafting, tokens=24)
        assert drafted == plain and stats.drafted > 0
        held = session.draft_model
        # Restarted on the prompt's last 8 tokens, or later ones (plain steps between passes leave it behind).
        assert held.start >= len(prompt) - 8 > 0
        assert held.cached_ids == (prompt + drafted)[held.start : held.start + len(held.cached_ids)]


def test_generate_with_a_draft_model_prints_what_it_prints_without(models):
    target, draft, profile = models
    common = ("generate", "the quick brown fox", "--model", str(target), "--profile", str(profile),
              "--temperature", "0", "--max-new-tokens", "24")  # fmt: skip
    plain = run_tierlm(*common)
    drafted = run_tierlm(*common, "--draft", str(draft), "--draft-tokens", "4")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and plain.stdout.strip()


def test_bench_reports_what_the_draft_model_drafted_and_kept(models):
    import json

    target, draft, profile = models
    result = run_tierlm("bench", "--model", str(target), "--profile", str(profile), "--prompt-tokens", "8",
                        "--tokens", "16", "--runs", "1", "--draft", str(draft), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    drafts = json.loads(result.stdout)["draft"]
    assert drafts["source"] == str(draft) and drafts["verify_passes"] > 0
    assert 0 < drafts["accepted"] <= drafts["drafted"]
    assert "bytes_read_per_token" not in drafts  # resident: nothing streamed


def test_chat_drafts_by_default_and_its_stats_say_what_it_drafted(models):
    target, draft, profile = models
    common = ("chat", "--model", str(target), "--profile", str(profile), "-t", "0", "-n", "16")
    stdin = "the quick brown fox. the quick brown fox.\n/stats\n"
    default, off, model = (run_tierlm(*common, *extra, stdin=stdin) for extra in ((), ("--draft", "off"),
                                                                                   ("--draft", str(draft))))
    for result in (default, off, model):
        assert result.returncode == 0, result.stderr
    assert "drafts    auto: " in default.stdout and "verification passes" in default.stdout
    assert "drafts " not in off.stdout
    assert f"drafts    {draft}: " in model.stdout
    reply = [line for line in default.stdout.splitlines() if line.strip()][0]
    assert reply == [line for line in off.stdout.splitlines() if line.strip()][0]  # greedy: the same reply


@pytest.fixture(scope="module")
def misfits(models, tmp_path_factory):
    """Drafts that cannot be: another tokenizer, and more weights than the target."""
    root = tmp_path_factory.mktemp("misfit-drafts")
    other, larger = root / "other-tokenizer", root / "larger"
    for folder in (other, larger):
        folder.mkdir()
    make_model(other, layers=1, with_tokenizer=False)
    write_tokenizer(other, 300)
    # More bytes than the target as each is held (the draft in its own format, int8; the target as stored).
    make_model(larger, hidden=256, intermediate=512, layers=2, with_tokenizer=False)
    write_tokenizer(larger, 320)
    return {"other": other, "larger": larger}


@pytest.mark.parametrize("draft, extra, message", [
    ("other", (), "has another tokenizer: 300 tokens against the model's"),
    ("larger", (), "is not smaller than the model it drafts for"),
    ("/no/such/draft-model", (), "is neither a draft source (ngram, auto, off) nor a model"),
    ("draft", ("--stages", "2"), "a draft model runs in one process, not over pipeline stages"),
])  # fmt: skip
def test_a_draft_that_cannot_be_one_gets_one_line_before_anything_loads(models, misfits, draft, extra, message):
    target, good, profile = models
    path = {"draft": good, **misfits}.get(draft, draft)
    result = run_tierlm("generate", "hello", "--model", str(target), "--profile", str(profile),
                        "--draft", str(path), *extra)  # fmt: skip
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "loading weights" not in result.stderr


def test_served_requests_draft_with_the_model_each_through_a_cache_of_its_own(models, monkeypatch):
    """`serve --draft MODEL`: concurrent requests each draft through a draft cache of their own
    (the draft model's weights shared), and each reply is the one the request gets with
    `draft: "off"`."""
    import threading

    import httpx

    import tierlm.server.batch as batch_module
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import BackgroundServer

    monkeypatch.setattr(batch_module, "DraftPolicy", EveryPass)
    target, draft, profile = models
    drafting = DraftSettings.parse(str(draft), 4)
    texts = ["the quick brown fox jumps", "hello world, how are you?", "the lazy dog. the lazy dog."]
    with open_session(str(target), load_profile(str(profile)), draft=drafting, draft_caches=2) as session:
        with BackgroundServer(session, ServerOptions(aliases=("tiny",), draft=drafting, parallel=2)) as server:

            def ask(text: str, extra: dict, into: list) -> None:
                body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 20,
                        "temperature": 0, **extra}  # fmt: skip
                with httpx.Client(base_url=server.url, timeout=60) as client:
                    answer = client.post("/v1/chat/completions", json=body).json()
                into.append((text, answer["choices"][0]["message"]["content"]))

            drafted: list = []
            threads = [threading.Thread(target=ask, args=(text, {}, drafted)) for text in texts]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            plain: list = []
            for text in texts:
                ask(text, {"draft": "off"}, plain)
            with httpx.Client(base_url=server.url, timeout=60) as client:
                speculation = client.get("/stats").json()["speculation"]
    assert sorted(drafted) == sorted(plain) and len(plain) == len(texts)
    assert len({reply for _, reply in plain}) == len(texts)  # three different replies, each its own
    assert speculation["draft"] == str(draft) and speculation["drafted"] > 0
    assert 0 < speculation["accepted"] <= speculation["drafted"]


def test_the_draft_is_charged_its_weights_kv_cache_and_scratch(models):
    target, draft, profile = models
    profile = load_profile(str(profile))
    source = resolve_source(target, "none", accelerator=False)
    checked = resolve_draft(str(draft), source, Tokenizer.from_dir(target), profile, accelerator=False)
    weights = sum(p.stat().st_size for p in draft.glob("*.safetensors"))
    config = checked.source.config
    kv = DRAFT_LAYERS * 2 * config.num_key_value_heads * config.head_dim * 4 * profile.context_length
    assert checked.context == profile.context_length
    assert checked.beside.nbytes > 0.95 * weights + kv  # safetensors headers aside


def test_a_model_with_no_room_left_beside_it_is_refused_naming_what_is_beside(models):
    target, _, _ = models
    profile = load_profile("4gb")
    load_model(target, device="cpu", profile=profile, quant="none").close()  # alone it fits
    with pytest.raises(TierlmError, match="with the draft model d beside it .* does not fit profile 4gb"):
        load_model(target, device="cpu", profile=profile, quant="none", beside=Beside("the draft model d", 64 << 30))
