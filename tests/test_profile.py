"""Profiles: sizes with units, strict validation, shipped and user files."""

from __future__ import annotations

import pytest

from tierlm.errors import TierlmError
from tierlm.profile import load_profile, parse_size, profile_from_dict, shipped_profiles

VALID = dict(
    description="test box",
    device_memory="7.5GiB",
    host_memory="800MB",
    disk_offload=True,
    headroom="256MiB",
    quant="none",
    kv_cache="auto",
    context_length=2048,
    batch_size=2,
    prefetch_depth=2,
)


@pytest.mark.parametrize(
    "text, expected",
    [("7.5GiB", int(7.5 * 2**30)), ("800MB", 800 * 10**6), ("4096", 4096), (" 1 KiB ", 1024), (12, 12), ("2gb", 2 * 10**9)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "1.5XB", "", True, -5])
def test_bad_sizes(text):
    with pytest.raises(TierlmError):
        parse_size(text)


def test_valid_profile_round_trips_units():
    profile = profile_from_dict("box", VALID)
    assert profile.device_memory == int(7.5 * 2**30)
    assert profile.host_memory == 800 * 10**6
    assert profile.batch_size == 2 and profile.disk_offload is True


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"turbo": True}, "turbo"),
        ({"quant": "int3"}, "quant"),
        ({"kv_cache": "fp64"}, "kv_cache"),
        ({"kv_cache": "q3"}, "kv_cache = q3 is not a KV cache type"),
        ({"context_length": 8}, "context_length"),
        ({"batch_size": 0}, "batch_size"),
        ({"prefetch_depth": -1}, "prefetch_depth"),
        ({"disk_offload": "yes"}, "disk_offload"),
        ({"headroom": "8GiB"}, "headroom"),
        ({"device_memory": "huge"}, "device_memory"),
    ],
)
def test_invalid_profiles_name_the_key(change, needle):
    with pytest.raises(TierlmError, match=needle):
        profile_from_dict("box", {**VALID, **change})


def test_kv_cache_takes_every_format_and_the_older_key():
    for name in ("auto", "f32", "f16", "bf16", "q8_0", "q4_0"):
        assert profile_from_dict("box", {**VALID, "kv_cache": name}).kv_cache == name
    older = {key: value for key, value in VALID.items() if key != "kv_cache"}
    assert profile_from_dict("box", {**older, "kv_dtype": "fp16"}).kv_cache == "f16"


def test_missing_key_is_named():
    raw = dict(VALID)
    del raw["context_length"]
    with pytest.raises(TierlmError, match="context_length"):
        profile_from_dict("box", raw)


def test_shipped_24gb_and_user_file(tmp_path):
    assert "24gb" in shipped_profiles()
    shipped = load_profile("24gb")
    assert shipped.device_memory == 22 * 2**30 and shipped.context_length >= 2048
    path = tmp_path / "mine.toml"
    path.write_text("\n".join(f"{k} = {v!r}".replace("'", '"').replace("True", "true") for k, v in VALID.items()))
    assert load_profile(str(path)).name == "mine"


def test_unknown_profile_lists_shipped_ones():
    with pytest.raises(TierlmError, match="24gb"):
        load_profile("3gb")


def test_broken_toml_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("device_memory = \n")
    with pytest.raises(TierlmError, match="TOML"):
        load_profile(str(path))


def test_shipped_profiles_largest_first_each_described_and_valid():
    names = shipped_profiles()
    assert names == ["24gb", "16gb", "12gb", "8gb", "6gb", "4gb"]
    budgets = [load_profile(name).device_memory for name in names]
    assert budgets == sorted(budgets, reverse=True)
    for name in names:
        profile = load_profile(name)
        assert profile.description and "\n" not in profile.description
        assert profile.headroom < profile.device_memory <= int(name[:-2]) * 10**9
        assert profile.disk_offload and profile.emulate_host_tier is False
        assert profile.quant == "auto" and profile.threads == 0  # chosen per model and machine
        assert profile.context_length >= 1024 and profile.prefetch_depth >= 1


def test_emulate_host_tier_is_optional_and_strict():
    assert profile_from_dict("box", VALID).emulate_host_tier is False
    assert profile_from_dict("box", {**VALID, "emulate_host_tier": True}).emulate_host_tier is True
    with pytest.raises(TierlmError, match="emulate_host_tier"):
        profile_from_dict("box", {**VALID, "emulate_host_tier": "yes"})


def test_auto_profile_is_sized_from_free_memory():
    from tierlm.profile import auto_profile

    cpu = auto_profile(ram_available=16 * 2**30, device_free=0)
    assert cpu.name == "auto" and "CPU only" in cpu.description
    assert cpu.device_memory == cpu.host_memory == int(16 * 2**30 * 0.85)
    assert cpu.quant == "auto" and cpu.headroom == cpu.device_memory // 20
    gpu = auto_profile(ram_available=32 * 2**30, device_free=8 * 2**30)
    assert gpu.device_memory == int(8 * 2**30 * 0.9) and gpu.host_memory == int(32 * 2**30 * 0.85)
    with pytest.raises(TierlmError, match="auto"):
        auto_profile(ram_available=200 * 2**20, device_free=0)
    here = load_profile("auto")  # this machine, as `--profile auto` sees it
    assert here.name == "auto" and here.device_memory > here.headroom
