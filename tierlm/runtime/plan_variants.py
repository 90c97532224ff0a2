"""`tierlm plan --lora NAME=DIR`: LoRA variants placed beside a plan's base, sized and placed with
the functions `serve` uses (runtime/session.py `plan_with_variants`). Variants are read as
overlays over the base's artifact, so this module loads torch: the plan command imports it only
when variants are asked for, and hands `place_variants` to runtime/planning.py `plan_model`.
"""

from __future__ import annotations

import torch

from tierlm.device.resolve import compute_dtype
from tierlm.offload.placement import Placement
from tierlm.runtime.loader import convert_source
from tierlm.runtime.session import plan_with_variants, variant_base_artifact
from tierlm.runtime.source import Budget, Planned, plan_load
from tierlm.store.variants import overlay_for


def place_variants(planned: Planned, budget: Budget, variants) -> tuple[Placement, dict[str, str]]:
    """(the placement with `variants` {name: ((path, weight), ...)} placed beside the base, each
    variant's mode and why), computed as `serve` does: the base's artifact (the load converts to
    it first, once) and each variant's (built once, cached) are read to size them."""
    device = torch.device(str(budget.device))  # a plan names the CPU without torch; overlays need torch's
    source = planned.source
    if not (source.as_stored or source.compiled):  # as the load does: convert, then plan the exact sizes
        planned = plan_load(convert_source(source, device.type != "cpu", None), budget)
    artifact_dir = planned.source.directory if planned.source.compiled else None
    base = variant_base_artifact(source.directory, artifact_dir, source.adapters, device)
    overlays = {name: overlay_for(base, adapters, device=device, dtype=compute_dtype(device), hold=False)
                for name, adapters in variants.items()}  # fmt: skip
    try:
        placement = plan_with_variants(source.config, planned.sizes, device, budget.profile, planned.placement, overlays)
    finally:
        for overlay in overlays.values():
            overlay.close()
    return placement, {name: overlay.why for name, overlay in overlays.items()}
