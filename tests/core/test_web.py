"""A request's one deadline (rftgym.core.web): looking up the host's name, connecting, the reply's
headers and its body all within it, over HTTP and HTTPS, against servers on 127.0.0.1 that trickle
bytes just faster than a socket read times out, and a stand-in resolver that hangs. No other
address is ever contacted, and no name is looked up for real."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rftgym.core.web import (ERROR_BODY_GRACE_S, BodyTooSlow, Deadline, RequestTooSlow, _connect_shut_by, _Shutter,
                             build_opener, error_body_time, open_within, read_body)
from slow_servers import HangingResolver, finishes_within, self_signed_tls, trickling_server


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


@pytest.fixture
def resolver(monkeypatch):
    with HangingResolver.installed(monkeypatch) as stand_in:
        yield stand_in


def test_a_name_lookup_that_hangs_is_given_up_at_the_deadline(resolver):
    start = time.monotonic()
    error = finishes_within(4.0, lambda: fetch("http://hangs.test:8000/", 1.0))
    assert isinstance(error, RequestTooSlow) and isinstance(error, TimeoutError), error
    assert str(error) == ("the name lookup of hangs.test did not finish within 1 s; check the DNS settings "
                          "(/etc/resolv.conf) and that the DNS server they name answers, or give the server's IP "
                          "address in the URL")
    assert 0.9 < time.monotonic() - start < 3.0
    assert resolver.looked_up == ["hangs.test"]


def test_an_ip_address_or_localhost_is_never_looked_up(answering, resolver):
    # A resolver that hangs cannot touch them: their addresses need no lookup (nor a thread).
    port = answering().rsplit(":", 1)[1]
    for host in ("127.0.0.1", "localhost", "LocalHost"):
        replies = []
        error = finishes_within(4.0, lambda url=f"http://{host}:{port}/ok": replies.append(fetch(url, 5.0)))
        assert error is None and json.loads(replies[0]) == {"path": "/ok"}, error
    assert resolver.looked_up == []


def test_a_name_looked_up_in_time_has_its_addresses_tried_in_turn(answering, resolver):
    port = int(answering().rsplit(":", 1)[1])
    refusing = socket.socket()  # bound, not listening: a connection to it is refused
    refusing.bind(("127.0.0.1", 0))
    try:
        resolver.names["service.test"] = [refusing.getsockname(), ("127.0.0.1", port)]
        assert json.loads(fetch(f"http://service.test:{port}/ok", 5.0)) == {"path": "/ok"}
        resolver.names["service.test"] = [refusing.getsockname()]
        with pytest.raises(urllib.error.URLError) as info:  # none takes it: the last try's error
            fetch(f"http://service.test:{port}/ok", 5.0)
        assert isinstance(info.value.reason, ConnectionRefusedError), info.value
    finally:
        refusing.close()
    resolver.names["unknown.test"] = None
    with pytest.raises(urllib.error.URLError) as info:  # the resolver's own error, as before
        fetch(f"http://unknown.test:{port}/ok", 5.0)
    assert isinstance(info.value.reason, socket.gaierror), info.value
    assert resolver.looked_up == ["service.test", "service.test", "unknown.test"]


def test_a_connection_is_made_from_its_source_address(answering):
    port = int(answering().rsplit(":", 1)[1])
    with socket.socket() as probe:  # a free port to connect from
        probe.bind(("127.0.0.1", 0))
        source = probe.getsockname()
    shutter = _Shutter(time.monotonic() + 5)
    try:
        with _connect_shut_by(shutter, ("127.0.0.1", port), 5.0, source) as connection:
            assert connection.getsockname() == source
    finally:
        shutter.close()
