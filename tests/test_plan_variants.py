"""`tierlm plan --lora NAME=PATH[:WEIGHT]`: each variant's mode, why, bytes and tier, and the plan's
totals with them, equal to what `serve --lora NAME=PATH` charges (plan = load)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.cli_runner import run_tierlm
from tests.test_lora_merge import save_adapter
from tests.tiny import make_model, write_profile
from tierlm.cli.plan_view import plan_for, render_plan
from tierlm.offload.placement import DEVICE, DISK, placement_to_dict
from tierlm.profile import load_profile
from tierlm.runtime.session import open_session


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plan-variants")
    make_model(root / "base", hidden=512, layers=4, heads=8, kv_heads=8, intermediate=1408, vocab=320)
    return root / "base"


@pytest.fixture(scope="module")
def adapters(model) -> dict[str, Path]:
    """dora: merged (DoRA is never low rank), several blocks; low: a small rank, unmerged."""
    from peft import LoraConfig

    configs = {"dora": LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
               "low": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])}  # fmt: skip
    return {name: save_adapter(model, model.parent / f"adapter-{name}", c, seed=80 + i) for i, (name, c) in enumerate(configs.items())}


@pytest.fixture(scope="module")
def profile(model):
    path = write_profile(model.parent / "plan.toml", context_length=64, batch_size=2)
    path.write_text(path.read_text().replace('quant = "none"', 'quant = "int8"').replace("disk_offload = false", "disk_offload = true"))
    return load_profile(str(path))


def specs(adapters) -> tuple[str, ...]:
    return (f"dora={adapters['dora']}", f"low={adapters['low']}:0.7")


def served_placement(model, profile, adapters):
    variants = {"dora": ((adapters["dora"], 1.0),), "low": ((adapters["low"], 0.7),)}
    with open_session(str(model), profile, device="cpu", variants=variants) as session:
        return session.loaded.placement, {name: overlay for name, (_, overlay) in session.variants.items()}


def assert_plan_is_load(planned, served):
    assert planned.variants == served.variants
    for tier in (DEVICE,):
        for item in ("variants", "variant_stream", "weights"):
            assert planned.charges[tier][item] == served.charges[tier][item], (tier, item)


def test_plan_shows_each_variant_as_serve_charges_it(model, profile, adapters):
    placement, header = plan_for(model, profile, device="cpu", loras=specs(adapters))
    served, overlays = served_placement(model, profile, adapters)
    assert_plan_is_load(placement, served)
    assert {v.name: (v.mode, v.tier) for v in placement.variants} == {"dora": ("merged", DEVICE), "low": ("unmerged", DEVICE)}
    assert placement.charges[DEVICE]["variants"] == sum(o.nbytes for o in overlays.values())
    text = render_plan(placement, header)
    for name, overlay in overlays.items():
        assert f"variant  {name}: {overlay.why}" in text  # the cost model's reason
        row = next(line for line in text.splitlines() if line.startswith(f"{name} "))
        assert overlay.mode in row and "device, resident" in row
    assert placement_to_dict(placement)["variants"][0] == {"name": "dora", "mode": "merged",
                                                           "nbytes": overlays["dora"].nbytes, "tier": DEVICE}  # fmt: skip


@pytest.mark.slow
def test_plan_streams_the_variant_serve_streams(model, profile, adapters):
    _, overlays = served_placement(model, profile, adapters)
    dora, low = overlays["dora"], overlays["low"]
    # The base's charges as a plan measures them now (the baseline is this process's RSS).
    base = plan_for(model, profile, device="cpu")[0].total(DEVICE)
    # Holds the base, low and a slot to read dora per use, not dora itself.
    tight = replace(profile, device_memory=base + low.nbytes + (dora.largest + dora.nbytes) // 2)
    placement, header = plan_for(model, tight, device="cpu", loras=specs(adapters))
    served, _ = served_placement(model, tight, adapters)
    assert_plan_is_load(placement, served)
    assert {v.name: v.tier for v in placement.variants} == {"dora": DISK, "low": DEVICE}
    assert placement.charges[DEVICE]["variant_stream"] == dora.largest
    assert placement.total(DEVICE) <= tight.device_memory
    assert "disk, read per use" in next(line for line in render_plan(placement, header).splitlines() if line.startswith("dora "))


def test_plain_lora_still_merges_into_the_base(model, profile, adapters):
    placement, header = plan_for(model, profile, device="cpu", loras=(f"{adapters['low']}:0.5",))
    assert placement.variants == () and "variants" not in placement.charges[DEVICE]
    assert f"lora     {adapters['low']} x0.5 merged into the base" in header


def test_plan_cli_takes_lora_variants(model, profile, adapters):
    done = run_tierlm("plan", "--model", str(model), "--profile", str(model.parent / "plan.toml"), "--device", "cpu",
                      "--json", "--lora", specs(adapters)[0])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)
    assert [(v["name"], v["mode"], v["tier"]) for v in shown["variants"]] == [("dora", "merged", DEVICE)]
    assert shown["charges"][DEVICE]["variants"] == shown["variants"][0]["nbytes"]
