"""A request's one deadline (rftgym.core.web): looking up the host's name, connecting, the reply's
headers and its body all within it, over HTTP and HTTPS, against servers on 127.0.0.1 that trickle
bytes just faster than a socket read times out, and a stand-in resolver that hangs. No other
address is ever contacted, and no name is looked up for real."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest

from rftgym.core import web
from rftgym.core.web import (ERROR_BODY_GRACE_S, BodyTooSlow, Deadline, NameLookupTooSlow, RequestTooSlow,
                             _connect_shut_by, _Shutter, build_opener, error_body_time, is_loopback, open_within,
                             read_body)
from loopback_http import serving
from slow_servers import HangingResolver, finishes_within, lookup_threads, self_signed_tls, trickling_server


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
def answering():
    """Starts an answering server (with TLS when given a context): ``answering(tls) -> base URL``."""
    with contextlib.ExitStack() as servers:
        yield lambda tls=None: servers.enter_context(serving(Answer, tls))


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
    for host in ("127.0.0.1", "localhost", "LocalHost", "localhost."):  # the last one fully qualified
        replies = []
        error = finishes_within(4.0, lambda url=f"http://{host}:{port}/ok": replies.append(fetch(url, 5.0)))
        assert error is None and json.loads(replies[0]) == {"path": "/ok"}, error
    assert resolver.looked_up == []


def test_localhost_with_or_without_the_roots_dot_is_loopback():
    for host in ("localhost", "localhost.", "LOCALHOST.", "app.localhost", "app.localhost.", "127.0.0.1", "::1"):
        assert is_loopback(host), host
    for host in ("localhost.test", "notlocalhost", "localhost..", ".", "", None, "10.0.0.1"):
        assert not is_loopback(host), host


def test_a_name_under_localhost_is_the_resolvers(answering, resolver):
    # Which addresses app.localhost has is the system's to say (an /etc/hosts line may give it
    # 127.0.0.2, and a resolver without systemd's myhostname asks DNS), so it is looked up.
    port = int(answering().rsplit(":", 1)[1])
    resolver.names["app.localhost"] = [("127.0.0.1", port)]
    assert json.loads(fetch(f"http://app.localhost:{port}/ok", 5.0)) == {"path": "/ok"}
    assert resolver.looked_up == ["app.localhost"]


def at_once(calls) -> list:
    """Runs each of ``calls`` on its own thread, all starting together, and returns what each
    returned or raised, with the seconds it took: ``[(outcome, seconds), ...]``."""
    outcomes: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(index: int) -> None:
        start.wait()
        began = time.monotonic()
        try:
            outcome = calls[index]()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome = exc
        outcomes[index] = (outcome, time.monotonic() - began)

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads), "a request is still waiting after 10 s"
    return outcomes


def test_requests_for_a_name_whose_lookup_hangs_share_one_lookup(resolver):
    # A DNS outage: eight requests at once start one lookup between them (not one thread each,
    # left hanging), and each gives up on it at its own deadline.
    deadlines = [0.5 + 0.1 * index for index in range(8)]
    outcomes = at_once([lambda s=s: fetch("http://hangs.test:8000/", s) for s in deadlines])
    for deadline, (error, seconds) in zip(deadlines, outcomes):
        assert isinstance(error, NameLookupTooSlow), error
        assert str(error).startswith("the name lookup of hangs.test did not finish within"), error
        assert deadline - 0.05 < seconds < deadline + 1.0, (deadline, seconds)
    assert resolver.looked_up == ["hangs.test"]
    assert len(lookup_threads()) == 1  # still hanging, and alone
    resolver.release()  # the lookup ends (with the resolver's error)
    assert not lookup_threads()
    with pytest.raises(urllib.error.URLError) as info:  # the next request looks the name up afresh
        fetch("http://hangs.test:8000/", 1.0)
    assert isinstance(info.value.reason, socket.gaierror), info.value
    assert resolver.looked_up == ["hangs.test", "hangs.test"]


def test_a_shared_lookup_answers_every_request_waiting_on_it(answering, resolver):
    # Two names hang; then one is answered late and the other fails: each request waiting on
    # either gets that lookup's answer or its error (a copy of its own).
    port = int(answering().rsplit(":", 1)[1])

    def release_soon() -> None:
        give_up_at = time.monotonic() + 5
        while resolver.hanging < 2 and time.monotonic() < give_up_at:
            time.sleep(0.01)
        time.sleep(0.3)  # the other requests find the two lookups in flight meanwhile
        resolver.names["late.test"] = [("127.0.0.1", port)]
        resolver.release()

    answered = [lambda: json.loads(fetch(f"http://late.test:{port}/ok", 5.0))] * 4
    failed = [lambda: fetch(f"http://down.test:{port}/ok", 5.0)] * 4
    outcomes = at_once([*answered, *failed, release_soon])
    assert [outcome for outcome, _ in outcomes[:4]] == [{"path": "/ok"}] * 4
    errors = [outcome for outcome, _ in outcomes[4:8]]
    assert all(isinstance(error, urllib.error.URLError) and isinstance(error.reason, socket.gaierror)
               and error.reason.errno == socket.EAI_AGAIN for error in errors), errors
    assert len({id(error.reason) for error in errors}) == 4  # never one object raised on four threads
    assert sorted(resolver.looked_up) == ["down.test", "late.test"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forking needs os.fork")
def test_a_forked_child_looks_up_a_name_its_parent_was_waiting_on(resolver):
    # The parent's lookup thread does not run in the child: waiting on it there would never end.
    with pytest.raises(NameLookupTooSlow):
        fetch("http://hangs.test:8000/", 0.2)
    resolver.names["hangs.test"] = [("127.0.0.1", 8000)]  # answered at once from now on
    child = os.fork()
    if child == 0:  # the child: its own lookup, then out without pytest's teardown
        try:
            os._exit(0 if web._looked_up_within("hangs.test", 8000, 1.0) else 2)
        except BaseException:  # noqa: BLE001 - the exit status says it
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_lookups_of_many_names_at_once_are_bounded(monkeypatch, answering, resolver):
    monkeypatch.setattr(web, "MAX_LOOKUPS_IN_FLIGHT", 2)
    port = int(answering().rsplit(":", 1)[1])
    for host in ("a.test", "b.test"):
        with pytest.raises(NameLookupTooSlow, match="did not finish"):
            fetch(f"http://{host}:{port}/ok", 0.3)
    assert len(lookup_threads()) == 2  # abandoned, and still hanging
    start = time.monotonic()
    with pytest.raises(NameLookupTooSlow) as info:  # a third name waits for room, within its deadline
        fetch(f"http://c.test:{port}/ok", 0.5)
    assert 0.45 < time.monotonic() - start < 1.5
    assert str(info.value).startswith("the name lookup of c.test could not start within 0.5 s: lookups of 2 other "
                                      "names are still waiting on the resolver; check the DNS settings")
    with pytest.raises(NameLookupTooSlow, match="did not finish"):  # a name in flight needs no room
        fetch(f"http://a.test:{port}/ok", 0.3)
    assert resolver.looked_up == ["a.test", "b.test"]

    def release_soon() -> None:
        time.sleep(0.3)  # c.test waits for room meanwhile
        resolver.names["c.test"] = [("127.0.0.1", port)]
        resolver.release()  # a.test and b.test fail, and c.test gets their room

    outcomes = at_once([lambda: json.loads(fetch(f"http://c.test:{port}/ok", 5.0)), release_soon])
    assert outcomes[0][0] == {"path": "/ok"}, outcomes[0]
    assert resolver.looked_up == ["a.test", "b.test", "c.test"]


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


def test_a_lookups_time_is_said_to_a_tenth_of_a_second():
    from rftgym.core.web import _shown_seconds

    # A 1 s request whose lookup began a few milliseconds in (a busy machine) still says 1 s.
    assert [_shown_seconds(s) for s in (0.996, 0.94, 2.5, 0.05, 0.0)] == ["1", "0.9", "2.5", "0.05", "0"]
