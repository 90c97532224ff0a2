"""The session owns the model's lifetime; every weight store reports stats() without probing."""

from pathlib import Path
from types import SimpleNamespace

from tierlm.offload.ledger import Ledger
from tierlm.profile import Profile
from tierlm.runtime.session import Session
from tierlm.weights.store import ResidentStore


class CountingLoaded:
    def __init__(self):
        self.closes = 0

    def close(self):
        self.closes += 1


def test_session_closes_once_as_a_context_manager():
    loaded = CountingLoaded()
    engine = SimpleNamespace(loaded=loaded)
    with Session(engine, Profile.__new__(Profile), Path("."), 0.0) as session:
        assert not session.closed
    assert session.closed and loaded.closes == 1
    session.close()
    assert loaded.closes == 1


def test_session_closes_when_the_body_raises():
    loaded = CountingLoaded()
    try:
        with Session(SimpleNamespace(loaded=loaded), Profile.__new__(Profile), Path("."), 0.0):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert loaded.closes == 1


def test_resident_store_stats_are_empty():
    stats = ResidentStore({}).stats()
    assert isinstance(stats, Ledger)
    assert not stats.planned and not stats.bytes_read and stats.stall_s == 0 and stats.forwards == 0
