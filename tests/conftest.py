"""Test-wide settings: offline transformers, a private tierlm cache for the whole run, and one
persistent directory of compiled kernels for every run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before any test module imports torch: importing tierlm bounds OpenMP's spinning (libgomp reads
# GOMP_SPINCOUNT once, when torch loads it), so code run in this process (the CLI's `main`
# included) has the setting a `tierlm` process has; libgomp's default spinning makes compute on a
# busy machine many times slower (tierlm/device/threads.py).
import tierlm  # noqa: E402,F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The native kernels take tens of seconds of CPU to compile. Their file names are keyed on
# sources, flags, compiler and CPU, so one directory outside the per-run (and per-test) caches
# serves every test, every CLI child and later runs: each build happens once per machine.
KERNELS = Path(os.environ.setdefault("TIERLM_KERNELS", str(Path(__file__).resolve().parents[1] / ".tierlm-cache" / "kernels")))


@pytest.fixture(scope="session", autouse=True)
def tierlm_cache(tmp_path_factory):
    """Every test (and subprocess it starts) shares one cache, so the embedded model imports once.

    The machine's bandwidth probe in it is pinned to tests.test_planner.CPU for every thread count
    from the start, as several tests pin it anyway: a run plans with the same figures whatever
    ran before it and however busy the machine is, and no test pays for a probe child. Tests of
    the probe itself use caches of their own (or pin their own figures)."""
    path = tmp_path_factory.mktemp("tierlm-cache")
    previous = os.environ.get("TIERLM_CACHE")
    os.environ["TIERLM_CACHE"] = str(path)
    from tests.test_models_by_name import pin_bandwidths

    pin_bandwidths()
    yield path
    if previous is None:
        os.environ.pop("TIERLM_CACHE", None)
    else:
        os.environ["TIERLM_CACHE"] = previous


@pytest.fixture(scope="module")
def decode_checkpoint(tmp_path_factory):
    """name -> folder of that tests.tiny.DECODE_CASES checkpoint, built once per test module."""
    from tests.tiny import DECODE_CASES, checkpoint_maker

    return checkpoint_maker(tmp_path_factory, DECODE_CASES)


@pytest.fixture(scope="session")
def avx512_library() -> Path:
    """The native library compiled for `-march=x86-64-v4` (AVX-512), in the kernels directory
    under its build key: built once, never loaded (this CPU may lack AVX-512). Skips without a
    C++ compiler."""
    import platform

    from tierlm.quant.kernel_api import KernelUnavailable
    from tierlm.quant.native import FLAGS, _build, _build_key, _compiler

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 -march flags")
    try:
        compiler = _compiler()
    except KernelUnavailable as err:
        pytest.skip(str(err))
    flags = tuple("-march=x86-64-v4" if f == "-march=native" else f for f in FLAGS)
    library = KERNELS / f"tierlm_cpu-{_build_key(compiler, flags)}.so"
    if not library.exists():
        _build(compiler, flags, library)
    return library


def _cpu_has(flag: str) -> bool:
    import re

    try:
        return re.search(rf"\b{flag}\b", open("/proc/cpuinfo").read()) is not None
    except OSError:
        return False


@pytest.fixture(scope="module", params=[("x86-64-v3", 256, ("avx2", "f16c")), ("x86-64-v2", 0, ())],
                ids=["avx2", "portable"])  # fmt: skip
def native_build(request):
    """The native library built for AVX2 (`-march=x86-64-v3`) and for portable vector extensions
    (`-march=x86-64-v2`), loaded (each runs here; the default build is `-march=native`). Skips off
    x86, where this CPU lacks the ISA, or without a C++ compiler."""
    import platform

    from tierlm.paths import kernels_root
    from tierlm.quant.kernel_api import KernelUnavailable
    from tierlm.quant.native import FLAGS, load_native

    march, isa, needs = request.param
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 -march flags")
    for flag in needs:
        if not _cpu_has(flag):
            pytest.skip(f"this CPU has no {flag}")
    try:
        kernel = load_native(kernels_root(), tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS))
    except KernelUnavailable as err:
        pytest.skip(str(err))
    assert kernel.isa == isa
    return kernel



@pytest.fixture
def fused_spy(monkeypatch) -> tuple[list[bool], list[int]]:
    """Every layer a fused decode step was offered, in order, whether one by one
    (`FusedStep.run`) or in a resident run (`run_resident`): (whether each ran natively, the cache
    layer index of each that did). A silent fallback to the eager path cannot pass a test that
    reads them."""
    from tierlm.models import fused_decode

    calls: list[bool] = []
    layers: list[int] = []
    run, run_resident = fused_decode.FusedStep.run, fused_decode.FusedStep.run_resident

    def one(self, w, x, layer):
        done = run(self, w, x, layer)
        calls.append(done)
        layers.extend([layer] if done else [])
        return done

    def several(self, store, offered, first, x):
        count = run_resident(self, store, offered, first, x)
        calls.extend([True] * count)
        layers.extend(index - first for index in offered[:count])
        return count

    monkeypatch.setattr(fused_decode.FusedStep, "run", one)
    monkeypatch.setattr(fused_decode.FusedStep, "run_resident", several)
    return calls, layers


@pytest.fixture
def fused_calls(fused_spy) -> list[bool]:
    """Whether each layer offered to the fused decode step ran natively, in order."""
    return fused_spy[0]


@pytest.fixture
def fused_layers(fused_spy) -> list[int]:
    """The cache layer index of every layer the fused decode step ran, in order."""
    return fused_spy[1]
