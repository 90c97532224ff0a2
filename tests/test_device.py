"""The device module and `tierlm doctor`: resolution with and without torch_npu, broken plugins.

Fake torch_npu packages are written to a temporary directory and put on PYTHONPATH of a child
process: a working one does what the real one does at import (renames the privateuse1 device
type to `npu`, registers `torch.npu`), which cannot be undone inside the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tierlm.cli.app import app
from tierlm.device.memory import read_memory
from tierlm.device.resolve import compute_dtype, device_status, resolve_device
from tierlm.errors import TierlmError

REPORT_KEYS = {"tierlm", "python", "platform", "torch", "devices", "device", "cpu", "int8_kernel", "packages",
               "cgroup", "cache"}  # fmt: skip

WORKING_NPU = """
import types, torch
torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("torch.npu")
npu.is_available = lambda: True
npu.device_count = lambda: 1
npu.get_device_name = lambda index=0: "Ascend-fake"
npu.is_bf16_supported = lambda: True
npu.mem_get_info = lambda device=None: (30 << 30, 64 << 30)
npu.memory_allocated = lambda device=None: 5
npu.max_memory_allocated = lambda device=None: 7
torch._register_device_module("npu", npu)
"""
DOCTOR_JSON = "import sys\nfrom tierlm.cli.app import main\nsys.argv = ['tierlm', 'doctor', '--json']\nmain()"
BROKEN_NPU = 'raise ImportError("libascendcl.so: cannot open shared object file")\n'


def fake_torch_npu(root: Path, source: str) -> Path:
    """A torch_npu package with the `torch.backends` entry point that torch >= 2.5 autoloads."""
    (root / "torch_npu").mkdir(parents=True)
    (root / "torch_npu" / "__init__.py").write_text(source)
    meta = root / "torch_npu-2.13.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (meta / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return root


def python(code: str, path: Path, **env: str) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    child_env.update(env, PYTHONPATH=os.pathsep.join([str(path), str(Path(__file__).parents[1])]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env)


def test_doctor_json_reports_the_cpu_and_why_options_are_missing():
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert REPORT_KEYS <= set(report)
    devices = {d["kind"]: d for d in report["devices"]}
    assert list(devices) == ["cuda", "npu", "mps", "cpu"]
    cpu = devices["cpu"]
    assert cpu["available"] and cpu["units"][0]["total"] > cpu["units"][0]["free"] > 0
    for dev in devices.values():
        assert dev["available"] or dev["reason"], f"{dev['kind']} is unavailable without a reason"
    if not torch.cuda.is_available():
        assert report["device"] == "cpu" and report["int8_kernel"]["device"] == "cpu"
        assert report["int8_kernel"]["gemv"]
    assert set(report["cpu"]["features"]) >= {"AVX2", "AVX-512", "AVX512-VNNI", "AVX512-BF16"}
    assert set(report["packages"]) == {"numba", "torch_npu", "transformers", "peft", "accelerate"}
    for name, found in report["packages"].items():
        assert found["version"] or found["reason"], name
    assert report["packages"]["transformers"]["version"]  # a dev dependency: installed here
    assert report["torch"]["version"] == torch.__version__
    assert report["cache"]["path"] == os.environ["TIERLM_CACHE"]


def test_doctor_text_names_every_section():
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for label in ("torch", "devices", "cpu", "int8", "packages", "cgroup", "cache"):
        assert any(line.startswith(label) for line in result.stdout.splitlines()), label
    assert "npu" in result.stdout


def test_npu_without_torch_npu_says_to_install_it_with_cann(monkeypatch):
    monkeypatch.setattr("tierlm.device.resolve.npu_installed", lambda: False)
    with pytest.raises(TierlmError) as caught:
        resolve_device("npu")
    assert "torch_npu" in caught.value.message and "not installed" in caught.value.message
    assert "pip install torch_npu" in caught.value.hint and "CANN" in caught.value.hint
    assert device_status("npu").reason == "torch_npu is not installed"
    assert resolve_device(None).type in ("cpu", "cuda", "mps")


def test_npu_resolution_goes_through_an_injected_torch_npu(monkeypatch):
    calls = []
    fake_npu = types.SimpleNamespace(
        is_available=lambda: calls.append("is_available") or available,
        device_count=lambda: 2,
        is_bf16_supported=lambda: False,
    )
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    available = False
    with pytest.raises(TierlmError, match="torch_npu sees no NPU"):
        resolve_device("npu")
    assert calls == ["is_available"]
    available = True
    assert device_status("npu").count == 2
    with pytest.raises(TierlmError, match="only 2 npu"):
        resolve_device("npu:2")
    assert compute_dtype(types.SimpleNamespace(type="npu")) == torch.float16  # no bf16 on this "card"


def test_unknown_and_unavailable_devices_are_clear_errors():
    with pytest.raises(TierlmError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(TierlmError, match="--device cuda") as caught:
            resolve_device("cuda")
        assert caught.value.hint
    assert resolve_device("cpu") == torch.device("cpu")
    assert read_memory(torch.device("cpu")).rss > 0


@pytest.mark.e2e
def test_a_working_torch_npu_is_imported_on_demand(tmp_path):
    root = fake_torch_npu(tmp_path, WORKING_NPU)
    code = (
        "import sys, json, tierlm, torch\n"
        "assert 'torch_npu' not in sys.modules, 'autoloaded by import torch'\n"
        "from tierlm.device.backend import backend_for\nfrom tierlm.device.memory import read_memory\nfrom tierlm.device.resolve import resolve_device, compute_dtype\n"
        "d = resolve_device('npu')\n"
        "m = backend_for(d).memory()\n"
        "print(json.dumps([str(d), str(resolve_device()), str(compute_dtype(d)), m.total, m.free, m.allocated,\n"
        "                  read_memory(d).device_peak]))\n"
    )
    result = python(code, root)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["npu", "npu", "torch.bfloat16", 64 << 30, 30 << 30, 5, 7]
    doctor = python(DOCTOR_JSON, root)
    assert doctor.returncode == 0, doctor.stderr
    npu = next(d for d in json.loads(doctor.stdout)["devices"] if d["kind"] == "npu")
    assert npu["available"] and npu["units"] == [{"device": "npu:0", "name": "Ascend-fake", "total": 64 << 30,
                                                  "free": 30 << 30}]  # fmt: skip


@pytest.mark.e2e
def test_a_broken_torch_npu_cannot_break_cpu_users(tmp_path):
    root = fake_torch_npu(tmp_path, BROKEN_NPU)
    # The hazard is real: torch's own autoload of the broken plugin fails `import torch`.
    assert python("import torch", root, TORCH_DEVICE_BACKEND_AUTOLOAD="1").returncode != 0
    cpu = python("import tierlm, torch\nprint(float((torch.ones(2) + 1).sum()))", root)
    assert cpu.returncode == 0 and cpu.stdout.strip() == "4.0", cpu.stderr
    # Auto-detection warns and stays on the CPU; asking for the NPU is a clear error.
    auto = python("from tierlm.device.resolve import resolve_device\nprint(resolve_device())", root)
    assert auto.returncode == 0 and auto.stdout.strip() == "cpu"
    assert "torch_npu is installed but failed to import" in auto.stderr
    asked = python("import sys\nfrom tierlm.cli.app import main\nsys.argv = ['tierlm', 'plan', '--device', 'npu']\n"
                   "main()", root)  # fmt: skip
    assert asked.returncode == 1 and "Traceback" not in asked.stderr
    line = asked.stderr.strip()
    assert line.startswith("error: torch_npu is installed but failed to import (ImportError: libascendcl.so")
    assert "CANN" in line and "\n" not in line
    doctor = python(DOCTOR_JSON, root)
    assert doctor.returncode == 0, doctor.stderr
    report = json.loads(doctor.stdout)
    npu = next(d for d in report["devices"] if d["kind"] == "npu")
    assert not npu["available"] and "failed to import" in npu["reason"] and "CANN" in npu["reason"]
    assert report["packages"]["torch_npu"]["version"] == "2.13.0"
    assert "failed to import" in report["packages"]["torch_npu"]["reason"]
