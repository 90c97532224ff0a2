"""Running the app under uvicorn: in the foreground (`tierlm serve`) or on a background thread.

The listening socket is bound before uvicorn starts, so `port=0` works and the real port is
known (and announced) at once.

Shutdown (SIGTERM, SIGINT, or `BackgroundServer.stop`): the worker is drained first, so every
request in flight is answered with a 503 (a stream with an error event) instead of being cut
off when uvicorn's grace period ends; then the model is closed, and only then does a signal
that stopped `serve` take its usual effect (the exit status says SIGTERM, as uvicorn's would).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
import time

import uvicorn

from tierlm.errors import TierlmError
from tierlm.server.app import create_app
from tierlm.server.options import ServerOptions


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise TierlmError(f"cannot listen on {host}:{port}: {err.strerror}",
                          "pick another --port (0 = any free port)") from None
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app, log_level: str):
    class Server(uvicorn.Server):
        """uvicorn's server, told when shutdown begins, and holding back the signal that caused it."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.signals: list[int] = []  # the signals that stopped it, for `serve` to re-raise

        async def shutdown(self, sockets=None) -> None:
            app.state.drain()  # before uvicorn waits for the requests in flight: they end now
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # As uvicorn's, but without re-raising on exit: that would kill the process before
            # `serve` closes the model; `serve` re-raises them once it has.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            self.signals.append(sig)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3, loop="asyncio", http="h11")
    return Server(config)


def serve(session, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    """Serve until interrupted; prints one line with the address to stderr once listening."""
    app = create_app(session, options)
    sock = bind(host, port)
    slots = options.batch_size or session.profile.batch_size
    variants = "".join(f", variant {name} ({overlay.mode}, {overlay.nbytes / 2**20:.1f} MiB on {overlay.tier})"
                       for name, (_, overlay) in session.variants.items())
    print(f"tierlm serve: listening on {url_of(sock)} (model {app.state.model_id}{variants}, "
          f"profile {session.profile.name}, batch {slots}, loaded in {session.load_s:.1f} s)",
          file=sys.stderr, flush=True)
    server = _uvicorn_server(app, log_level)
    try:
        server.run(sockets=[sock])
    finally:
        session.close()  # before re-raising a signal, which may end the process; idempotent
    for sig in reversed(server.signals):  # last in, first out, as uvicorn does
        signal.raise_signal(sig)


class BackgroundServer:
    """The server on a daemon thread of this process (tests, embedding); a context manager."""

    def __init__(self, session, options: ServerOptions, host: str = "127.0.0.1", port: int = 0):
        self.app = create_app(session, options)
        self._sock = bind(host, port)
        self.url = url_of(self._sock)
        self._server = _uvicorn_server(self.app, "warning")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="tierlm-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            raise TierlmError("the server did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
