"""The least memory the planner asks for is what the run needs, measured (issue 24, item 6's planner
point).

Under a 4gb profile in a small cgroup, smollm2 was refused below ~450 MiB ("needs at least 447
MiB") while a run was seen peaking at ~300 MiB. Measured charge by charge against a run with a
full context (every KV row and the whole workspace touched), the charges hold: the baseline is its
RSS with the runtime loaded (+4 MiB), weights and staging 57 MiB against 54-61 measured, KV and
workspace 93 MiB against 93-116; the full-context run's peak RSS lies within 7-14% of the least
limit. The ~300 MiB came from a short prompt (most of the KV cache untouched) and from the cgroup
reclaiming the shared libraries' file pages, which RSS counts and the budget's promise (peak RSS
within it) must too. So the charge stays, and this test holds it to the measurement both ways.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

import pytest

from tests.test_real_limits import memory_cgroup, needs_cgroup, tierlm_in

MiB = 2**20
# The least limit over a full-context run's peak RSS: measured 1.07-1.14x here; beyond 1.2x a
# charge has grown past what the run uses.
TIGHTNESS = 1.2


# The profile's own context (2048: 1008 prompt tokens and the reply touch every KV row the run
# uses) and a long one held in q8_0 (8,000 of 8,192 positions: a quarter of the fp32 bytes).
RUNS = [pytest.param((), 1008, id="profile-context"),
        pytest.param(("--context", "8192", "--kv-cache", "q8_0"), 8000, id="8k-q8_0")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.e2e
@needs_cgroup
@pytest.mark.parametrize("settings,prompt_tokens", RUNS)
def test_the_least_limit_plan_names_holds_a_full_context_run_and_is_near_its_peak(settings, prompt_tokens):
    # First use (import, conversion, probe, baseline record) outside any cgroup: not what is measured.
    warm = tierlm_in(None, "bench", "--profile", "4gb", "--prompt-tokens", "8", "--tokens", "2", "--runs", "1")
    assert warm.returncode == 0, warm.stderr[-2000:]
    with memory_cgroup(330 * MiB) as group:
        refused = tierlm_in(group, "plan", "--profile", "4gb", *settings)
    found = re.search(r"needs at least (\d+) MiB of RAM", refused.stderr)
    assert refused.returncode == 1 and found, refused.stderr[-2000:]
    least = int(found.group(1)) * MiB
    with memory_cgroup(least) as group:
        done = tierlm_in(group, "bench", "--profile", "4gb", *settings, "--prompt-tokens", str(prompt_tokens),
                         "--tokens", "16", "--runs", "2", "--json")  # fmt: skip
    assert done.returncode == 0, f"rc {done.returncode} (-9 or 137 = OOM-killed): {done.stderr[-2000:]}"
    measured = json.loads(done.stdout)
    assert measured["kv_cache"] == ("q8_0" if settings else "f32")
    assert "disk" in measured["placement_bytes"], "the least limit holds the smallest placement: streamed"
    peak = measured["peak_rss_bytes"]
    assert peak <= least, f"peak RSS {peak / MiB:.0f} MiB over the {least / MiB:.0f} MiB the planner asked"
    assert least <= TIGHTNESS * peak, f"the planner asks {least / MiB:.0f} MiB for a run peaking at {peak / MiB:.0f} MiB"


@pytest.mark.slow
@pytest.mark.e2e
@needs_cgroup
def test_the_server_runs_more_requests_than_its_pool_holds_within_the_least_limit():
    """`serve --profile 4gb` (a pool of one 1,024-token context) in a cgroup at the least limit
    plan names, with `--parallel 4` and four requests of ~400 prompt tokens at once: their pages
    do not all fit, so two decode together while the others wait for pages, every request is
    answered, and the server's peak RSS stays within the limit."""
    import threading
    import urllib.request

    warm = tierlm_in(None, "bench", "--profile", "4gb", "--prompt-tokens", "8", "--tokens", "2", "--runs", "1")
    assert warm.returncode == 0, warm.stderr[-2000:]
    with memory_cgroup(330 * MiB) as group:  # the server's own refusal: its baseline is not bench's
        refused = tierlm_in(group, "serve", "--profile", "4gb", "--parallel", "4", "--port", "0")
    found = re.search(r"needs at least (\d+) MiB of RAM", refused.stderr)
    assert refused.returncode == 1 and found, refused.stderr[-2000:]
    least = int(found.group(1)) * MiB
    stories = ["the quick brown fox jumps over the lazy dog", "a cat sat on the warm mat by the door",
               "rain fell on the old town all night long", "ships sailed past the harbour light at dawn"]  # fmt: skip
    with memory_cgroup(least) as group, _server_in(group, "--profile", "4gb", "--parallel", "4") as url:
        answers: list[dict | None] = [None] * len(stories)

        def ask(index: int) -> None:
            body = {"model": "smollm2", "temperature": 0, "max_tokens": 24,
                    "messages": [{"role": "user", "content": f"Sum this up: {(stories[index] + '. ') * 36}"}]}  # fmt: skip
            request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=600) as response:
                answers[index] = json.loads(response.read())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(stories))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        with urllib.request.urlopen(f"{url}/stats", timeout=30) as response:
            stats = json.loads(response.read())
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            health = json.loads(response.read())
    prompts = [a["usage"]["prompt_tokens"] for a in answers]
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    pages = stats["kv_cache"]["pages"]
    assert pages["total"] * pages["page_tokens"] == 1024 < sum(prompts), prompts  # more than the pool holds
    assert pages["parallel"] == 4 and pages["used"] <= pages["total"]
    # More than the profile's batch of one decoded together, fewer than all four: the rest waited.
    assert 2 <= health["peak_batch"] < len(stories)
    peak = stats["memory"]["peak_resident_bytes"]
    assert peak <= least, f"peak RSS {peak / MiB:.0f} MiB over the {least / MiB:.0f} MiB the planner asked"


@contextmanager
def _server_in(group, *args: str):
    """`tierlm serve --port 0 ARGS` started inside `group`; yields its URL."""
    import subprocess
    import sys
    import time

    argv = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable, "-m", "tierlm",
            "serve", "--port", "0", "--quiet", *args]  # fmt: skip
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            lines.append(line)
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if found:
                yield found.group(1)
                return
            assert line or process.poll() is None, "".join(lines)
        raise AssertionError("the server did not start: " + "".join(lines))
    finally:
        process.terminate()
        process.wait(30)
