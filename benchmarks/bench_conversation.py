"""Multi-turn conversations through `tierlm serve`, as a chat client drives them: each turn resends
the whole conversation (the OpenAI API keeps no state), streamed, greedy, with the real `openai`
client, or with `--client ollama` the real `ollama` client on tierlm's Ollama API (/api/chat);
llama-server has no Ollama API, so it stays on the `openai` client either way. What a user feels is
the time to the first token of each turn.

Method:
- Servers, each a subprocess on the embedded SmolLM2-135M-Instruct (same GGUF), started once and
  run interleaved turn by turn (every turn is asked of each server before the next turn):
  `tierlm` (this checkout); `--peer-src DIR` adds the same server from another checkout (e.g. a
  `git worktree` of the commit before a change: an A/B in one run); `TIERLM_LLAMA_CPP_BIN` (the
  folder holding `llama-server`) adds llama-server on the embedded GGUF with its prompt cache.
- `--conversations C` conversations at once (C client threads, C slots per server, or `--slots S`
  fewer: conversations then take each other's slots), `--turns T` turns each: a user message of
  ~150 tokens (a topic paragraph), a reply of `--max-tokens`.
- Reported per server: median time to first token at turn 1 and at turn T, their ratio, and the
  cached prompt tokens the server reported (`usage.prompt_tokens_details.cached_tokens`, where
  given; the Ollama API reports none: "-"). The CPU and the load average are printed, since timings
  swing with other load.

Run from the repo root:
`.venv/bin/python benchmarks/bench_conversation.py [--turns 10] [--conversations 1] [--client ollama]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOPICS = ["the sea", "a red bicycle", "winter mornings", "a lost key", "coffee", "the moon", "trains",
          "a small garden", "rain on a roof", "old books", "a city at night", "mountains"]  # fmt: skip
SEED = 0  # greedy anyway; a fixed seed keeps the Ollama options as a real client would send them
FILLER = ("I have been thinking about this for a while, and I would like your view on how it feels, "
          "what it sounds like, what people remember of it and why it matters to them at all. ")  # fmt: skip
PROFILE = """
description = "bench_conversation"
device_memory = "4GiB"
host_memory = "4GiB"
disk_offload = false
headroom = "512MiB"
quant = "auto"
kv_cache = "auto"
prefetch_depth = 1
context_length = 4096
batch_size = {batch}
"""


def user_message(conversation: int, turn: int) -> str:
    """~150 tokens: a question about a topic, padded with a paragraph of plain text."""
    topic = TOPICS[(conversation * 5 + turn) % len(TOPICS)]
    return f"Tell me something new about {topic}. " + FILLER * 3


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


class Server:
    """One OpenAI-compatible server subprocess; `url` once it listens."""

    def __init__(self, name: str, command: list[str], env: dict, ready: str | None, cwd: Path | None = None,
                 speaks_ollama: bool = False):
        """`ready`: the stderr line that gives the URL (group 1); None: the caller waits for it."""
        self.name = name
        self.speaks_ollama = speaks_ollama
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)  # fmt: skip
        self.url = None
        for line in self.process.stderr if ready is not None else ():
            match = re.search(ready, line)
            if match:
                self.url = match.group(1)
                break
        else:  # stderr closed before the server said it listens: it exited
            if ready is not None:
                raise SystemExit(f"{name} did not start (exit {self.process.wait(30)})")
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def tierlm_server(name: str, source: Path, profile: Path) -> Server:
    env = {**os.environ, "PYTHONPATH": str(source)}
    command = [sys.executable, "-m", "tierlm", "serve", "--profile", str(profile), "--port", "0", "--quiet",
               "--alias", "bench"]  # fmt: skip
    # Run from the checkout itself: `python -m` puts the working directory first on the path.
    return Server(name, command, env, r"listening on (http://\S+)", cwd=source, speaks_ollama=True)


def llama_server(binary: Path, gguf: Path, slots: int) -> Server:
    """llama-server with `slots` parallel slots of 4,096 tokens each, as tierlm's profile holds."""
    port = 18000 + os.getpid() % 1000
    command = [str(binary), "-m", str(gguf), "--port", str(port), "-c", str(4096 * slots),
               "-np", str(slots), "-t", str(os.cpu_count() or 1)]  # fmt: skip
    server = Server("llama-server", command, dict(os.environ), None)
    server.url = f"http://127.0.0.1:{port}"
    wait_healthy(server.url)  # it listens before its model has loaded (503 meanwhile)
    return server


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy in {timeout_s:.0f} s")


def openai_turn(client, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    stream = client.chat.completions.create(model="bench", messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    text, ttft, cached = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                text.append(choice.delta.content)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "text": "".join(text),
            "cached": cached}


def ollama_turn(client, messages: list[dict], max_tokens: int) -> dict:
    """TTFT: the first non-empty content chunk; the Ollama API reports no cached prompt tokens."""
    started = time.perf_counter()
    stream = client.chat(model="bench", messages=messages, stream=True,
                         options={"temperature": 0, "num_predict": max_tokens, "seed": SEED})  # fmt: skip
    text, ttft = [], None
    for chunk in stream:
        if chunk.message.content:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            text.append(chunk.message.content)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "text": "".join(text),
            "cached": None}


def client_for(server: Server, kind: str):
    """(client, its turn function): `ollama` where the server speaks it, else `openai`."""
    if kind == "ollama" and server.speaks_ollama:
        import ollama

        return ollama.Client(host=server.url, timeout=1800), ollama_turn
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=1800), openai_turn


def converse(servers: list[Server], conversations: int, turns: int, max_tokens: int, kind: str) -> dict:
    """Every turn asked of each server in turn (interleaved); C conversations at once per server."""
    clients = {s.name: client_for(s, kind) for s in servers}
    histories = {(s.name, c): [] for s in servers for c in range(conversations)}
    results = {s.name: [[] for _ in range(turns)] for s in servers}
    failures: list[str] = []
    for turn in range(turns):
        for server in servers:
            threads = []
            for c in range(conversations):
                history = histories[(server.name, c)]
                history.append({"role": "user", "content": user_message(c, turn)})

                def ask(history=history, server=server):
                    try:
                        client, turn_function = clients[server.name]
                        got = turn_function(client, history, max_tokens)
                    except Exception as err:  # noqa: BLE001 - reported after the threads end
                        failures.append(f"{server.name}, turn {turn + 1}: {type(err).__name__}: {err}")
                        return
                    history.append({"role": "assistant", "content": got["text"]})
                    results[server.name][turn].append(got)

                threads.append(threading.Thread(target=ask))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if failures:
                raise SystemExit("a turn failed: " + "; ".join(failures))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--slots", type=int, help="KV slots per server (default: one per conversation)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--peer-src", type=Path, help="another checkout of tierlm to serve beside this one")
    parser.add_argument("--client", choices=("openai", "ollama"), default="openai",
                        help="the client tierlm servers are driven with (llama-server: always openai)")
    args = parser.parse_args()

    from tierlm.weights.embedded import embedded_gguf_path, ensure_embedded_model

    ensure_embedded_model()
    scratch = Path(tempfile.mkdtemp(prefix="bench-conversation-"))
    profile = scratch / "bench.toml"
    profile.write_text(PROFILE.format(batch=args.slots or args.conversations))
    here = Path(__file__).resolve().parent.parent
    servers = [tierlm_server("tierlm", here, profile)]
    if args.peer_src:
        servers.append(tierlm_server(f"tierlm@{args.peer_src.name}", args.peer_src.resolve(), profile))
    llama_bin = os.environ.get("TIERLM_LLAMA_CPP_BIN")
    if llama_bin and shutil.which("llama-server", path=llama_bin):
        servers.append(llama_server(Path(shutil.which("llama-server", path=llama_bin)), embedded_gguf_path(),
                                    args.slots or args.conversations))  # fmt: skip
    try:
        results = converse(servers, args.conversations, args.turns, args.max_tokens, args.client)
    finally:
        for server in servers:
            server.stop()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{args.conversations} conversation(s) on {args.slots or args.conversations} slot(s) x {args.turns} turns, "
          "~150-token user turns, "
          f"replies of {args.max_tokens} tokens, streamed, greedy; TTFT medians over conversations")
    print(f"client: {args.client}" + (" for tierlm (llama-server has no Ollama API: openai client)\n"
                                      if args.client == "ollama" else "\n"))
    print(f"{'server':28} {'TTFT turn 1':>12} {f'turn {args.turns}':>12} {'ratio':>7} {'cached at last turn':>20}")
    for name, turns in results.items():
        first = statistics.median(r["ttft"] for r in turns[0])
        last = statistics.median(r["ttft"] for r in turns[-1])
        cached = [r["cached"] for r in turns[-1] if r["cached"] is not None]
        shown = f"{statistics.median(cached):.0f}" if cached else "-"
        print(f"{name:28} {first:>11.2f}s {last:>11.2f}s {last / first:>6.2f}x {shown:>20}")


if __name__ == "__main__":
    main()
