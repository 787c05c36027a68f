"""A request's one deadline (rftgym.core.web): connecting, the reply's headers and its body all
within it, over HTTP and HTTPS, against servers on 127.0.0.1 that trickle bytes just faster than a
socket read times out. No other address is ever contacted."""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rftgym.core.web import (ERROR_BODY_GRACE_S, BodyTooSlow, Deadline, RequestTooSlow, build_opener, error_body_time,
                             open_within, read_body)
from slow_servers import finishes_within, self_signed_tls, trickling_server


def fetch(url: str, timeout_s: float, opener=None) -> bytes:
    """One POST the way the clients make it: the deadline covers the request and its body."""
    request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
    deadline = Deadline(timeout_s)
    with open_within(opener or build_opener(urllib.request.ProxyHandler({})), request, deadline) as response:
        return read_body(response, deadline.left(), 1 << 20)


def test_headers_trickled_in_are_given_up_at_the_deadline():
    # A header byte each 0.2 s, for ever: a socket read never waits its 1 s, so only the
    # deadline can end the request.
    with trickling_server() as port:
        start = time.monotonic()
        error = finishes_within(4.0, lambda: fetch(f"http://127.0.0.1:{port}/", 1.0))
    assert isinstance(error, RequestTooSlow) and isinstance(error, TimeoutError), error
    assert str(error) == "no reply within 1 s"
    assert 0.9 < time.monotonic() - start < 3.0


@pytest.fixture
def tls(tmp_path, monkeypatch):
    """A server TLS context whose certificate the clients' default context trusts."""
    context, cert = self_signed_tls(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # read when a client makes its default context
    return context


def test_https_headers_trickled_in_are_given_up_at_the_deadline(tls):
    with trickling_server(tls=tls) as port:
        error = finishes_within(4.0, lambda: fetch(f"https://127.0.0.1:{port}/", 1.0))
    assert isinstance(error, RequestTooSlow), error


class Answer(BaseHTTPRequestHandler):
    """Answers each POST with its path as JSON, after ``delay_s`` (the path's ``/delay/<s>``)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/delay/"):
            time.sleep(float(self.path.split("/")[-1]))
        status = 404 if self.path == "/missing" else 200
        body = json.dumps({"path": self.path}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def answering(request):
    """Starts an answering server (with TLS when given a context): ``answering(tls) -> base URL``."""
    servers = []

    def start(tls: ssl.SSLContext | None = None) -> str:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        if tls is not None:
            httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(httpd)
        return f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_a_reply_in_time_is_read_over_http_and_https(answering, tls):
    for base in (answering(), answering(tls)):
        assert json.loads(fetch(f"{base}/ok", 5.0)) == {"path": "/ok"}
        with pytest.raises(urllib.error.HTTPError) as info:  # an error reply is urlopen's, as before
            fetch(f"{base}/missing", 5.0)
        info.value.close()
        assert info.value.code == 404


def test_the_body_has_only_the_time_the_headers_left(answering):
    # Headers after 0.5 s of a 2 s deadline leave the body under 1.5 s, not another 2 s.
    request = urllib.request.Request(f"{answering()}/delay/0.5", data=b"{}")
    deadline = Deadline(2.0)
    with open_within(build_opener(urllib.request.ProxyHandler({})), request, deadline) as response:
        assert deadline.left() < 1.5
        assert json.loads(read_body(response, deadline.left(), 1 << 20)) == {"path": "/delay/0.5"}
    with pytest.raises(RequestTooSlow):  # headers later than the deadline
        fetch(f"{answering()}/delay/1.5", 1.0)


def test_an_opener_whose_connections_the_deadline_cannot_reach_is_refused(answering):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(TypeError, match="build_opener"):
        fetch(f"{answering()}/ok", 5.0, opener)


def test_read_body_alone_still_bounds_a_body():
    with trickling_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n") as port:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/", data=b"{}")
        with build_opener(urllib.request.ProxyHandler({})).open(request, timeout=5) as response:
            error = finishes_within(4.0, lambda: read_body(response, 0.5, 1 << 20))
    assert isinstance(error, BodyTooSlow), error


def test_an_http_handler_of_the_callers_is_refused_as_it_would_replace_the_deadlines():
    context = ssl.create_default_context()
    for handler in (urllib.request.HTTPSHandler(context=context), urllib.request.HTTPHandler(),
                    urllib.request.HTTPSHandler):
        with pytest.raises(TypeError, match="makes its own HTTP and HTTPS handlers"):
            build_opener(handler)
    build_opener(urllib.request.ProxyHandler({}))  # any other handler is urllib's as usual


def test_an_error_body_gets_a_few_seconds_however_late_it_comes():
    late = Deadline(60.0)
    late.at = time.monotonic() - 1  # past its deadline
    assert error_body_time(late) == ERROR_BODY_GRACE_S
    short = Deadline(1.0)
    short.at = time.monotonic() - 1
    assert error_body_time(short) == 1.0  # never more than the whole timeout
    assert 59 < error_body_time(Deadline(60.0)) <= 60  # early: what is left
