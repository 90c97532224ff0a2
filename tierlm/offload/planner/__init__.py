"""The planner: a pure function of (config, block sizes, profile, bandwidths) to a Placement.

No I/O and no torch: the caller measures the baseline, the bandwidths and the process's limits
and passes them in, and the profiles a refusal may suggest (`fallbacks`: runtime/loader.py's
`shipped_fallbacks`); the only files read are the routing counts and artifact manifests that
offload/sizes.py reads for the caller. Presentation of a placement lives elsewhere:
`placement_to_dict` beside Placement, the human text in cli/plan_view.py.

One module per job, the cost model apart from the policy that uses it:

    search.py    `plan` and `check_fits`: every block placed within the profile's budgets, or a
                 refusal before anything loads; `resident_mixed_size`
    tiers.py     the search's core: residency priority, the placement with the most resident
                 units that fits, where host blocks compute
    charges.py   what each tier is charged for a placement, and its budget
    cost.py      the cost model: seconds per decode step and prefill chunk, the binding limit
                 (`step_seconds`, `decode_terms`), the bandwidths a measured step implies
                 (`implied_bandwidths`)
    experts.py   a mixture-of-experts model's routed experts: resident, host RAM or disk, and
                 where cold ones compute (`host_computes_expert`)
    variants.py  LoRA variants beside the base (their `VariantCharge` is an input, in context.py)
    limits.py    the profile's budgets capped at the process's real limits (`cap_profile`)
    refusal.py   the "does not fit" messages: the shortfall, and what would fit
    context.py   one planning problem (`_Context`) and the routed experts' order and split,
                 shared by the modules above

Names with a leading underscore are the package's own. The public names the rest of tierlm
uses are re-exported here; new code imports them from the module that owns them.
"""

from tierlm.offload.planner.cost import decode_terms, implied_bandwidths, step_seconds
from tierlm.offload.planner.experts import host_computes_expert
from tierlm.offload.planner.limits import cap_profile
from tierlm.offload.planner.search import check_fits, plan, resident_mixed_size
from tierlm.offload.planner.context import VariantCharge
from tierlm.offload.sizes import mixed_size_text

__all__ = [
    "VariantCharge",
    "cap_profile",
    "check_fits",
    "decode_terms",
    "host_computes_expert",
    "implied_bandwidths",
    "mixed_size_text",
    "plan",
    "resident_mixed_size",
    "step_seconds",
]
