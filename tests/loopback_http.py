"""An HTTP server on 127.0.0.1 for the tests of clients (the chat API agent, the retrieval client,
rftgym.core.web): started on a free port in a thread of its own, stopped and closed on leaving
the ``with`` block. Tests never reach any other address."""

from __future__ import annotations

import contextlib
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """Yields the server's base URL (``http://127.0.0.1:PORT``; ``https`` with ``tls``) while
    ``handler`` answers its requests, each on a daemon thread (so that a test's slow request
    does not hold the shutdown)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
