"""Weights fused from rows of several GGUF types (quant/row_stack.py): each run kept in its own
form, the stack's products and values those of its runs, stored and checked as one `stack` record,
sized by the planner from its mode, and read natively by the fused decode step's kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.activation_rounding import activation_model
from tests.test_gguf_carry import random_blocks, read_own_layout
from tierlm.cache.encodings import check_record, logical_shape, part_bytes, record_mode
from tierlm.errors import TierlmError
from tierlm.quant.modes import check_mode_name, parse_quant_mode, source_grid_mode
from tierlm.quant.row_stack import RowStack


def stack_of(kinds_rows, cols=512, seed=0) -> RowStack:
    rng = np.random.default_rng(seed)
    return RowStack([read_own_layout(kind, random_blocks(kind, rows, cols, rng)) for kind, rows in kinds_rows])


def test_modes_name_each_run_and_only_where_every_type_has_a_form_of_its_own():
    assert source_grid_mode(["Q4_K", "Q4_K", "Q6_K"], [2048, 512, 512]) == "q4_k*2560+q6_k*512"
    assert source_grid_mode(["Q4_0", "Q8_0", "Q4_0"], [64, 32, 32]) == "int4-g32*64+q8_0*32+int4-g32*32"
    assert source_grid_mode(["Q4_K", "Q6_K"]) == "int8-g32-asym"  # rows unknown (no import record): the int8 grid
    assert source_grid_mode(["Q4_K", "F16"], [8, 8]) == "int8-g32-asym"  # a float run has no carried form
    assert source_grid_mode(["Q4_0", "Q4_1"], [8, 8]) == "int4-g32-asym"
    mode = parse_quant_mode("q4_k*2560+q6_k*512")
    assert mode.weight_dtype == "stack" and [(m.name, n) for m, n in mode.rows] == [("q4_k", 2560), ("q6_k", 512)]
    assert part_bytes((3072, 4096), mode) == [*part_bytes((2560, 4096), parse_quant_mode("q4_k")),
                                              *part_bytes((512, 4096), parse_quant_mode("q6_k"))]  # fmt: skip
    with pytest.raises(ValueError, match="covers 3072 rows"):
        part_bytes((3000, 4096), mode)
    for bad in ("q4_k*0+q6_k*5", "q4_k*x", "mixed:source*4+q8_0*4"):
        with pytest.raises(TierlmError):
            parse_quant_mode(bad)
    with pytest.raises(TierlmError, match="how mixed:source stores"):  # no --quant or profile may name one
        check_mode_name("q4_k*2560+q6_k*512")


def test_a_stack_computes_and_dequantizes_as_its_runs():
    stack = stack_of([("Q4_K", 24), ("Q6_K", 8), ("Q5_1", 8)])
    reference = torch.cat([run.dequantize() for run in stack.runs])
    assert stack.shape == (40, 512) and torch.equal(stack.dequantize(), reference)
    x, bias = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)), torch.randn(40)
    want = x.double() @ reference.double().T + bias.double()
    summation = 1e-5 * float((x.double().abs() @ reference.double().abs().T).max())
    # Each run's decode rows round x as its kind's integer path does (tests/test_a16_kernels.py).
    rounding = torch.cat([activation_model(kind)[1](x, run.dequantize()) for kind, run in
                          zip(("Q4_K", "Q6_K", "Q5_1"), stack.runs)], dim=1)  # fmt: skip
    assert bool(((stack.linear(x, bias).double() - want).abs() <= rounding + summation).all())
    ids = torch.tensor([[39, 0], [25, 24]])
    assert torch.equal(stack.rows(ids), reference[ids])
    moved = stack.to("cpu", torch.bfloat16)
    assert isinstance(moved, RowStack) and moved.rows(ids).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="one input width"):
        RowStack([stack.runs[0], read_own_layout("Q6_K", random_blocks("Q6_K", 4, 256, np.random.default_rng(2)))])


def test_a_stack_round_trips_through_an_artifact_record_and_bad_records_are_named(tmp_path):
    from tierlm.cache import codec
    from tierlm.cache.manifest import PartRecord, TensorRecord

    stack = stack_of([("Q4_K", 16), ("Q6_K", 8)])
    encoding, parts, meta = codec.encode_carried(stack)
    assert encoding == "stack" and set(parts) == {"0.packed", "0.superblocks", "1.packed", "1.high", "1.superblocks"}
    records = {name: PartRecord(0, p.numel() * p.element_size(), str(p.dtype).removeprefix("torch."), tuple(p.shape))
               for name, p in parts.items()}  # fmt: skip
    record = TensorRecord(encoding, records, meta)
    assert check_record(record, (24, 512)) is None
    assert record_mode(record) == "q4_k*16+q6_k*8" and logical_shape(record) == (24, 512)
    assert torch.equal(codec.decode(record, parts).dequantize(), stack.dequantize())
    # The same float weight encoded in the record's mode (a LoRA variant's changed rows) fills the same parts.
    again = codec.encode(stack.dequantize(), parse_quant_mode(record_mode(record)), "wqkv")
    assert again[0] == "stack" and {n: tuple(p.shape) for n, p in again[1].items()} == {n: r.shape for n, r in records.items()}
    broken = {
        "a run without rows": TensorRecord("stack", records, {"runs": [meta["runs"][0], {"encoding": "q6k"}]}),
        "a stray part": TensorRecord("stack", {**records, "2.packed": records["0.packed"]}, meta),
        "a short run": TensorRecord("stack", records, {"runs": [{**meta["runs"][0], "rows": 15}, meta["runs"][1]]}),
    }
    for what, bad in broken.items():
        assert check_record(bad) is not None, what
    assert "implies [25, 512]" in check_record(record, (25, 512))


@pytest.mark.parametrize("rows", [1, 3])
def test_the_fused_step_kernels_read_a_stack_as_its_runs(rows):
    """tierlm_weight_matmul over a kStack's words (what the fused decode step reads): each run by
    its own kernel into its columns, the stack's bias split across them."""
    import ctypes

    from tierlm.quant.native import KIND_STACK, WeightArg, describe_weight as _weight_words
    from tierlm.quant.dispatch import cpu_kernel_choice

    native = cpu_kernel_choice(torch.get_num_threads()).gemv
    if not hasattr(native, "lib"):
        pytest.skip("the native kernels do not build on this machine")
    stack = stack_of([("Q4_K", 24), ("Q3_K", 8), ("Q5_0", 16)], seed=rows)
    bias = torch.randn(48)
    keep = []
    words = _weight_words(stack, bias, (48, 512), keep)
    assert words[7] == KIND_STACK and words[6] == 3 and isinstance(keep[-1], ctypes.Array)
    assert [WeightArg.from_address(words[0] + i * ctypes.sizeof(WeightArg)).rows for i in range(3)] == [24, 8, 16]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    y = torch.empty(rows, 48)
    assert native.lib.tierlm_weight_matmul(x.data_ptr(), rows, (ctypes.c_int64 * 9)(*words), y.data_ptr(), 1) == 0
    reference = stack.dequantize().double()
    want = x.double() @ reference.T + bias.double()
    summation = 1e-4 * float((x.double().abs() @ reference.abs().T).max())
    rounding = torch.cat([activation_model(kind)[1](x, run.dequantize()) for kind, run in
                          zip(("Q4_K", "Q3_K", "Q5_0"), stack.runs)], dim=1)  # fmt: skip
    assert bool(((y.double() - want).abs() <= rounding + summation).all())
    words = list(words)
    words[6] = 2  # runs that do not add up to the stack's rows are refused, y untouched
    assert native.lib.tierlm_weight_matmul(x.data_ptr(), rows, (ctypes.c_int64 * 9)(*words), y.data_ptr(), 1) == -1
