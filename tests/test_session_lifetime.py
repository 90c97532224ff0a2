"""The session owns the model's lifetime; every weight store reports stats() without probing."""

from pathlib import Path

from tierlm.weights.ledger import Ledger
from tierlm.profile import Profile
from tierlm.runtime.session import Session
from tierlm.store.resident import ResidentStore


class CountingLoaded:
    def __init__(self):
        self.closes = 0

    def close(self):
        self.closes += 1


def test_session_closes_once_as_a_context_manager():
    loaded = CountingLoaded()
    with Session(loaded, None, Profile.__new__(Profile), Path("."), 0.0) as session:
        assert not session.closed
    assert session.closed and loaded.closes == 1
    session.close()
    assert loaded.closes == 1


def test_session_closes_when_the_body_raises():
    loaded = CountingLoaded()
    try:
        with Session(loaded, None, Profile.__new__(Profile), Path("."), 0.0):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert loaded.closes == 1


def test_resident_store_stats_are_empty():
    stats = ResidentStore({}).stats()
    assert isinstance(stats, Ledger)
    assert not stats.planned and not stats.bytes_read and stats.stall_s == 0 and stats.forwards == 0




def test_a_served_session_allocates_no_batch_one_kv_cache(tmp_path, monkeypatch):
    import httpx

    from tests.tiny import make_model, write_profile
    from tierlm.kv.cache import KVCache
    from tierlm.profile import load_profile
    from tierlm.runtime.session import open_session
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import BackgroundServer

    built = []
    original = KVCache.__init__

    def counting(self, *args, **kwargs):
        built.append(kwargs.get("batch", 1))
        original(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "__init__", counting)
    make_model(tmp_path / "tiny")
    profile = load_profile(str(write_profile(tmp_path / "serve.toml", context_length=128, batch_size=2)))
    with open_session(str(tmp_path / "tiny"), profile, device="cpu", dtype="fp32") as session:
        with BackgroundServer(session, ServerOptions()) as server:
            reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
            assert server.app.state.worker.kv_bytes() is not None  # the worker's slotted cache serves
        assert built == [] and "engine" not in vars(session)
        assert session.engine.context_length == 128  # chat, generate and bench build it on first use
    assert built == [1]
