"""Issue 11, "the budget ignores the real limit": every budget is capped at what the process really
has (cgroup memory limit, RLIMIT_AS, free accelerator memory), plans stay within the cap, and a
profile that cannot fit under it is refused in one line, never OOM-killed.

Unit tests read fake cgroup v1/v2 hierarchies and a fake getrlimit; the planner tests use public
model shapes with fixed bandwidths; the last tests run the real CLI inside a child cgroup of this
process's own (cgroup v1 memory controller, root), as tests/test_memory_profile.py does.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import uuid
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from tests.cli_runner import PROGRESS_LINE
from tierlm.models import read_config
from tierlm.device.memory import MemoryLimits, address_space_room, cgroup_memory_limit, process_limits
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK
from tierlm.offload.planner.limits import cap_profile
from tierlm.offload.planner.search import check_fits, plan
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.sizes import sizes_from_config
from tierlm.profile import auto_profile, load_profile
from tierlm.runtime.source import shipped_fallbacks

MiB, GiB = 2**20, 2**30
UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 writes for "no limit"
BASELINE = 400 * MiB
FALLBACKS = shipped_fallbacks()  # what a refusal may suggest, as the loader passes them
LLAMA_2_7B = {"model_type": "llama", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}  # fmt: skip
CPU = Bandwidths(device_bytes_per_s=20e9, host_bytes_per_s=20e9, link_bytes_per_s=10e9, disk_bytes_per_s=2e9,
                 device_flops=500e9, host_flops=500e9, per_block_overhead_s=50e-6)  # fmt: skip
GPU = Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9, disk_bytes_per_s=3e9,
                 device_flops=100e12, host_flops=1e12, per_block_overhead_s=30e-6, device="cuda")  # fmt: skip


# -- reading the limits -----------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v1_limit_is_the_tightest_of_the_group_and_its_ancestors(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    write(proc, "9:name=systemd:/\n4:memory:/outer/inner\n1:cpu:/")
    write(root / "memory" / "memory.limit_in_bytes", UNLIMITED_V1)
    write(root / "memory" / "outer" / "memory.limit_in_bytes", str(700 * MiB))
    write(root / "memory" / "outer" / "inner" / "memory.limit_in_bytes", str(900 * MiB))
    limit, source = cgroup_memory_limit(root, proc)
    assert limit == 700 * MiB
    assert source == str(root / "memory" / "outer" / "memory.limit_in_bytes")


def test_cgroup_v2_limit_reads_memory_max_and_treats_max_as_none(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    write(proc, "0::/user.slice/job")
    write(root / "user.slice" / "job" / "memory.max", str(GiB))
    write(root / "user.slice" / "memory.max", "max")
    assert cgroup_memory_limit(root, proc) == (GiB, str(root / "user.slice" / "job" / "memory.max"))
    write(root / "user.slice" / "job" / "memory.max", "max")
    limit, source = cgroup_memory_limit(root, proc)
    assert limit is None and source is not None  # cgroup files, but no limit in them


def test_no_cgroup_files_and_no_rlimit_mean_no_limits(tmp_path):
    limits = process_limits(cgroup_root=tmp_path / "none", proc_cgroup=tmp_path / "missing",
                            getrlimit=lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # fmt: skip
    assert limits == MemoryLimits(None, "", None)


def test_rlimit_as_leaves_the_limit_less_what_is_mapped_but_not_resident(tmp_path):
    status = tmp_path / "status"
    write(status, "Name:\tpython\nVmSize:\t  614400 kB\nVmRSS:\t  102400 kB")  # 600 MiB mapped, 100 MiB resident
    room, source = address_space_room(lambda _: (2 * GiB, resource.RLIM_INFINITY), status)
    assert room == 2 * GiB - 500 * MiB
    assert "RLIMIT_AS" in source


def test_process_limits_take_the_tighter_of_cgroup_and_rlimit(tmp_path):
    root, proc, status = tmp_path / "cgroup", tmp_path / "proc-cgroup", tmp_path / "status"
    write(proc, "4:memory:/job")
    write(root / "memory" / "job" / "memory.limit_in_bytes", str(512 * MiB))
    write(status, "VmSize:\t  10240 kB\nVmRSS:\t  10240 kB")
    loose = process_limits(cgroup_root=root, proc_cgroup=proc, getrlimit=lambda _: (GiB, GiB), proc_status=status)
    assert (loose.ram, loose.ram_source) == (512 * MiB, "cgroup memory limit")
    tight = process_limits(cgroup_root=root, proc_cgroup=proc, getrlimit=lambda _: (256 * MiB, GiB),
                           proc_status=status)  # fmt: skip
    assert tight.ram == 256 * MiB and "RLIMIT_AS" in tight.ram_source
    assert tight.device_free is None  # no accelerator asked about


# -- `--profile auto` -------------------------------------------------------------------------


def test_auto_profile_is_sized_under_the_cgroup_limit_not_the_hosts_free_ram():
    limits = MemoryLimits(GiB, "cgroup memory limit")
    profile = auto_profile(ram_available=18 * GiB, device_free=0, limits=limits)
    assert profile.device_memory == int(GiB * 0.85)
    assert "cgroup memory limit" in profile.description
    roomy = auto_profile(ram_available=18 * GiB, device_free=0, limits=MemoryLimits(64 * GiB, "cgroup memory limit"))
    assert roomy.device_memory == int(18 * GiB * 0.85) and "cgroup" not in roomy.description


@pytest.mark.e2e
def test_profiles_auto_under_a_real_rlimit_as_is_sized_below_it():
    limit = 3 * GiB  # room for the interpreter's own address space; no torch is imported

    def cap_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "tierlm", "profiles", "auto"], capture_output=True, text=True,
                          timeout=300, preexec_fn=cap_address_space)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "RLIMIT_AS" in done.stdout
    assert profile_bytes(done.stdout, "device_memory") <= limit * 0.85


# -- the planner ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-2-7b")
    (folder / "config.json").write_text(json.dumps(LLAMA_2_7B))
    return read_config(folder)


def plan_under(config, profile_name: str, limits: MemoryLimits | None, *, accelerator: bool = False, **changes):
    profile = replace(load_profile(profile_name), **changes)
    sizes = sizes_from_config(config, "int8", accelerator=accelerator)
    return plan(config, sizes, profile, GPU if accelerator else CPU, accelerator=accelerator,
                baseline_bytes=BASELINE, limits=limits, fallbacks=FALLBACKS)  # fmt: skip


def test_plan_caps_the_ram_budget_at_the_cgroup_limit_and_streams_within_it(llama):
    free = plan_under(llama, "4gb", None)
    capped = plan_under(llama, "4gb", MemoryLimits(3 * GiB, "cgroup memory limit"))
    assert capped.budgets[DEVICE] == 3 * GiB
    assert capped.total(DEVICE) <= 3 * GiB < free.total(DEVICE)
    resident = [b.name for b in capped.blocks if b.tier == DEVICE]
    assert len(resident) < len([b for b in free.blocks if b.tier == DEVICE])
    assert any(b.tier == DISK for b in capped.blocks)
    assert any("RAM budget capped at the cgroup memory limit 3 GiB (profile '4gb' allows 3.25 GiB)" in n
               for n in capped.notes)  # fmt: skip


def test_a_limit_above_the_profile_changes_nothing(llama):
    assert plan_under(llama, "4gb", MemoryLimits(64 * GiB, "cgroup memory limit")) == plan_under(llama, "4gb", None)


def test_plan_refuses_with_the_limit_and_the_least_limit_that_would_do(llama):
    with pytest.raises(TierlmError) as refused:
        plan_under(llama, "4gb", MemoryLimits(250 * MiB, "cgroup memory limit"))
    message = refused.value.message
    assert message.startswith("profile '4gb' allows 3.25 GiB of RAM but this process is limited to 250 MiB "
                              "(cgroup memory limit); the model (32 layers, int8) needs at least ")  # fmt: skip
    assert "raise the cgroup memory limit to at least" in refused.value.hint
    assert "\n" not in str(refused.value)
    need = parse_size(re.search(r"needs at least ([\d.]+ [GM]iB)", message).group(1))
    # The figure is the truth: the plan fits under it, and not below it (less its rounding up to
    # 0.01 GiB and the search's 1 MiB step).
    assert plan_under(llama, "4gb", MemoryLimits(need, "cgroup memory limit")).total(DEVICE) <= need
    with pytest.raises(TierlmError):
        plan_under(llama, "4gb", MemoryLimits(need - 12 * MiB, "cgroup memory limit"))


def test_refusal_under_a_limit_names_a_profile_that_fits_under_it(llama):
    # 6gb's longer context needs more KV cache than 4gb's: under a limit between the two, 4gb is the answer.
    need_4gb = need_under(llama, "4gb", 250 * MiB)
    with pytest.raises(TierlmError) as refused:
        plan_under(llama, "6gb", MemoryLimits(need_4gb + 16 * MiB, "cgroup memory limit"))
    assert "this process is limited to" in refused.value.message
    assert refused.value.hint.startswith("try --profile 4gb, or raise the cgroup memory limit")


def test_accelerator_device_budget_is_capped_at_free_device_memory(llama):
    capped = plan_under(llama, "8gb", MemoryLimits(None, "", 3 * GiB), accelerator=True)
    assert capped.budgets[DEVICE] == 3 * GiB and capped.total(DEVICE) <= 3 * GiB
    assert capped.budgets["host"] == load_profile("8gb").host_memory  # RAM is not limited here
    assert any("device memory budget capped at the free accelerator memory 3 GiB" in n for n in capped.notes)
    with pytest.raises(TierlmError) as refused:
        plan_under(llama, "8gb", MemoryLimits(None, "", 300 * MiB), accelerator=True)
    assert "of device memory but this process is limited to 300 MiB (free accelerator memory)" in refused.value.message
    assert "free accelerator memory until" in refused.value.hint


def test_emulated_host_tier_shares_the_ram_limit_between_both_tiers():
    profile = replace(load_profile("4gb"), emulate_host_tier=True)
    capped, caps = cap_profile(profile, MemoryLimits(2 * GiB, "cgroup memory limit"), accelerator=False)
    assert [cap.resource for cap in caps] == ["RAM"]
    assert capped.device_memory + capped.host_memory <= 2 * GiB
    assert capped.device_memory / capped.host_memory == pytest.approx(profile.device_memory / profile.host_memory, rel=1e-6)
    assert capped.headroom < profile.headroom  # scaled with the budget, else a small limit is all headroom


def test_check_fits_refuses_as_plan_does_without_bandwidths(llama):
    sizes = sizes_from_config(llama, "int8")
    limits = MemoryLimits(250 * MiB, "cgroup memory limit")
    with pytest.raises(TierlmError) as early:
        check_fits(llama, sizes, load_profile("4gb"), accelerator=False, baseline_bytes=BASELINE, limits=limits,
                   fallbacks=FALLBACKS)  # fmt: skip
    with pytest.raises(TierlmError) as planned:
        plan_under(llama, "4gb", limits)
    assert str(early.value) == str(planned.value)
    check_fits(llama, sizes, load_profile("4gb"), accelerator=False, baseline_bytes=BASELINE,
               limits=MemoryLimits(3 * GiB, "cgroup memory limit"))  # fits: returns quietly  # fmt: skip


def need_under(config, profile_name: str, limit: int) -> int:
    with pytest.raises(TierlmError) as refused:
        plan_under(config, profile_name, MemoryLimits(limit, "cgroup memory limit"))
    return parse_size(re.search(r"needs at least ([\d.]+ [GM]iB)", refused.value.message).group(1))


def parse_size(text: str) -> int:
    number, unit = text.split()
    return int(float(number) * {"GiB": GiB, "MiB": MiB}[unit])


def profile_bytes(listing: str, key: str) -> int:
    """A size from `tierlm profiles NAME` output ("device_memory     870.4 MiB")."""
    value = re.search(rf"^{key}\s+([\d.]+ [KMG]iB)", listing, re.M).group(1)
    number, unit = value.split()
    return int(float(number) * {"KiB": 2**10, "MiB": MiB, "GiB": GiB}[unit])


# -- the real thing: a child cgroup of this process's own --------------------------------------


def own_memory_cgroup() -> Path | None:
    """This process's group under the v1 memory controller, where a child group can be made."""
    root = Path("/sys/fs/cgroup/memory")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = root / path.lstrip("/")
            return group if (group / "memory.limit_in_bytes").exists() and os.access(group, os.W_OK) else None
    return None


needs_cgroup = pytest.mark.skipif(
    not Path("/sys/fs/cgroup/memory").is_dir(), reason="no cgroup v1 memory controller on this machine"
)


@contextmanager
def memory_cgroup(limit: int):
    """A child memory cgroup capped at `limit` (swap included), removed afterwards."""
    parent = own_memory_cgroup()
    assert parent is not None, "the cgroup v1 memory controller is mounted but this process cannot make a group in it"
    group = parent / f"tierlm-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no escape into swap
        yield group
    finally:
        remove_group(group)


def remove_group(group: Path) -> None:
    import time

    for _ in range(100):  # a killed child leaves the group a moment later
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def tierlm_in(group: Path | None, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tierlm", *args]
    if group is not None:
        # Join the group before Python starts, so every byte the child touches is charged.
        argv = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """stderr without the progress lines of phases that ran before the failure."""
    return [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS_LINE.fullmatch(line)]


@pytest.fixture(scope="module")
def warm_cache():
    """The embedded model imported, kernels calibrated and the machine probed outside any cgroup:
    the first-use import is not what these tests measure."""
    done = tierlm_in(None, "plan", "--profile", "4gb")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.e2e
@needs_cgroup
def test_plan_inside_a_cgroup_shows_the_capped_budget(warm_cache):
    with memory_cgroup(640 * MiB) as group:
        done = tierlm_in(group, "plan", "--profile", "4gb")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "limits   RAM 640.0 MiB (cgroup memory limit)" in done.stdout
    assert re.search(r"^device\s+[\d.]+ MiB of 640\.0 MiB$", done.stdout, re.M), done.stdout
    assert "RAM budget capped at the cgroup memory limit 640 MiB (profile '4gb' allows 3.25 GiB)" in done.stdout


@pytest.mark.slow
@pytest.mark.e2e
@needs_cgroup
def test_plan_in_a_cgroup_too_small_for_the_model_is_refused_in_one_line(warm_cache):
    # 330 MiB: room for `plan` itself (torch, tokenizer, kernel calibration: ~260 MiB peak; at 250 MiB
    # it was OOM-killed on some runs) but not for the model, which needs ~450 MiB even streamed.
    with memory_cgroup(330 * MiB) as group:
        done = tierlm_in(group, "plan", "--profile", "4gb")
    assert done.returncode == 1, f"rc {done.returncode} (-9 or 137 = OOM-killed): {done.stderr[-2000:]}"
    lines = error_lines(done)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: profile '4gb' allows 3.25 GiB of RAM but this process is limited to 330 MiB "
                               "(cgroup memory limit); the model (30 layers, ")  # fmt: skip
    assert "needs at least" in lines[0] and "raise the cgroup memory limit to at least" in lines[0]


@pytest.mark.slow
@pytest.mark.e2e
@needs_cgroup
def test_generate_in_a_small_cgroup_streams_within_it_or_is_refused_never_killed(warm_cache):
    limit = 350 * MiB
    with memory_cgroup(limit) as group:
        done = tierlm_in(group, "generate", "--profile", "4gb", "-t", "0", "-n", "8", "Name three colours")
    assert done.returncode in (0, 1), f"rc {done.returncode} (-9 or 137 = OOM-killed): {done.stderr[-2000:]}"
    if done.returncode == 0:
        assert done.stdout.strip()
    else:
        lines = error_lines(done)
        assert len(lines) == 1, done.stderr
        assert "this process is limited to 350 MiB (cgroup memory limit)" in lines[0]


@pytest.mark.e2e
@needs_cgroup
def test_profiles_auto_inside_a_1gib_cgroup_sizes_itself_under_the_limit_doctor_reports():
    with memory_cgroup(GiB) as group:
        done = tierlm_in(group, "profiles", "auto")
        doctor = tierlm_in(group, "doctor", "--json")
    assert done.returncode == 0, done.stderr
    assert profile_bytes(done.stdout, "device_memory") <= GiB
    assert profile_bytes(done.stdout, "host_memory") <= GiB
    assert "cgroup memory limit" in done.stdout
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    assert json.loads(doctor.stdout)["cgroup"]["memory_limit"] == GiB  # the same reader as the planner's
