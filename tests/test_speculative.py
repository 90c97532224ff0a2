"""Speculative decoding (runtime/speculative.py): prompt-lookup drafts verified in one forward.

Greedy output with drafts is the output without them on every family, MoE included; the cache
rolled back after rejected drafts holds what a never-speculated run's holds; the rejection rule
keeps the sampling distribution (checked per position against softmax, and over many seeded runs
of a model against plain sampling); bad --draft values get one line before anything loads.
"""

from __future__ import annotations

import pytest
import torch

from tests.cli_runner import run_tierlm
from tests.tiny import DECODE_ATOL, DECODE_CASES, MOE_CASES, checkpoint_maker, make_model, write_tokenizer
from tierlm.errors import TierlmError
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import Sampler, SamplingParams
from tierlm.runtime.speculative import DraftPolicy, DraftSettings, PromptLookup
from tierlm.runtime.tokenizer import Tokenizer

NGRAM = DraftSettings("ngram", 6)
CASES = {**DECODE_CASES, **MOE_CASES}


class EveryPass(DraftPolicy):
    """Drafts the full length at every step: what the tests check must not hang on timings (the
    policy's own choices are tested with stated costs below)."""

    def allowed(self) -> int:
        return self.limit


@pytest.fixture(autouse=True)
def drafts_every_step(monkeypatch):
    import tierlm.runtime.engine as engine_module
    import tierlm.server.batch as batch_module

    monkeypatch.setattr(engine_module, "DraftPolicy", EveryPass)
    monkeypatch.setattr(batch_module, "DraftPolicy", EveryPass)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = checkpoint_maker(tmp_path_factory, CASES)

    def get(case):
        folder = made(case)
        if not (folder / "tokenizer.json").exists():
            write_tokenizer(folder, 320)
        return folder

    return get


def engine_for(folder, quant: str = "none") -> Engine:
    loaded = load_model(folder, device="cpu", dtype=torch.float32, quant=quant, context_length=160)
    return Engine(loaded, Tokenizer.from_dir(folder))


def looping_prompt(engine: Engine) -> list[int]:
    """A prompt that repeats itself, so its continuation is drafted from it."""
    return engine.tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 3 + "the quick brown")


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    lookup = PromptLookup([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6])
    # The tail (5, 6) last occurred before at 5..6, followed by 7 9 2 5 6: the latest wins.
    assert lookup.draft(3) == [7, 9, 2]
    lookup.extend([7])  # tail (5, 6, 7): its latest earlier occurrence is followed by 9 2 5 6 7
    assert lookup.draft(10) == [9, 2, 5, 6, 7]
    lookup.extend([4])  # (7, 4) never occurred before: nothing to draft
    assert lookup.draft(4) == []
    assert PromptLookup([1, 2, 3]).draft(4) == []  # the tail's own occurrence is not an earlier one


def test_the_policy_drafts_the_length_that_pays_most_at_the_measured_costs():
    # A resident CPU: up to four tokens a pass cost about a step, nine cost three.
    policy = DraftPolicy(8)
    assert policy.allowed() == 0  # a plain step is timed first
    policy.plain_step(0.010)
    assert policy.allowed() == 8  # nothing measured longer: as cheap as a step, the full length
    policy.verified(8, 2, 0.030)
    assert policy.cost(4) == pytest.approx(0.020)  # between the step and the pass measured
    policy.verified(3, 3, 0.011)
    assert policy.allowed() == 3  # 3 drafts at about a step beat 8 at three steps
    # Read from disk, every pass costs one read of the weights: the longest drafts pay most.
    streamed = DraftPolicy(8)
    streamed.plain_step(0.100)
    streamed.verified(8, 2, 0.104)
    streamed.verified(3, 1, 0.101)
    assert streamed.allowed() >= 6  # long drafts (the last few tokens add little at a = 0.5)


def test_the_policy_pauses_drafts_that_do_not_pay_for_twice_as_long_each_time():
    policy = DraftPolicy(4)
    policy.plain_step(0.010)
    for _ in range(6):  # drafts that never stand, at a step's cost and more
        policy.verified(policy.allowed() or 1, 0, 0.012)
        if policy.allowed() == 0:
            break
    assert policy.allowed() == 0 and policy.acceptance < 0.2
    first = policy.paused
    for _ in range(first):
        assert policy.allowed() == 0
        policy.plain_step(0.010)
    assert policy.allowed() > 0  # the probe after the pause
    policy.verified(policy.allowed(), 0, 0.012)
    assert policy.paused == 2 * first
    for _ in range(2 * first):
        policy.plain_step(0.010)
    policy.verified(policy.allowed(), policy.allowed(), 0.011)  # every draft stood: no pause
    policy.verified(policy.allowed(), policy.allowed(), 0.011)
    assert policy.paused == 0 and policy.allowed() > 0


def test_drafts_that_would_not_pay_even_were_all_to_stand_pause_for_the_longest():
    # A draft model about as slow as the target: five tokens for six steps' time.
    policy = DraftPolicy(4)
    policy.plain_step(0.010)
    policy.verified(4, 4, 0.060)
    assert policy.ceiling() * 0.010 < DraftPolicy.MARGIN
    assert policy.paused == DraftPolicy.PAUSE_STEPS[1]
    assert DraftPolicy(4, policy.costs).paused == DraftPolicy.PAUSE_STEPS[1]  # the next sequence does not probe
    cheap = DraftPolicy(4)  # the same acceptance at a step's cost: drafting goes on
    cheap.plain_step(0.010)
    cheap.verified(4, 4, 0.011)
    assert cheap.paused == 0 and cheap.allowed() == 4


class ScriptedDrafts(PromptLookup):
    """Drafts the reference continuation with every third pass's drafts wrong from their second
    token on: verification sees drafts that stand, fall at once and fall midway, whatever the
    family's random weights make it say."""

    def __init__(self, reference: list[int], tokens: list[int], *, corrupt: bool = True):
        self.reference, self.passes, self.corrupt = reference, 0, corrupt
        super().__init__(tokens)

    def draft(self, limit: int) -> list[int]:
        at = len(self.tokens)
        drafts = list(self.reference[at : at + limit])
        self.passes += 1
        if not self.corrupt:
            return drafts
        if self.passes % 3 == 0 and len(drafts) > 1:
            drafts[1:] = [(t + 1) % 320 for t in drafts[1:]]
        elif self.passes % 3 == 1 and drafts:
            drafts[0] = (drafts[0] + 7) % 320
        return drafts


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_output_with_drafts_is_the_output_without_them(checkpoint, case, monkeypatch):
    import tierlm.runtime.engine as engine_module

    engine = engine_for(checkpoint(case))
    prompt = looping_prompt(engine)
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    plain = engine.generate(prompt, greedy)
    plain.text()
    engine.reset()
    monkeypatch.setattr(engine_module, "PromptLookup", lambda tokens: ScriptedDrafts(prompt + plain.token_ids, tokens))
    drafted = engine.generate(prompt, greedy, draft=NGRAM)
    drafted.text()
    assert drafted.token_ids == plain.token_ids
    assert 0 < drafted.stats.accepted < drafted.stats.drafted


def test_drafts_are_accepted_and_rejected_and_int8_output_is_unchanged(checkpoint):
    """On the fused int8 path too, with both outcomes exercised: a tiny random model repeats
    itself, so some drafts stand and some do not."""
    engine = engine_for(checkpoint("llama-gqa"), quant="int8")
    prompt = looping_prompt(engine)
    greedy = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    plain = engine.generate(prompt, greedy)
    plain.text()
    engine.reset()
    drafted = engine.generate(prompt, greedy, draft=NGRAM)
    drafted.text()
    assert drafted.token_ids == plain.token_ids
    stats = drafted.stats
    assert 0 < stats.accepted < stats.drafted


def test_a_seeded_sampled_run_gives_the_tokens_it_gives_without_drafts(checkpoint, monkeypatch):
    """Each verified position is sampled as its plain step samples it, with the same draws (the
    rows of a pass are bit for bit the steps' on the fused int8 path): drafting changes how fast a
    seeded reply comes, never which reply."""
    import tierlm.runtime.engine as engine_module

    engine = engine_for(checkpoint("llama-gqa"), quant="int8")
    prompt = looping_prompt(engine)
    for seed in range(4):
        params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40, ignore_eos=True, seed=seed)
        engine.reset()
        plain = engine.generate(prompt, params)
        plain.text()
        engine.reset()
        reply = prompt + plain.token_ids
        monkeypatch.setattr(engine_module, "PromptLookup", lambda tokens: ScriptedDrafts(reply, tokens))
        drafted = engine.generate(prompt, params, draft=NGRAM)
        drafted.text()
        assert drafted.token_ids == plain.token_ids, seed
        assert 0 < drafted.stats.accepted < drafted.stats.drafted


def both_replies(plain_engine: Engine, drafted_engine: Engine, prompt: list[int], params: SamplingParams):
    """(the plain engine's whole reply, the drafting engine's) to `prompt`."""
    plain = plain_engine.generate(prompt, params)
    plain.text()
    drafted = drafted_engine.generate(prompt, params, draft=NGRAM)
    drafted.text()
    return plain, drafted


def test_the_cache_after_rejected_drafts_holds_what_a_never_speculated_run_holds(checkpoint):
    folder = checkpoint("llama-gqa")
    prompt_engine, drafted_engine = engine_for(folder), engine_for(folder)
    prompt = looping_prompt(prompt_engine)
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    plain, drafted = both_replies(prompt_engine, drafted_engine, prompt, greedy)
    assert drafted.stats.accepted < drafted.stats.drafted  # some positions were rolled back
    assert drafted_engine.cached_ids == prompt_engine.cached_ids == prompt + plain.token_ids[:-1]
    a, b = prompt_engine.cache, drafted_engine.cache
    assert a.offset == b.offset == len(prompt_engine.cached_ids)
    n = a.offset
    torch.testing.assert_close(b.keys[..., :n, :], a.keys[..., :n, :], atol=DECODE_ATOL, rtol=0)
    torch.testing.assert_close(b.values[..., :n, :], a.values[..., :n, :], atol=DECODE_ATOL, rtol=0)
    # A follow-up turn reuses the rolled-back cache and continues as the plain one does.
    follow = prompt + plain.token_ids + prompt_engine.tokenizer.encode(" over the lazy dog")
    after_plain = prompt_engine.generate(follow, greedy)
    after_drafted = drafted_engine.generate(follow, greedy, draft=NGRAM)
    assert after_drafted.text() == after_plain.text()
    assert after_drafted.stats.reused_tokens == after_plain.stats.reused_tokens == len(prompt) + len(plain.token_ids) - 1


def test_a_stop_inside_a_verified_run_ends_there_with_the_cache_rolled_back(checkpoint):
    folder = checkpoint("llama-gqa")
    plain_engine, drafted_engine = engine_for(folder, "int8"), engine_for(folder, "int8")
    prompt = looping_prompt(plain_engine)
    free = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    reference, _ = both_replies(plain_engine, drafted_engine, prompt, free)
    # Stop on a token the drafted run accepted late in the reply: limit the reply just after it.
    limit = len(reference.token_ids) - 3
    plain_engine.reset()
    drafted_engine.reset()
    params = SamplingParams(temperature=0, max_new_tokens=limit, ignore_eos=True)
    plain = plain_engine.generate(prompt, params)
    drafted = drafted_engine.generate(prompt, params, draft=NGRAM)
    assert drafted.text() == plain.text()
    assert drafted.token_ids == reference.token_ids[:limit] and drafted.stats.finish_reason == "length"
    assert drafted_engine.cached_ids == prompt + reference.token_ids[: limit - 1]
    assert drafted_engine.cache.offset == len(drafted_engine.cached_ids)


@pytest.mark.parametrize("filters", [dict(), dict(top_k=3), dict(top_p=0.8), dict(min_p=0.2, temperature=0.7)])
def test_the_rejection_rule_keeps_each_positions_distribution(filters):
    """A drafted token accepted by p(draft), else replaced by a sample of p without it: the token
    at the position is distributed as p, whichever token was drafted."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=filters.pop("temperature", 1.0), seed=7, **filters)
    sampler = Sampler(params)
    expected = sampler._probabilities(logits)
    draws = 6000
    for draft in (0, 3, 6):  # the likeliest, a middling one, one the filters may drop
        counts = torch.zeros(len(logits))
        accepted = 0
        for _ in range(draws):
            token, stood = sampler.verify(logits, draft)
            counts[token] += 1
            accepted += stood
            assert stood == (token == draft)
        assert counts[expected == 0].sum() == 0  # nothing a filter removed ever comes out
        keep = expected > 0
        observed, wanted = counts[keep].double(), expected[keep].double() * draws
        statistic = float(((observed - wanted) ** 2 / wanted).sum())
        assert chi_squared_p(statistic, int(keep.sum()) - 1) > 1e-3, (draft, counts, expected * draws)
        assert abs(accepted / draws - float(expected[draft])) < 0.03


class GreedyDrafts(PromptLookup):
    """Drafts the model's own greedy continuation of the sequence (by its transformers twin): the
    likeliest tokens in every context, so the acceptance rule decides often and both ways."""

    def __init__(self, model, tokens: list[int], length: int = 3):
        self.model, self.length = model, length
        super().__init__(tokens)

    def draft(self, limit: int) -> list[int]:
        ids = list(self.tokens)
        with torch.no_grad():
            for _ in range(min(limit, self.length)):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(self.tokens) :]


def test_sampled_replies_with_drafts_follow_the_models_distribution(tmp_path, monkeypatch):
    """Over many seeded runs, the tokens a tiny model samples with drafts are distributed as the
    ones it samples without (a two-sample chi-squared test per position)."""
    import tierlm.runtime.engine as engine_module

    reference = make_model(tmp_path, vocab=320, layers=2, seed=3)
    engine = Engine(load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=96), Tokenizer.from_dir(tmp_path))
    prompt = looping_prompt(engine)
    runs, length = 400, 6
    monkeypatch.setattr(engine_module, "PromptLookup", lambda tokens: GreedyDrafts(reference, tokens))
    plain, drafted, verified, accepted = [], [], 0, 0
    for seed in range(runs):
        params = SamplingParams(temperature=0.1, max_new_tokens=length, ignore_eos=True, seed=seed)
        engine.reset()
        g = engine.generate(prompt, params)
        g.text()
        plain.append(g.token_ids)
        engine.reset()
        g = engine.generate(prompt, params, draft=NGRAM)
        g.text()
        drafted.append(g.token_ids)
        verified += g.stats.verify_passes
        accepted += g.stats.accepted
    assert verified >= runs and accepted > runs // 2  # every run verified drafts; many stood
    for position in range(1, length):
        a = [ids[position] for ids in plain]
        b = [ids[position] for ids in drafted]
        tokens = sorted(set(a) | set(b))
        table = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
        # Tokens seen fewer than 5 times together are pooled (the test's expected counts need it).
        common = [i for i, t in enumerate(tokens) if table[0][i] + table[1][i] >= 5]
        rare = [i for i in range(len(tokens)) if i not in common]
        rows = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
        rows = [row if rare else row[:-1] for row in rows]
        if len(rows[0]) < 2:
            assert a == b or sorted(a) == sorted(b)
            continue
        assert contingency_p(rows) > 1e-3, (position, tokens, table)


def chi_squared_p(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-squared with `dof` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))  # fmt: skip


def contingency_p(rows: list[list[int]]) -> float:
    """Pearson's test that the rows of a contingency table come from one distribution."""
    table = torch.tensor(rows, dtype=torch.float64)
    wanted = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - wanted) ** 2 / wanted).sum())
    return chi_squared_p(statistic, (table.shape[0] - 1) * (table.shape[1] - 1))


@pytest.mark.parametrize("flags, message", [
    (["--draft-tokens", "0"], "--draft-tokens must be an integer from 1 to 64, not 0"),
    (["--draft-tokens", "-1"], "--draft-tokens must be an integer from 1 to 64, not -1"),
    (["--draft-tokens", "1000"], "--draft-tokens must be an integer from 1 to 64, not 1000"),
    (["--draft", "ngram", "--draft-tokens", "65"], "--draft-tokens must be an integer from 1 to 64, not 65"),
])  # fmt: skip
def test_bad_draft_flags_get_one_line_before_anything_loads(flags, message):
    result = run_tierlm("generate", "hello", "--model", "no-such-model-anywhere", *flags)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "no-such-model" not in result.stderr  # refused before the model was looked up


def test_draft_settings_refuse_what_the_flags_refuse():
    with pytest.raises(TierlmError, match="not a draft source"):
        DraftSettings("auto-ish")
    assert DraftSettings.parse("auto", None).kind == "auto" and DraftSettings.parse(None, 3).kind == "off"
    named = DraftSettings.parse("smollm2-q4_k_m", 4)
    assert named.uses_model and named.model == "smollm2-q4_k_m" and named.tokens == 4
    with pytest.raises(TierlmError, match="from 1 to 64"):
        DraftSettings("ngram", True)
    assert not DraftSettings().enabled and DraftSettings("ngram").enabled


def test_the_server_verifies_each_drafting_jobs_drafts_beside_the_shared_step(tmp_path, monkeypatch):
    """Four greedy jobs through one runner, three drafting (their drafts the engine's reply, every
    third pass wrong), one plain: every reply is the engine's alone, drafts stood and fell, and each
    slot ends holding the positions its sequence kept."""
    import tierlm.server.batch as batch_module
    from tests.test_server_batch import ImmediateLoop, drain, reference
    from tierlm.server.batch import BatchRunner
    from tierlm.server.jobs import Job

    make_model(tmp_path)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=128)
    tokenizer = Tokenizer.from_dir(tmp_path)
    engine = Engine(loaded, tokenizer)
    texts = ["the quick brown fox " * 3, "hello world, how are you? hello world", "lazy dog lazy dog", "jumps over"]
    settings = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (30, 24, 28, 20)]
    settings[1] = SamplingParams(temperature=0, repetition_penalty=1.3, max_new_tokens=24, stop=("ow",))
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    expected = [reference(engine, p, s) for p, s in zip(prompts, settings)]
    replies = {tuple(p): p + ids for p, (ids, _, _) in zip(prompts, expected)}
    monkeypatch.setattr(batch_module, "PromptLookup", lambda tokens: ScriptedDrafts(replies[tuple(tokens)], tokens))
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=4, slots=4)
    drafts = [NGRAM, NGRAM, NGRAM, None]
    jobs = [Job(p, s, deadline=None, loop=ImmediateLoop(), draft=d) for p, s, d in zip(prompts, settings, drafts)]
    sequences = {job: runner.admit(job) for job in jobs}
    drafted = accepted = 0
    while runner.active:
        report = runner.step()
        drafted, accepted = drafted + report.drafted, accepted + report.accepted
    for job, (ids, text, reason) in zip(jobs, expected):
        assert sequences[job].token_ids == ids
        assert drain(job) == (text, reason)
    assert 0 < accepted < drafted
    for job, seq in sequences.items():  # the prompt and every token but the last, nothing drafted past it
        assert runner.cache.lengths[seq.slot] == len(job.prompt_ids) + len(seq.token_ids) - 1
    assert runner.cache.pool.used <= runner.cache.pool.size


def test_requests_turn_drafts_on_and_off_and_bad_values_get_a_400(tmp_path):
    import httpx

    from tests.tiny import write_profile
    from tierlm.profile import load_profile
    from tierlm.runtime.session import open_session
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import BackgroundServer

    make_model(tmp_path / "tiny-chat")
    profile = load_profile(str(write_profile(tmp_path / "serve.toml", context_length=256, batch_size=2)))
    session = open_session(str(tmp_path / "tiny-chat"), profile, device="cpu", dtype="fp32")
    content = "the quick brown fox jumps over the lazy dog. " * 3
    chat = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 40, "temperature": 0}
    ollama = {"model": "tiny", "messages": chat["messages"], "stream": False,
              "options": {"temperature": 0, "num_predict": 40}}  # fmt: skip
    try:
        with BackgroundServer(session, ServerOptions(aliases=("tiny",), draft=DraftSettings("ngram", 4))) as server:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                default = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
                off = client.post("/v1/chat/completions", json={**chat, "draft": "off"}).json()
                assert off["choices"][0]["message"]["content"] == default
                more = client.post("/v1/chat/completions", json={**chat, "draft_tokens": 16}).json()
                assert more["choices"][0]["message"]["content"] == default
                stats = client.get("/stats").json()["speculation"]
                assert stats["draft"] == "ngram" and stats["draft_tokens"] == 4
                assert stats["drafted"] >= stats["accepted"] >= 0
                metrics = client.get("/metrics").text
                assert "tierlm_draft_tokens_total" in metrics and "tierlm_draft_accepted_tokens_total" in metrics
                reply = client.post("/api/chat", json={**ollama, "options": {**ollama["options"], "draft": "off"}})
                assert reply.status_code == 200 and reply.json()["message"]["content"] == default
                for field, value in (("draft", "turbo"), ("draft", 3), ("draft_tokens", 0), ("draft_tokens", 65)):
                    bad = client.post("/v1/chat/completions", json={**chat, field: value})
                    assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (field, value)
                    bad = client.post("/api/chat", json={**ollama, "options": {**ollama["options"], field: value}})
                    assert bad.status_code == 400 and field in bad.text, (field, value)
    finally:
        session.close()


def test_the_planner_prices_a_pass_and_weighs_steps_with_nothing_to_draft():
    from tierlm.runtime.acceptance import Acceptance, speculative_rate

    flat = lambda k: 0.010  # noqa: E731 - streamed weights: every pass one read
    assert speculative_rate(flat, Acceptance(10, 10, 10), 8) == (8, pytest.approx(900.0))
    # Half the steps find nothing to draft: those are plain steps.
    half = Acceptance(10, 10, 10, misses=10)
    assert speculative_rate(flat, half, 8)[1] == pytest.approx((0.5 * 9 + 0.5) / 0.010)
    # Positions that cost a step each never pay.
    assert speculative_rate(lambda k: 0.010 * (k + 1), Acceptance(9, 10, 10), 8) == (0, pytest.approx(100.0))


def test_a_drafting_session_records_acceptance_and_plan_predicts_from_it(checkpoint, tmp_path):
    import json

    from tests.tiny import write_profile
    from tierlm.profile import load_profile
    from tierlm.runtime.acceptance import read_acceptance
    from tierlm.runtime.session import open_session

    folder = checkpoint("llama-gqa")
    profile = write_profile(tmp_path / "roomy.toml", context_length=160, batch_size=1)
    with open_session(str(folder), load_profile(str(profile))) as session:
        counts = session.engine.drafting_counts
        prompt = looping_prompt(session.engine)
        generation = session.engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24), draft=NGRAM)
        generation.text()
        passes, stood, checked, misses = counts["lookup"]
        assert passes == generation.stats.verify_passes > 0 and stood == generation.stats.accepted
    record = read_acceptance(folder, "lookup")
    assert (record.passes, record.stood, record.checked, record.misses) == (passes, stood, checked, misses)
    planned = run_tierlm("plan", "--model", str(folder), "--profile", str(profile), "--draft", "ngram", "--json")
    assert planned.returncode == 0, planned.stderr
    predicted = json.loads(planned.stdout)["speculation"]
    assert predicted["acceptance"] == pytest.approx(stood / checked) and predicted["measured_passes"] == passes
    assert predicted["predicted_decode_tokens_per_s"] >= json.loads(planned.stdout)["predicted_decode_tokens_per_s"]


def test_a_verification_pass_reads_the_streamed_blocks_once_for_all_its_tokens(tmp_path, monkeypatch):
    """Layers on disk are read once a forward: a pass of k drafts reads them once for up to k + 1
    tokens, so drafted decoding reads a fraction of plain decoding's weight bytes per token."""
    import tierlm.runtime.engine as engine_module
    from tests.test_offload import placement
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.models import family_class, read_config
    from tierlm.offload.placement import DISK
    from tierlm.runtime.loader import LoadedModel
    from tierlm.store.tiered import TieredStore

    make_model(tmp_path, layers=4)
    art = Artifact.open(ensure_artifact(ConversionRequest(tmp_path, (), "int8")))
    config, cpu = read_config(tmp_path), torch.device("cpu")

    def run(draft: DraftSettings | None) -> tuple[list[int], float]:
        store = TieredStore(art, placement(art, {"layers.2": DISK, "layers.3": DISK}, slots=2))
        model = family_class(config)(config, store, 128, cpu, torch.float32)
        engine = Engine(LoadedModel(config, model, store, 128, cpu, torch.float32), Tokenizer.from_dir(tmp_path))
        try:
            generation = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=42, ignore_eos=True),
                                         draft=draft)  # fmt: skip
            generation.text()
            return list(generation.token_ids), sum(store.stats().bytes_read.values()) / len(generation.token_ids)
        finally:
            store.close()

    prompt = Tokenizer.from_dir(tmp_path).encode("the quick brown fox jumps over the lazy dog")
    plain, plain_bytes = run(None)
    monkeypatch.setattr(engine_module, "PromptLookup", lambda tokens: ScriptedDrafts(prompt + plain, tokens, corrupt=False))
    drafted, drafted_bytes = run(NGRAM)
    assert drafted == plain
    assert plain_bytes > 0 and drafted_bytes < 0.3 * plain_bytes, (plain_bytes, drafted_bytes)


def test_the_server_reads_the_streamed_blocks_once_a_pass(tmp_path, monkeypatch):
    """A served sequence's verification pass reads the layers on disk once for its tokens: /stats
    shows drafting requests reading a fraction of plain ones' weight bytes per token, replies equal."""
    import httpx

    import tierlm.server.batch as batch_module
    from tests.test_offload import placement
    from tests.tiny import write_profile
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.models import family_class, read_config
    from tierlm.offload.placement import DISK
    from tierlm.profile import load_profile
    from tierlm.runtime.loader import LoadedModel
    from tierlm.runtime.session import Session
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import BackgroundServer

    make_model(tmp_path / "tiny", layers=4)
    art = Artifact.open(ensure_artifact(ConversionRequest(tmp_path / "tiny", (), "int8")))
    config, cpu = read_config(tmp_path / "tiny"), torch.device("cpu")
    profile = load_profile(str(write_profile(tmp_path / "serve.toml", context_length=128, batch_size=1)))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "the quick brown fox jumps"}], "max_tokens": 40,
            "temperature": 0}  # fmt: skip

    def served(draft: DraftSettings) -> tuple[str, dict]:
        store = TieredStore(art, placement(art, {"layers.2": DISK, "layers.3": DISK}, slots=2))
        model = family_class(config)(config, store, 128, cpu, torch.float32)
        loaded = LoadedModel(config, model, store, 128, cpu, torch.float32, store.placement, None, "int8")
        with Session(loaded, Tokenizer.from_dir(tmp_path / "tiny"), profile, tmp_path / "tiny", load_s=0.0) as session:
            with BackgroundServer(session, ServerOptions(aliases=("tiny",), draft=draft)) as server:
                with httpx.Client(base_url=server.url, timeout=60) as client:
                    reply = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
                    return reply, client.get("/stats").json()["speculation"]

    from tierlm.store.tiered import TieredStore

    class NeverDraft(DraftPolicy):
        def allowed(self) -> int:
            return 0

    seen: list[PromptLookup] = []  # the plain run's lookup: it holds the sequence's tokens at the end

    def recording(tokens):
        seen.append(PromptLookup(tokens))
        return seen[-1]

    monkeypatch.setattr(batch_module, "DraftPolicy", NeverDraft)
    monkeypatch.setattr(batch_module, "PromptLookup", recording)
    plain, plain_stats = served(NGRAM)
    reference = list(seen[0].tokens)
    monkeypatch.setattr(batch_module, "DraftPolicy", EveryPass)
    monkeypatch.setattr(batch_module, "PromptLookup", lambda tokens: ScriptedDrafts(reference, tokens, corrupt=False))
    drafted, drafted_stats = served(NGRAM)
    assert drafted == plain and drafted_stats["accepted"] > 0
    assert plain_stats["drafted"] == 0 and plain_stats["weight_bytes_read_per_token"] > 0
    assert drafted_stats["weight_bytes_read_per_token"] < 0.5 * plain_stats["weight_bytes_read_per_token"]


def test_a_served_sequence_weighs_its_passes_against_its_share_of_the_batch_step(tmp_path, monkeypatch):
    """A batch of B reads the weights once for B tokens, while a drafting sequence's pass runs
    alone: its policy is told a plain token costs the step's time over the sequences in it."""
    import time as real_time

    import tierlm.server.batch as batch_module
    from tests.test_server_batch import ImmediateLoop
    from tierlm.server.batch import BatchRunner
    from tierlm.server.jobs import Job

    class Clock:  # moves only while the shared decode step runs: 40 ms a step
        now = 0.0

        def perf_counter(self):
            return self.now

        def __getattr__(self, name):
            return getattr(real_time, name)

    clock, told = Clock(), []

    class Recording(DraftPolicy):
        def allowed(self) -> int:
            return self.limit

        def plain_step(self, seconds: float) -> None:
            told.append(seconds)

    class NothingFound(PromptLookup):
        def draft(self, limit: int) -> list[int]:
            return []

    make_model(tmp_path)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=128)
    tokenizer = Tokenizer.from_dir(tmp_path)
    monkeypatch.setattr(batch_module, "time", clock)
    monkeypatch.setattr(batch_module, "DraftPolicy", Recording)
    monkeypatch.setattr(batch_module, "PromptLookup", NothingFound)
    decode = BatchRunner._decode

    decoded: list[int] = []  # sequences in each shared step

    def timed(self, group):
        decode(self, group)
        decoded.append(len(group))
        clock.now += 0.040

    monkeypatch.setattr(BatchRunner, "_decode", timed)
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=4, slots=4)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    for text in ("the quick brown fox", "hello world", "lazy dog", "jumps over"):
        runner.admit(Job(tokenizer.encode(text), params, deadline=None, loop=ImmediateLoop(), draft=NGRAM))
    while runner.active:
        before, steps = len(told), len(decoded)
        runner.step()
        assert len(decoded) == steps + 1  # one group: each step's sequences shared it
        assert told[before:] == [pytest.approx(0.040 / decoded[-1])] * decoded[-1]
    assert 4 in decoded and pytest.approx(0.010) in told


def test_a_stage_failing_under_a_verification_pass_fails_the_batch_not_one_sequence(tmp_path, monkeypatch):
    """A pipeline stage lost during a sequence's own pass is every sequence's failure: it reaches
    the worker, which restarts the pipeline and ends each job with the reason (pipeline_failed)."""
    import tierlm.server.batch as batch_module
    from tests.test_server_batch import ImmediateLoop
    from tierlm.distributed.wire import StageUnreachable
    from tierlm.server.batch import BatchRunner
    from tierlm.server.jobs import Job

    class Always(PromptLookup):
        def draft(self, limit: int) -> list[int]:
            return [5] * limit

    make_model(tmp_path)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=128)
    tokenizer = Tokenizer.from_dir(tmp_path)
    monkeypatch.setattr(batch_module, "DraftPolicy", EveryPass)
    monkeypatch.setattr(batch_module, "PromptLookup", Always)
    runner = BatchRunner(loaded, tokenizer, contexts=1, parallel=2, slots=2)
    job = Job(tokenizer.encode("the quick brown fox"), SamplingParams(temperature=0, max_new_tokens=8),
              deadline=None, loop=ImmediateLoop(), draft=NGRAM)  # fmt: skip
    runner.admit(job)
    forward = loaded.model.forward

    def stage_lost(ids, cache, logits="last", **options):
        if logits == "all":  # a verification pass
            raise StageUnreachable(1, "pipeline stage 1 went away")
        return forward(ids, cache, logits, **options)

    monkeypatch.setattr(loaded.model, "forward", stage_lost)
    with pytest.raises(StageUnreachable):
        for _ in range(4):
            runner.step()
    assert not job.closed  # left for the worker to end with the pipeline's reason
