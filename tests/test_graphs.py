"""Decode captured as a graph (device/graphs.py, models/graph_decode.py), run here through the CPU
stand-in `RecordedGraph`: capture records the aten ops the static-position step issues, replay
re-issues them on the same tensors without re-running Python, as a CUDA graph replays kernels.

The reference is the eager forward (`TIERLM_FUSED=0`: LlamaModel.decoder_layer's torch ops with
Python-int positions). Tolerance: logits within 1e-4 absolute (the graphed step attends over a
zero-padded, masked span, so SDPA sums in a different order; observed ~1e-6), greedy tokens equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiers import quick
from tests.tiny import DECODE_CASES, decode_steps, make_model, scatter_pages, scattered_slot_prompts
from tierlm.kv.paged import PagedKVCache
from tierlm.device.graphs import GraphUnavailable, RecordedGraph, graph_kind
from tierlm.models import graph_decode
from tierlm.models.graph_decode import GraphedDecode
from tierlm.quant import dispatch, int8
from tierlm.runtime.loader import load_model

ATOL = 1e-4
STEPS = 12
MIN_SPAN = 8  # small, so a dozen steps cross spans 16 and 32 (one graph each)

PAIRS = [(case, "fp32") for case in DECODE_CASES] + [("llama-gqa", "int8"), ("mistral-window-3", "int8-g32-asym")]
QUICK = [("llama-gqa", "fp32"), ("llama-gqa", "int8"), ("glm-quarter-rotary", "fp32"), ("chatglm", "fp32")]


@pytest.fixture(autouse=True)
def eager_reference(monkeypatch):
    """The reference is the eager torch path; INT8 weights use the accelerators' torch kernel
    (dequantize + F.linear), which is what a device graph captures."""
    monkeypatch.setenv("TIERLM_FUSED", "0")
    monkeypatch.setattr(int8, "kernel_choice", lambda device: dispatch.accelerator_kernel_choice(device.type))



@pytest.fixture(params=quick(PAIRS, fast=QUICK, ids="-".join, unpack=False))
def loaded(request, decode_checkpoint):
    case, quant = request.param
    model = load_model(decode_checkpoint(case), device="cpu", dtype=torch.float32, context_length=64, quant=quant)
    assert model.model.graphs is None  # the CPU decodes eagerly unless a test says otherwise
    return model


def graphed(model) -> GraphedDecode:
    model.graphs = GraphedDecode(model, RecordedGraph, min_span=MIN_SPAN)
    return model.graphs


def replays(graphs: GraphedDecode) -> dict:
    return {key: step.graph.replays for key, step in graphs.steps.items()}


# -- the stand-in itself ------------------------------------------------------------------------


def test_recorded_graph_replays_the_tape_on_new_input_contents_without_rerunning_python():
    x, out, calls = torch.zeros(4), torch.empty(4), []

    def step():
        calls.append(len(calls))
        y = torch.nn.functional.silu(x.view(2, 2) * 3).view(4)
        out.copy_(y + torch.arange(4))

    graph = RecordedGraph()
    graph.capture(step)
    address = out.data_ptr()
    for values in ([1.0, 2.0, 3.0, 4.0], [-5.0, 0.5, 7.0, 2.0]):
        x.copy_(torch.tensor(values))
        graph.replay()
        expected = torch.nn.functional.silu(torch.tensor(values) * 3) + torch.arange(4)
        torch.testing.assert_close(out, expected)
    assert calls == [0]  # Python ran once, at capture
    assert out.data_ptr() == address and graph.replays == 2


def test_recorded_graph_refuses_a_host_sync_and_a_static_tensor_that_moved():
    x, out = torch.ones(3), torch.empty(3)
    with pytest.raises(GraphUnavailable, match="on the host"):
        RecordedGraph().capture(lambda: out.fill_(x.sum().item()))
    graph = RecordedGraph()
    graph.capture(lambda: out.copy_(x * 2))
    x.set_(torch.zeros(3))  # rebinds x's storage: a replay would read the old address
    with pytest.raises(GraphUnavailable, match="moved"):
        graph.replay()


# -- the graphed decode step against the eager forward -------------------------------------------



def test_graphed_decode_matches_eager_batch_1(loaded):
    ids = torch.randint(0, loaded.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    expected, expected_tokens = decode_steps(loaded, ids, STEPS)
    graphs = graphed(loaded.model)
    actual, tokens = decode_steps(loaded, ids, STEPS)
    # Positions 9..20: spans 16 then 32, each captured once and replayed every step.
    assert replays(graphs) == {(1, 16, False): 7, (1, 32, False): 5}
    assert tokens == expected_tokens
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_graphed_batched_decode_matches_eager_over_slots_of_different_lengths(loaded):
    """forward_batch over scattered slots (lengths 11, 3, 7: past the window of the window case),
    NaN in every never-written position, slot sets changing between steps; the paged cache's
    pages of 4 positions come from a shuffled pool, read through each row's table in the graph."""
    steps = 6
    prompts, slots = scattered_slot_prompts(loaded.config.vocab_size)

    def run():
        cache = PagedKVCache.for_model(loaded.config, loaded.max_len, 4, 48, page_tokens=4)
        scatter_pages(cache)
        cache.keys.fill_(float("nan"))
        cache.values.fill_(float("nan"))
        current = [loaded.model.forward(torch.tensor([p]), cache.slot(s))[0, -1] for p, s in zip(prompts, slots)]
        out = [torch.stack(current)]
        for step in range(steps):
            chosen = slots if step % 3 else slots[:2]  # every third step, a smaller batch
            rows = [slots.index(s) for s in chosen]
            ids = torch.tensor([[int(out[-1][r].argmax())] for r in rows])
            logits = loaded.model.forward_batch(ids, cache.batch(chosen))
            full = out[-1].clone()
            full[rows] = logits
            out.append(full)
        return torch.stack(out)

    expected = run()
    graphs = graphed(loaded.model)
    actual = run()
    assert sum(replays(graphs).values()) == steps
    assert {rows for rows, _, gather in graphs.steps} == {2, 3} and all(g for *_, g in graphs.steps)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_a_new_cache_drops_the_graphs_captured_over_the_old_buffers(decode_checkpoint):
    loaded = load_model(decode_checkpoint("llama-gqa"), device="cpu", dtype=torch.float32, context_length=64)
    ids = torch.tensor([[5, 6, 7]])
    expected = decode_steps(loaded, ids, 3)
    graphs = graphed(loaded.model)
    first = decode_steps(loaded, ids, 3)
    old = graphs.steps[(1, 8, False)]
    second = decode_steps(loaded, ids, 3)  # _decode makes a new KV cache
    assert graphs.steps[(1, 8, False)] is not old
    for got in (first, second):
        assert got[1] == expected[1]
        torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=0)


def test_engine_generation_through_graphs_equals_eager(tmp_path):
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.tokenizer import Tokenizer

    make_model(tmp_path, family="qwen2", heads=4, kv_heads=2)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=64)
    tokenizer = Tokenizer.from_dir(tmp_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "the quick brown fox"}])
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    expected = Engine(loaded, tokenizer).generate(prompt, params)
    expected_text = expected.text()
    graphs = graphed(loaded.model)
    actual = Engine(loaded, tokenizer).generate(prompt, params)
    assert actual.text() == expected_text and actual.token_ids == expected.token_ids
    assert sum(replays(graphs).values()) == len(actual.token_ids) - 1  # every decode step replayed


# -- when decode stays eager --------------------------------------------------------------------


def test_graphs_refuse_the_cpu_the_switch_and_a_streamed_block(monkeypatch):
    from tierlm.offload.placement import DEVICE, DISK, HOST, BlockPlacement, Placement

    assert graph_kind(torch.device("cpu")) == (None, "no graph capture on cpu: its decode step runs eagerly")
    assert graph_kind(torch.device("cuda"))[0] == "cuda"
    monkeypatch.setenv("TIERLM_GRAPHS", "0")
    assert graph_kind(torch.device("cuda")) == (None, "TIERLM_GRAPHS=0")

    def store(tiers: dict, compute=DEVICE):
        names = ("embed", "layers.0", "layers.1", "norm", "head")
        blocks = tuple(BlockPlacement(n, tiers.get(n, DEVICE), 1, compute if n in tiers else DEVICE) for n in names)
        return type("Store", (), {"placement": Placement(blocks, {}, {})})()

    assert graph_decode.streamed_refusal(object()) is None  # a resident store
    assert graph_decode.streamed_refusal(store({})) is None
    assert graph_decode.streamed_refusal(store({"embed": HOST})) is None  # looked up outside the graph
    assert "layers.1 lives on disk (streamed through the ring)" in graph_decode.streamed_refusal(
        store({"layers.1": DISK}))
    assert "head lives on host (computed on the host)" in graph_decode.streamed_refusal(store({"head": HOST}, HOST))
