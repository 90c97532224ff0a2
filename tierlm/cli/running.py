"""`tierlm ps`: the models a running server holds, asked of its Ollama API (GET /api/ps) and drawn
as `ollama ps` draws them, with where each one's weight blocks are (server/ollama.py adds that
under `tierlm`; an Ollama server's split of memory between CPU and GPU is shown as Ollama shows it).

Standard library only: the command starts no torch and no HTTP client package.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

from tierlm.errors import TierlmError
from tierlm.units import format_size

PS_COLUMNS = ("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")
# What Ollama's own `ps` prints for an expiry further away than this: the model is kept until the
# server stops (tierlm's is always such: server/ollama.py's NEVER_EXPIRES).
FOREVER_S = 20 * 365 * 86400
# Generous: the first /api/ps of a server may hash its checkpoint for the digest.
TIMEOUT_S = 120.0


def server_url(host: str, port: int) -> str:
    """The address to ask: `serve --host 0.0.0.0` (every interface) is reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def fetch_running(url: str, api_key: str | None) -> dict:
    """The body of GET {url}/api/ps; TierlmError, saying what to do, when no server answers it."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No proxy: the server is this machine's or one on the same network, never the web's.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(f"{url}/api/ps", headers=headers), timeout=TIMEOUT_S) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise TierlmError(f"the server at {url} wants an API key",
                              "pass the key it was started with: --api-key KEY, or TIERLM_API_KEY") from None  # fmt: skip
        raise TierlmError(f"the server at {url} answered GET /api/ps with HTTP {err.code}",
                          "is it `tierlm serve`? check --host and --port") from None  # fmt: skip
    except (urllib.error.URLError, OSError) as err:
        raise TierlmError(f"no server is running at {url}: {_reason(err)}",
                          "start one with `tierlm serve MODEL`; on another port, pass its --port here too") from None  # fmt: skip
    except ValueError:
        raise TierlmError(f"the server at {url} did not answer GET /api/ps with JSON",
                          "is it `tierlm serve`? check --host and --port") from None  # fmt: skip
    if not isinstance(body, dict) or not isinstance(body.get("models"), list):
        raise TierlmError(f"the server at {url} answered GET /api/ps without a model list",
                          "is it `tierlm serve`? check --host and --port")  # fmt: skip
    return body


def _reason(err: Exception) -> str:
    reason = getattr(err, "reason", err)
    return getattr(reason, "strerror", None) or str(reason)


def render_running(body: dict, now: float | None = None) -> str:
    """The `tierlm ps` table of a GET /api/ps body: a header, then one row per model."""
    now = time.time() if now is None else now
    rows = [PS_COLUMNS]
    for model in body.get("models", []):
        rows.append((
            str(model.get("name") or model.get("model", "?")),
            str(model.get("digest", ""))[:12] or "-",
            format_size(int(model.get("size", 0))),
            processor(model),
            str(model.get("context_length", "-")),
            until(model.get("expires_at"), now),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(PS_COLUMNS))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def processor(model: dict) -> str:
    """Where a model's weights are: `100% CPU`, `70% GPU/25% RAM/5% disk` (share of its weight bytes
    per tier), or, for a server that does not say (Ollama), its memory split as Ollama shows it."""
    where = model.get("tierlm") or {}
    weights = {tier: int(n) for tier, n in (where.get("weights") or {}).items() if int(n) > 0}
    if not weights:
        return _ollama_processor(int(model.get("size", 0)), int(model.get("size_vram", 0)))
    labels = {"device": _device_label(str(where.get("device", "cpu"))), "host": "RAM", "disk": "disk"}
    total = sum(weights.values())
    parts = []
    for tier, nbytes in weights.items():
        share = round(100 * nbytes / total)
        parts.append(f"{share}% {labels.get(tier, tier)}" if share else f"<1% {labels.get(tier, tier)}")
    return "/".join(parts)


def _device_label(device: str) -> str:
    kind = device.split(":", 1)[0]
    return {"cpu": "CPU", "cuda": "GPU", "mps": "GPU"}.get(kind, kind.upper())


def _ollama_processor(size: int, vram: int) -> str:
    if vram <= 0:
        return "100% CPU"
    if vram >= size:
        return "100% GPU"
    on_gpu = round(100 * vram / size)
    return f"{100 - on_gpu}%/{on_gpu}% CPU/GPU"


def until(expires_at, now: float) -> str:
    """`Forever` (kept until the server stops), `4 minutes from now`, or `Stopping...` once past."""
    try:
        at = datetime.fromisoformat(str(expires_at).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return "-"
    ahead = at - now
    if ahead > FOREVER_S:
        return "Forever"
    if ahead <= 0:
        return "Stopping..."
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if ahead >= size:
            count = int(ahead // size)
            return f"{count} {unit}{'s' * (count > 1)} from now"
    return "less than a minute from now"
