"""KV cache formats (`--kv-cache f32|f16|bf16|q8_0|q4_0`; kv/formats.py, kv/codec.py,
quant/csrc/kv_formats.h).

References: the quantized formats against the `gguf` package's Q8_0/Q4_0 quantizer and
dequantizer (bit-exact with llama.cpp's reference rows) applied to the rows rotated by the
Walsh-Hadamard matrix (built here by Sylvester's construction), the float formats against torch's own
conversions; the native writer against kv/codec.py byte for byte on the AVX2, portable and
native builds; the fused decode step, which reads the codes in registers, against the eager
path, which reads them back as floats (both on the same format); and what a cache allocates
against what the planner charges for it.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from tests.tiers import quick
from tests.test_fused_decode import _eager
from tests.tiny import DECODE_CASES, checkpoint_maker, decode_steps, scattered_slot_prompts
from tierlm.errors import TierlmError
from tierlm.kv import codec
from tierlm.kv.formats import FORMATS, check_kv_cache
from tierlm.models import fused_decode
from tierlm.offload.sizes import kv_cache_bytes
from tierlm.paths import kernels_root
from tierlm.profile import load_profile
from tierlm.quant.native import FLAGS, load_native
from tierlm.runtime.loader import load_model

X86 = platform.machine() in ("x86_64", "AMD64")
QUANTIZED = ("q8_0", "q4_0")


def _rows(n: int = 40, d: int = 64) -> torch.Tensor:
    """Random rows, plus the cases rounding treats specially: all zeros, equal magnitudes of both
    signs (q4_0 takes the first), halves that roundf and round-half-even disagree on (q8_0),
    and values past fp16's range (scales of such rows overflow to inf in llama.cpp's too)."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0)) * 3
    x[0] = 0
    x[1, :32] = torch.tensor([-2.0, 2.0] * 16)
    x[2, :32] = torch.arange(32) * 0.5  # amax 15.5: x * 127 / 15.5 hits exact halves
    x[2, 31] = 127.0
    x[3, 5] = 1e-8
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_formats_equal_ggufs_reference_bytes_and_values(name):
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType.Q8_0 if name == "q8_0" else GGMLQuantizationType.Q4_0
    x = codec.rotate(_rows())  # rows whose rotation holds the special cases: rotating back gives them
    codes, scales = codec.encode(FORMATS[name], x)
    blocks = x.shape[1] // 32
    ours = torch.cat([scales.view(torch.uint8).reshape(len(x), blocks, 2),
                      codes.view(torch.uint8).reshape(len(x), blocks, -1)], dim=-1)  # fmt: skip
    reference = quants.quantize(codec.rotate(x).numpy(), qtype)
    assert np.array_equal(ours.reshape(len(x), -1).numpy(), reference)
    decoded = codec.decode(FORMATS[name], codes, scales, torch.float32)
    assert torch.equal(decoded, codec.rotate(torch.from_numpy(quants.dequantize(reference, qtype))))


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's Walsh-Hadamard matrix of order n, orthonormal."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@pytest.mark.parametrize("head_dim,block", [(32, 32), (64, 64), (128, 128), (96, 32), (192, 64)])
def test_the_rotation_is_the_hadamard_matrix_of_each_block_and_its_own_inverse(head_dim, block):
    x = torch.randn(7, head_dim, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ torch.block_diag(*[_hadamard(block)] * (head_dim // block))
    torch.testing.assert_close(codec.rotate(x).double(), expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(codec.rotate(codec.rotate(x)), x, atol=1e-5, rtol=1e-6)


def test_the_rotation_brings_a_quantized_key_nearer_to_its_value():
    """A key whose magnitude sits in a few channels (as RoPE'd keys have): rotated first, q8_0 and
    q4_0 hold it with less error than rounding its raw channels would."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=gen)
    x[:, [3, 17, 40]] *= 12
    for name in QUANTIZED:
        fmt = FORMATS[name]
        decoded = codec.decode(fmt, *codec.encode(fmt, x), torch.float32)
        from gguf import GGMLQuantizationType, quants

        qtype = getattr(GGMLQuantizationType, name.upper())
        raw = torch.from_numpy(quants.dequantize(quants.quantize(x.numpy(), qtype), qtype))
        assert (decoded - x).norm() < 0.8 * (raw - x).norm(), name


@pytest.mark.parametrize("name,dtype", [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_float_formats_are_torchs_conversions(name, dtype):
    x = _rows()
    codes, scales = codec.encode(FORMATS[name], x)
    assert scales is None and codes.dtype == dtype and torch.equal(codes, x.to(dtype))
    assert torch.equal(codec.decode(FORMATS[name], codes, None, torch.float32), x.to(dtype).float())


def test_bytes_per_value_are_the_formats_own():
    assert [FORMATS[n].bits_per_value(128) for n in ("f32", "f16", "bf16", "q8_0", "q4_0")] == [32, 16, 16, 8.5, 4.5]
    assert FORMATS["q8_0"].unsupported(80) and FORMATS["q8_0"].unsupported(64) is None
    assert FORMATS["f16"].unsupported(80) is None


@pytest.mark.parametrize("value", ["q3", "fp64", "", "Q8"])
def test_unknown_kv_cache_types_get_one_line(value):
    with pytest.raises(TierlmError, match=f"--kv-cache {value} is not a KV cache type") as err:
        check_kv_cache(value)
    assert "q8_0" in str(err.value.hint)


# -- the native writer, on each build -----------------------------------------------------------


def _flags(march: str) -> tuple[str, ...]:
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64-v2"], ids=["native", "avx2", "portable"])
def build(request):
    if request.param != "native" and not X86:
        pytest.skip("x86 -march flags")
    flags = FLAGS if request.param == "native" else _flags(request.param)
    return load_native(kernels_root(), flags)


@pytest.mark.parametrize("name", list(FORMATS))
def test_native_writer_stores_the_codecs_bytes(build, name):
    fmt = FORMATS[name]
    x = _rows()
    # fp16's edges for the portable float_to_half: subnormals, the largest finite, past it, -0.
    x[4, :8] = torch.tensor([6e-8, 3e-5, -6.1e-5, 65504.0, 65519.0, 65520.0, -0.0, 1e-3])
    expected, expected_scales = codec.encode(fmt, x)
    codes = torch.empty_like(expected)
    scales = torch.empty_like(expected_scales) if expected_scales is not None else None
    build.kv_store(fused_decode.KV_TYPES[name], x.contiguous(), codes, scales)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    if scales is not None:
        assert torch.equal(scales.view(torch.int16), expected_scales.view(torch.int16))


@pytest.mark.parametrize("name", list(FORMATS))
def test_native_attention_reads_stored_rows_as_their_values(build, name):
    """The decode step's attention over stored rows (codes and scales read in registers) equals
    softmax attention over the rows the codec decodes, on the same stored bytes."""
    fmt, gen = FORMATS[name], torch.Generator().manual_seed(1)
    for rows in (1, 37):
        keys, values, q = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen), torch.randn(64, generator=gen)
        k_codes, k_scales = codec.encode(fmt, keys)
        v_codes, v_scales = codec.encode(fmt, values)
        k, v = (codec.decode(fmt, c, s, torch.float32) for c, s in ((k_codes, k_scales), (v_codes, v_scales)))
        expected = torch.softmax(k @ q / 8.0, dim=0) @ v
        out = build.kv_attend(fused_decode.KV_TYPES[name], q, k_codes, k_scales, v_codes, v_scales)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(FORMATS))
def test_native_attention_reads_paged_rows_as_it_reads_contiguous_ones(build, name):
    """The same rows scattered over pages of 16 in shuffled order (a page table, kv/paged.py's
    head-major region) give the contiguous result bit for bit: a page's rows are read as a run."""
    fmt, gen = FORMATS[name], torch.Generator().manual_seed(2)
    for rows in (1, 37, 100):
        keys, values, q = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen), torch.randn(64, generator=gen)
        parts = [*codec.encode(fmt, keys), *codec.encode(fmt, values)]
        count = -(-rows // 16)
        pages = torch.randperm(count + 3, generator=gen)[:count]  # a region of count + 3 pages
        paged = []
        for part in parts:
            if part is None:
                paged.append(None)
                continue
            region = torch.zeros((count + 3) * 16, part.shape[1], dtype=part.dtype)
            for index, page in enumerate(pages.tolist()):
                taken = part[index * 16 : (index + 1) * 16]
                region[page * 16 : page * 16 + len(taken)] = taken
            paged.append(region)
        contiguous = build.kv_attend(fused_decode.KV_TYPES[name], q, *parts)
        out = build.kv_attend(fused_decode.KV_TYPES[name], q, *paged, pages=pages.contiguous(), page_tokens=16,
                              positions=rows)  # fmt: skip
        assert torch.equal(out, contiguous), rows


# -- the fused step reads each format as eager attention does -------------------------------------

# Cases with heads of 32 (the quantized formats' block), a sliding window among them.
CASES = {
    "llama-mqa-bias-head-dim-32": DECODE_CASES["llama-mqa-bias-head-dim-32"],
    "qwen3-qk-norm": DECODE_CASES["qwen3-qk-norm"],
    "glm-quarter-rotary": DECODE_CASES["glm-quarter-rotary"],
    "mistral-window-3-head-dim-32": dict(family="mistral", heads=4, kv_heads=1, layers=3, sliding_window=3, head_dim=32),
}
PAIRS = [(case, name) for case in CASES for name in FORMATS if name != "f32"]
FAST = [("qwen3-qk-norm", "q8_0"), ("mistral-window-3-head-dim-32", "q4_0"), ("glm-quarter-rotary", "bf16")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory, CASES)


def _load(folder, kv_cache: str):
    return load_model(folder, device="cpu", dtype=torch.float32, context_length=64, quant="int8", kv_cache=kv_cache)


def _close_to_eager(actual, expected, exact):
    """Logits of the fused run against the eager run, both in the format, where `exact` is eager
    with fp32 KV. The two compute a new key in fp32 sums of different orders, and a value that
    lands on a rounding boundary of the format (measured: 1 code of 64 in a layer, now and then)
    is stored one step apart; later layers carry that on. So the fused run is held to the
    format's own error against fp32 KV, not to 1e-4 (the stored rows are read exactly: the
    kv_attend test), and the format must have changed the numbers for that to mean something."""
    format_error = (expected - exact).abs().max().item()
    assert format_error > 0
    torch.testing.assert_close(actual, expected, atol=max(1e-4, format_error), rtol=0)


def forced_steps(loaded, ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens) + 1, V] of a prefill of `ids` [1, T], then one step per given token
    (the same inputs for every run compared, whatever each run would pick)."""
    cache = loaded.new_cache()
    rows = [loaded.model.forward(ids, cache)[0, -1]]
    for token in tokens:
        rows.append(loaded.model.forward(torch.tensor([[token]]), cache)[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("case,name", quick(PAIRS, fast=FAST))
def test_fused_step_reads_each_format_as_eager_does(case, name, checkpoints, monkeypatch, fused_calls):
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    loaded = _load(checkpoints(case), name)
    assert loaded.new_cache().format.name == name
    ids = torch.randint(0, loaded.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    expected, tokens = _eager(monkeypatch, lambda: decode_steps(loaded, ids, 12))
    exact = _eager(monkeypatch, lambda: forced_steps(_load(checkpoints(case), "f32"), ids, tokens[:-1]))
    assert fused_calls == []
    actual = forced_steps(loaded, ids, tokens[:-1])
    assert fused_calls == [True] * ((12 + 1) * loaded.config.num_hidden_layers)  # the prefill chunk too
    _close_to_eager(actual, expected, exact)


@pytest.mark.parametrize("name", quick(QUANTIZED, fast=["q8_0"]))
def test_batched_slots_read_quantized_pages_as_eager_does(name, checkpoints, monkeypatch, fused_calls):
    """forward_batch over scattered slots of one quantized paged cache (a window)."""
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    folder = checkpoints("mistral-window-3-head-dim-32")
    loaded = _load(folder, name)
    prompts, slots = scattered_slot_prompts(loaded.config.vocab_size)

    def run(model, forced=None):
        """Logits of prefills then 6 batched steps; `forced` [7, 3]: the tokens each step takes."""
        cache = model.new_paged_cache(4, 4)
        current = [model.model.forward(torch.tensor([p]), cache.slot(s))[0, -1] for p, s in zip(prompts, slots)]
        out = [torch.stack(current)]
        for step in range(6):
            picked = out[-1].argmax(-1) if forced is None else forced[step]
            out.append(model.model.forward_batch(picked[:, None], cache.batch(slots)))
        return torch.stack(out)

    expected = _eager(monkeypatch, lambda: run(loaded))
    forced = expected.argmax(-1)
    exact = _eager(monkeypatch, lambda: run(_load(folder, "f32"), forced))
    actual = run(loaded, forced)
    assert fused_calls and all(fused_calls)
    _close_to_eager(actual, expected, exact)


def test_quantized_kv_needs_heads_in_blocks_of_32(decode_checkpoint):
    folder = decode_checkpoint("llama-gqa")  # heads of 16
    with pytest.raises(TierlmError, match="quantizes each head in blocks of 32 values; this model's heads have 16"):
        _load(folder, "q8_0")
    assert _load(folder, "f16").new_cache().keys.dtype == torch.float16


@pytest.mark.parametrize("name", ["auto", *FORMATS])
def test_a_cache_allocates_what_the_planner_charges(name, checkpoints):
    from dataclasses import replace

    loaded = _load(checkpoints("qwen3-qk-norm"), name)
    profile = replace(load_profile("8gb"), kv_cache=name, context_length=64, batch_size=3)
    assert loaded.new_paged_cache(6, 3).nbytes == kv_cache_bytes(loaded.config, profile, accelerator=False)


def test_a_session_holds_the_context_and_kv_format_its_flags_ask_for(tmp_path):
    """`--context` and `--kv-cache` reach the planner's charge, the engine's cache and chat's /stats."""
    from tests.tiny import make_model, write_profile
    from tierlm.cli.repl import format_stats
    from tierlm.offload.placement import DEVICE
    from tierlm.profile import with_run_settings
    from tierlm.runtime.session import open_session

    make_model(tmp_path / "m", head_dim=32)
    profile = with_run_settings(load_profile(str(write_profile(tmp_path / "p.toml", context_length=64, batch_size=1))),
                                "200", "q8_0")  # fmt: skip
    with open_session(str(tmp_path / "m"), profile, device="cpu", dtype="fp32") as session:
        cache = session.engine.cache
        assert (cache.format.name, session.engine.context_length) == ("q8_0", 200)
        assert session.loaded.placement.charges[DEVICE]["kv_cache"] == cache.nbytes
        assert "KV cache q8_0:" in format_stats(session, None) and "/200 tokens" in format_stats(session, None)
