"""A pipeline worker's message loop (tierlm/distributed/worker.py) in this process: its link to the
other ranks is a scripted stand-in, so LOAD, STEP and SHUTDOWN arrive as rank 0 sends them and
what the worker sends back is checked. tests/test_pipeline.py runs real worker processes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.tiny import DECODE_CASES, make_case, prompt
from tierlm.distributed import wire
from tierlm.distributed.stage_load import StageLoad
from tierlm.distributed.worker import StageWorker
from tierlm.runtime.loader import load_model
from tierlm.stages import even_split

CONTEXT = 64


class Sent:
    """A completed send (what `Link.isend` returns)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class ScriptedLink:
    """What the rank before this worker sends, in order; what this worker sends, recorded."""

    def __init__(self, inbox: list):
        self.inbox = list(inbox)
        self.sent: list[tuple[int, object]] = []

    def recv(self, shape, dtype, peer):
        tensor = self.inbox.pop(0)
        assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, (tensor.shape, shape, dtype)
        return tensor

    def recv_object(self, peer):
        return self.inbox.pop(0)

    def send_object(self, obj, peer):
        self.sent.append((peer, obj))

    def isend(self, tensor, peer):
        self.sent.append((peer, tensor.clone()))
        return Sent()


def test_the_last_stage_loads_steps_and_sends_rank_0_the_whole_models_logits(tmp_path):
    model_dir = tmp_path / "model"
    make_case(model_dir, dict(DECODE_CASES["llama-gqa"], layers=4))
    options = dict(device="cpu", dtype=torch.float32, context_length=CONTEXT)
    whole = load_model(model_dir, **options)
    spans = even_split(whole.config.num_hidden_layers, 2)
    threads = torch.get_num_threads()  # the worker sets its threads: keep this process's
    loads = [StageLoad(str(model_dir), span, threads=threads, **options) for span in spans]
    ids = prompt(whole.config.vocab_size, 7)
    expected = whole.model.forward(ids, whole.new_cache(), logits="all")
    first = load_model(model_dir, stage=spans[0], **options)
    hidden = first.model.forward(ids, first.new_cache(), logits="all")  # what rank 0 sends on
    header, extra = wire.StepHeader(cache_id=0, kind=wire.CONTIGUOUS, rows=1, length=ids.shape[1], all_logits=True,
                                    dtype=torch.float32, cache_rows=1, max_len=CONTEXT).encode("cpu")  # fmt: skip
    assert extra is None  # a contiguous cache and nothing dropped: header and activation only

    worker = StageWorker(1, 2)
    worker.link = ScriptedLink([wire.control(wire.LOAD, "cpu"), loads, header, hidden, wire.control(wire.SHUTDOWN, "cpu")])
    worker.run()

    assert worker.link.inbox == [] and worker.loaded is None  # every message read; SHUTDOWN released the stage
    (to, report), (back, logits) = worker.link.sent
    assert to == 0 and report["ok"] and report["rank"] == 1 and report["max_len"] == CONTEXT
    assert report["describe"].startswith("stage 1: layers 2-3, norm + head")
    assert back == 0 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert torch.get_num_threads() == threads


def test_a_stage_frees_the_pages_of_slots_rank_0_cut_shorter(tmp_path):
    """Rank 0's paged cache records the slots it cut shorter (a conversation's pages taken for
    another); the next step's header carries them and the stage's twin gives the same pages back,
    so a stage never holds more pages than rank 0's pool."""
    from tierlm.distributed.pipeline import PipelineModel
    from tierlm.kv.paged import pages_for

    model_dir = tmp_path / "model"
    make_case(model_dir, dict(DECODE_CASES["llama-gqa"], layers=4))
    options = dict(device="cpu", dtype=torch.float32, context_length=CONTEXT)
    spans = even_split(4, 2)
    threads = torch.get_num_threads()
    loads = [StageLoad(str(model_dir), span, threads=threads, **options) for span in spans]
    first = load_model(model_dir, stage=spans[0], **options)
    root = first.new_paged_cache(2, 2)  # rank 0's cache: 2 slots
    ids = prompt(first.config.vocab_size, 20)
    messages = []
    for slot in (0, 1):
        view = root.slot(slot)
        header = PipelineModel._header(SimpleNamespace(_cache_ids={root: 0}, _dropped=[], dtype=torch.float32,
                                                       _cache_id=lambda r: 0), view, 1, 20, False)  # fmt: skip
        hidden = first.model.forward(ids, view, logits="all")
        if slot == 0:
            root.free(0)  # e.g. its pages were taken for slot 1's sequence
        messages.append((header, hidden))
    assert messages[0][0].shrunk == () and messages[1][0].shrunk == ((0, 0),)  # told with slot 1's step
    inbox = [wire.control(wire.LOAD, "cpu"), loads]
    for header, hidden in messages:
        encoded, extra = header.encode("cpu")
        inbox += [encoded, *([extra] if extra is not None else []), hidden]
    worker = StageWorker(1, 2)
    worker.link = ScriptedLink(inbox)
    for _ in range(3):
        header = worker.link.recv((wire.HEADER_FIELDS,), torch.long, 0)
        (worker.load if int(header[0]) == wire.LOAD else worker.step)(header)
    twin = worker.caches[0]
    assert twin.lengths == root.lengths == (0, 20)
    assert twin.tables[0] == [] and twin.pool.used == pages_for(20) == root.pool.used
