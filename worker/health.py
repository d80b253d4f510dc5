"""A worker's HTTP port (`http_port`): `/metrics`, `/livez` and `/readyz`, what the operator's
pods probe.

`/livez` answers 200 while the process serves HTTP. `/readyz` answers 200 only between the
worker registering itself ready and the start of its drain, 503 before (loading the model,
connecting, waiting for peers, refused by an `rdma: required` check) and after: a worker that is
not ready is out of its Service's endpoints. Served from a daemon thread, so a busy event loop
does not fail the probes.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrail.worker.metrics import REGISTRY

_ready = threading.Event()


def set_ready(ready: bool) -> None:
    """Whether `/readyz` answers 200."""
    if ready:
        _ready.set()
    else:
        _ready.clear()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/livez":
            self._answer(200, b"ok\n")
        elif path == "/readyz":
            ok = _ready.is_set()
            self._answer(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
        else:
            self._answer(404, b"not found\n")

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds are not worth a log line."""


def serve(port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Start serving from a daemon thread; the server (its `server_address` has the port)."""
    server = ThreadingHTTPServer((addr, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-http", daemon=True).start()
    return server
