"""`tierlm serve`: an OpenAI-compatible HTTP server with continuous batching.

app.py (routes) -> schemas.py (validation) -> jobs.py (request <-> worker bridge) ->
worker.py (the thread that owns the model, heartbeat, watchdog) -> batch.py (KV slots,
prefill, batched decode); metrics.py (Prometheus), responses.py (bodies, SSE), run.py (uvicorn).
"""
