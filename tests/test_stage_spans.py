"""Pipeline stages in one process (issue 16): a model split by `even_split` into 2 and 3 stages, each
its own `load_model(stage=...)` with its own KV cache, chained by hand (the ids into the first stage,
each stage's hidden states into the next), gives the whole model's logits for prefill, decode and a
batched PagedBatch step, on tiny random models of every family and on the embedded SmolLM2.

The reference is the same loader's whole-model run: the stages run the same ops on the same
tensors in the same order, so the logits are equal bit for bit (not merely close). Each stage's
store holds only its blocks (`StageSpan.blocks`) and its cache only its layers.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import DECODE_CASES, MOE_CASES, make_case, prompt, scattered_slot_prompts
from tierlm.stages import StageSpan, even_split
from tierlm.errors import TierlmError
from tierlm.models import fused_decode
from tierlm.runtime.loader import load_model

CONTEXT = 64
DECODE_TOKENS = (5, 9, 11)

# Every family and its quirks, deep enough for three stages (a tied head puts the embedding on the
# last stage too; the MoE cases mix dense and sparse layers across the stage boundaries).
CASES = {
    "llama-tied": dict(family="llama", layers=4, tied=True),
    "qwen2-bias": {**DECODE_CASES["qwen2-bias"], "layers": 4},
    "qwen3-qk-norm": {**DECODE_CASES["qwen3-qk-norm"], "layers": 3},
    "glm-quarter-rotary": {**DECODE_CASES["glm-quarter-rotary"], "layers": 3},
    "chatglm": {**DECODE_CASES["chatglm"], "layers": 3},
    "mistral-window-3": DECODE_CASES["mistral-window-3"],
    "mixtral": {**MOE_CASES["mixtral"], "layers": 3},
    "qwen2-moe-shared": {**MOE_CASES["qwen2-moe-shared"], "layers": 3},
    "qwen3-moe-dense-and-sparse": MOE_CASES["qwen3-moe-dense-and-sparse"],
}
# Weights as stored (fp32, resident checkpoint) for all; an INT8 artifact for a dense and an MoE one.
PAIRS = [(case, "none") for case in CASES] + [("llama-tied", "int8"), ("qwen3-moe-dense-and-sparse", "int8")]
# The mixture-of-experts cases take seconds each: `make test-fast` chains the dense ones.
SLOW_CASES = {"mixtral", "qwen2-moe-shared", "qwen3-moe-dense-and-sparse"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            made[case] = tmp_path_factory.mktemp(case)
            make_case(made[case], CASES[case])
        return made[case]

    return get


def load_stages(model_dir, stages: int, layers: int, **options) -> list:
    return [load_model(model_dir, stage=span, **options) for span in even_split(layers, stages)]


def chain(stages: list, x: torch.Tensor, caches: list, *, batch: bool = False) -> torch.Tensor:
    """x through every stage in order, each with its own cache; the last stage's logits."""
    for loaded, cache in zip(stages, caches):
        x = loaded.model.forward_batch(x, cache) if batch else loaded.model.forward(x, cache, logits="all")
    return x


def prefill_and_decode(stages: list, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill of `ids` and of one-token decode steps, through the chained stages."""
    caches = [loaded.new_cache() for loaded in stages]
    out = [chain(stages, ids, caches)]
    out += [chain(stages, torch.tensor([[token]]), caches) for token in DECODE_TOKENS]
    for loaded, cache in zip(stages, caches):
        assert cache.keys.shape[0] == len(loaded.span.layers) and cache.offset == ids.shape[1] + len(DECODE_TOKENS)
    return out


def batched_steps(stages: list, vocab: int) -> list[torch.Tensor]:
    """Three prompts prefilled into scattered slots, then two batched decode steps over them."""
    prompts, slots = scattered_slot_prompts(vocab)
    caches = [loaded.new_paged_cache(4, 4) for loaded in stages]
    out = [chain(stages, torch.tensor([p]), [c.slot(s) for c in caches]) for p, s in zip(prompts, slots)]
    tokens = torch.tensor([[3], [7], [1]])
    for _ in range(2):
        logits = chain(stages, tokens, [c.batch(slots) for c in caches], batch=True)
        out.append(logits)
        tokens = logits.argmax(-1, keepdim=True)
    for loaded, cache in zip(stages, caches):
        assert cache.keys.shape[0] == len(loaded.span.layers)
        assert [cache.lengths[s] for s in slots] == [len(p) + 2 for p in prompts]
    return out


def assert_equal_runs(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(got, want), f"max difference {float((got - want).abs().max())}"


def assert_stage_blocks(stages: list, whole) -> None:
    """Each stage holds exactly its blocks (every block by exactly one stage, the tied embedding by
    the first and last); its cache and its model cover its layers only."""
    names, tied = whole.store.block_names(), whole.config.tie_word_embeddings
    held = []
    for loaded in stages:
        span = loaded.span
        assert loaded.model.span == span
        assert set(loaded.store.block_names()) == set(span.blocks(names, tied)), span.describe()
        held += loaded.store.block_names()
    assert sorted(set(held)) == sorted(names)
    assert len(held) == len(names) + (1 if tied and len(stages) > 1 else 0)


@pytest.mark.parametrize(("case", "quant"), [
    pytest.param(c, q, id=f"{c}-{q}", marks=pytest.mark.slow if c in SLOW_CASES else ()) for c, q in PAIRS])
def test_chained_stages_give_the_whole_models_logits(case, quant, checkpoint, fused_layers):
    options = dict(device="cpu", dtype=torch.float32, context_length=CONTEXT, quant=quant)
    whole = load_model(checkpoint(case), **options)
    layers, vocab = whole.config.num_hidden_layers, whole.config.vocab_size
    ids = prompt(vocab, 7)
    expected, expected_batched = prefill_and_decode([whole], ids), batched_steps([whole], vocab)
    fused_whole = len(fused_layers)
    moe = whole.config.moe
    assert (fused_whole > 0) == any(moe is None or not moe.is_sparse(i) for i in range(layers))  # dense layers fuse
    for count in (2, 3):
        stages = load_stages(checkpoint(case), count, layers, **options)
        assert_stage_blocks(stages, whole)
        fused_layers.clear()
        assert_equal_runs(prefill_and_decode(stages, ids), expected)
        assert_equal_runs(batched_steps(stages, vocab), expected_batched)
        # Every stage's dense layers ran as fused decode steps, as the whole model's did, each at
        # its index in the stage's own cache.
        assert len(fused_layers) == fused_whole
        assert max(fused_layers, default=0) < max(len(loaded.span.layers) for loaded in stages)


def test_a_middle_stage_returns_every_positions_hidden_states_and_leaves_its_input(checkpoint):
    options = dict(device="cpu", dtype=torch.float32, context_length=CONTEXT)
    first, middle, last = load_stages(checkpoint("llama-tied"), 3, 4, **options)
    ids = prompt(first.config.vocab_size, 5)
    hidden = first.model.forward(ids, first.new_cache(), logits="last")
    assert hidden.shape == (1, 5, first.config.hidden_size) and hidden.dtype == torch.float32
    given = hidden.clone()
    out = middle.model.forward(hidden, middle.new_cache(), logits="last")
    assert out.shape == hidden.shape and torch.equal(hidden, given)
    cache = last.new_cache()
    logits = last.model.forward(out, cache, logits="last")
    assert logits.shape == (1, 1, first.config.vocab_size) and cache.offset == 5
    # A decode step's hidden states go in unchanged too, though the fused step works in place.
    step = first.model.forward(torch.tensor([[4]]), first.new_cache())
    kept = step.clone()
    middle.model.forward(step, middle.new_cache())
    assert torch.equal(step, kept)


def test_device_graphs_capture_a_partial_span(checkpoint, monkeypatch):
    """The graphed decode (here through device/graphs.py's CPU stand-in) of each stage, chained,
    equals the whole model's graphed decode."""
    from tierlm.device.graphs import RecordedGraph
    from tierlm.models.graph_decode import GraphedDecode

    monkeypatch.setenv("TIERLM_FUSED", "0")  # the graphs' reference is the eager path
    options = dict(device="cpu", dtype=torch.float32, context_length=CONTEXT)
    whole = load_model(checkpoint("qwen2-bias"), **options)
    stages = load_stages(checkpoint("qwen2-bias"), 3, 4, **options)
    for loaded in [whole, *stages]:
        loaded.model.graphs = GraphedDecode(loaded.model, RecordedGraph, min_span=8)
    ids = prompt(whole.config.vocab_size, 6)
    expected, actual = prefill_and_decode([whole], ids), prefill_and_decode(stages, ids)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    for loaded in stages:
        assert sum(step.graph.replays for step in loaded.model.graphs.steps.values()) == len(DECODE_TOKENS)


@pytest.mark.slow
def test_the_embedded_model_split_in_two_and_three(tmp_path_factory):
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    options = dict(device="cpu", dtype=torch.float32, context_length=32)
    whole = load_model(model_dir, **options)
    layers = whole.config.num_hidden_layers
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356]])
    expected = prefill_and_decode([whole], ids)
    for count in (2, 3):
        stages = load_stages(model_dir, count, layers, **options)
        assert_stage_blocks(stages, whole)
        assert_equal_runs(prefill_and_decode(stages, ids), expected)
        del stages


def test_a_stage_that_does_not_fit_the_model_is_refused(checkpoint):
    with pytest.raises(TierlmError, match="does not fit a model of 4 layers"):
        load_model(checkpoint("llama-tied"), device="cpu", stage=StageSpan(1, 2, 2, 6))
    with pytest.raises(TierlmError, match="does not fit"):
        load_model(checkpoint("llama-tied"), device="cpu", stage=StageSpan(0, 1, 0, 2))


def test_a_streaming_stage_plans_and_opens_only_its_blocks(checkpoint, tmp_path):
    """Stages of an INT8 artifact planned under a profile too small for their blocks: each stage's
    placement (BlockSizes.only + the planner's `layers`) streams some of its own blocks from disk and
    places nothing else, its TieredStore opens those, and the chained logits equal the whole model's."""
    from tierlm.offload.planner.search import plan
    from tierlm.models import family_class
    from tierlm.offload.bandwidths import Bandwidths
    from tierlm.offload.sizes import sizes_from_artifact
    from tierlm.profile import load_profile
    from tierlm.runtime.loader import open_store, resolve_source, stage_blocks

    whole = load_model(checkpoint("llama-tied"), device="cpu", dtype=torch.float32, context_length=CONTEXT,
                       quant="int8")  # fmt: skip
    source = resolve_source(whole.artifact_dir, "none", accelerator=False)
    sizes = sizes_from_artifact(whole.artifact_dir)
    layer_bytes = sizes.nbytes["layers.0"]
    bandwidths = Bandwidths(device_bytes_per_s=12e9, host_bytes_per_s=12e9, link_bytes_per_s=8e9,
                            disk_bytes_per_s=1.5e9, device_flops=2e11, host_flops=2e11, per_block_overhead_s=2e-4)

    def placed(span, budget: int):
        profile = tmp_path / "tight.toml"
        profile.write_text(f'description = "tests: a tight stage"\nkv_cache = "auto"\n'
                           f'device_memory = {budget}\nhost_memory = {budget}\ndisk_offload = true\nheadroom = 0\n'
                           f'quant = "int8"\ncontext_length = {CONTEXT}\nbatch_size = 1\nprefetch_depth = 0\n')
        stage_sizes = sizes.only(stage_blocks(whole.config, span, sizes.names))
        return plan(whole.config, stage_sizes, load_profile(str(profile)), bandwidths, accelerator=False,
                    baseline_bytes=0, layers=span.layers)  # fmt: skip

    def tightest(span):
        """The placement under the smallest budget the planner accepts (found by bisection)."""
        low, high = 0, 64 * sum(sizes.nbytes.values())
        while high - low > layer_bytes // 8:
            mid = (low + high) // 2
            try:
                placed(span, mid)
                high = mid
            except TierlmError:
                low = mid
        return placed(span, high)

    ids = prompt(whole.config.vocab_size, 7)
    expected = prefill_and_decode([whole], ids)
    stages = []
    for span in even_split(whole.config.num_hidden_layers, 2):
        placement = tightest(span)
        names = [b.name for b in placement.blocks]
        assert names == list(stage_blocks(whole.config, span, sizes.names))
        assert any(b.tier == "disk" for b in placement.blocks), "the stage must stream some of its blocks"
        store = open_store(source, placement, torch.device("cpu"), torch.float32, span=span)
        assert store.block_names() == names
        model = family_class(whole.config)(whole.config, store, CONTEXT, torch.device("cpu"), torch.float32, span=span)
        stages.append(type(whole)(whole.config, model, store, CONTEXT, torch.device("cpu"), torch.float32,
                                  placement, span=span))  # fmt: skip
    assert_equal_runs(prefill_and_decode(stages, ids), expected)
    for loaded in stages:
        loaded.close()
