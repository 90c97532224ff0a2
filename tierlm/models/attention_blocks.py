"""How many queries one attention call takes at once (torch-free: the planner charges it).

Prefill attends a chunk of queries over the whole context. Score rows for every head and query
of a 512-token chunk over a 32k context are 2 GiB in fp32 (and the mask behind them hundreds of
MiB), so the queries go through in blocks that keep heads x queries x keys at SCORE_ELEMENTS.
"""

from __future__ import annotations

SCORE_ELEMENTS = 1 << 24  # 64 MiB of fp32 scores (and a 16 MiB boolean mask) per call, whatever the context


def query_block(batch: int, heads: int, queries: int, keys: int) -> int:
    """Queries per attention call for `queries` new tokens over `keys` positions: all of them
    when their scores fit SCORE_ELEMENTS, else as many as do (at least one)."""
    return max(1, min(queries, SCORE_ELEMENTS // max(1, batch * heads * keys)))
