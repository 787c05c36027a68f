"""A retrieval HTTP service in Search-R1's ``/retrieve`` shape (its client: :mod:`.client`).

Many rollout workers (and other frameworks, e.g. Search-R1 and FlashRAG pipelines) can share one
index by querying one server::

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"}, "score": 1.2}, ...], ...]}

With ``"return_scores": false`` each result is the bare document ``{"id", "contents"}``;
``"topk"`` is 3 when left out or null. ``GET /health`` answers
``{"status": "ok", "documents": N, "index": "bm25"}``.

Every refusal is a JSON object ``{"error": "..."}`` that says what was wrong and what to send
instead: 400 (a request line, JSON body or field it cannot read, an unknown field such as a
misspelt ``top_k``, though other extra fields are ignored as Search-R1's server ignores them;
HTTP/0.9, an https:// client), 404 (another path), 405 (another method of a known path), 408 (a
request line, headers or body too slow to arrive), 411 (a body without a Content-Length), 413 (a
body over 8 MiB), 415 (a body labelled as another type, such as text/html, though curl's and
urllib's default label is read as JSON; a compressed body; a charset other than UTF-8), 414 and
431 (a request line or headers too long), 501 (an unknown method), 505 (HTTP/2 or later); a
search that fails is a 500 with its reason. The service goes on serving other clients after any
of them.

Connections: at most ``max_connections`` (default 128) are handled at once, a thread each;
more wait in the listen backlog until one ends, so a burst of workers is served late rather
than refused (a search is short and searches are serialized anyway, so a wait costs little,
and a refusal would cost a failed rollout once the client's retries ran out). A kept-alive
connection with no next request within ``idle_timeout_s`` (default 5 s) is closed; a request's
line and headers must then arrive within REQUEST_HEAD_S of its first byte, and its body within
REQUEST_BODY_S, so that a client trickling a byte at a time cannot hold a slot for ever (one that
is late, or stops arriving, is answered 408 and closed); while connections wait for a slot, every
reply closes its connection, so that the slots go round.

:func:`make_server` builds a server over any :class:`Retriever` (standard library
``http.server``, searches serialized by a lock because the indexes are not documented as
thread-safe); :func:`serve` runs it until interrupted (what the ``rftgym serve-retriever``
command calls).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import socket
import threading
import time
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ...core.errors import ConfigError
from ...core.web import BodyCutShort, BodyTooSlow, read_body
# The client lived here before it had a module of its own: its names still import from here.
from .client import RemoteRetriever, RetrievalServiceError, check_service_url  # noqa: F401
from .corpora import load_corpus
from .retrieve_request import REQUEST_SHAPE, content_type_problem, json_body, parse_request, shown
from .retrievers import Hit, Retriever, make_retriever

MAX_BODY_BYTES = 8 * 1024 * 1024
REQUEST_HEAD_S = 10.0  # a request's line and headers must arrive within this of its first byte
REQUEST_BODY_S = 60.0  # the whole request body must arrive within this (each read waits at most what is left of it)
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
DEFAULT_MAX_CONNECTIONS = 128  # handled at once: a 64-worker rollout twice over (a thread each)
IDLE_TIMEOUT_S = 5.0  # a kept-alive connection's wait for its next request (as uvicorn's and Apache's)


def to_contents(hit: Hit) -> str:
    """FlashRAG's document text: the quoted title, a newline, the text."""
    return f'"{hit.title}"\n{hit.text}'


USAGE = (f"this service answers POST /retrieve with a JSON body {REQUEST_SHAPE} (Content-Type: application/json) "
         "and GET /health, over HTTP/1.1")
MAX_BLANK_LINES = 8  # empty lines read past before a request line (RFC 9112 2.2: some clients send one)
# Hints for the errors the standard library finds before a request reaches this service's code.
_STDLIB_ERROR_HINTS = {
    414: "queries go in the JSON body of POST /retrieve, not in the URL",
    431: "send fewer and shorter headers (at most 100, each under 64 KiB)",
    501: "this service serves POST /retrieve and GET /health (method names are upper case)",
    505: "send HTTP/1.1 (or HTTP/1.0)",
}


class RequestHeadTooSlow(Exception):
    """A request's line and headers did not arrive within REQUEST_HEAD_S. (Neither a TimeoutError
    nor an http.client.HTTPException: the standard library would answer those itself, the first
    by closing the connection unanswered, the second as a 431.)"""


class _RequestStream(io.BufferedReader):
    """A connection's request stream. While ``head_deadline`` is set (a time.monotonic() value), a
    line must end by then (else RequestHeadTooSlow); while ``body_deadline`` is set, each
    ``read1`` must return by then (else BodyTooSlow). A socket timeout bounds each read only, so a
    client trickling a byte at a time could take for ever over its request, holding a thread and
    a slot."""

    def __init__(self, connection: socket.socket):
        super().__init__(connection.makefile("rb", buffering=0))
        self.connection = connection
        self.head_deadline: float | None = None
        self.body_deadline: float | None = None

    def readline(self, limit: int | None = -1) -> bytes:
        if self.head_deadline is None:
            return super().readline(limit)
        limit = -1 if limit is None else limit
        line = bytearray()
        while limit < 0 or len(line) < limit:
            with self._read_by(self.head_deadline, RequestHeadTooSlow):
                buffered = self.peek(1)  # what is buffered, or else one read from the socket
            if not buffered:  # the client closed its side
                break
            wanted = len(buffered) if limit < 0 else min(len(buffered), limit - len(line))
            end = buffered.find(b"\n", 0, wanted)
            line += self.read(wanted if end < 0 else end + 1)  # from the buffer: no wait
            if end >= 0:
                break
        return bytes(line)

    def read1(self, size: int = -1) -> bytes:  # what core.web.read_body reads a body with
        if self.body_deadline is None:
            return super().read1(size)
        with self._read_by(self.body_deadline, BodyTooSlow):
            return super().read1(size)

    @contextlib.contextmanager
    def _read_by(self, deadline: float, too_slow: type[Exception]):
        """Bound the read in the ``with`` block by what is left until ``deadline`` (``too_slow``
        is raised once it has passed) as well as by the socket's own timeout (a TimeoutError),
        whichever ends first; the socket's timeout is restored afterwards."""
        per_read_s = self.connection.gettimeout()
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise too_slow
        deadline_first = per_read_s is None or left_s <= per_read_s
        self.connection.settimeout(left_s if deadline_first else per_read_s)
        try:
            yield
        except TimeoutError:
            if deadline_first:
                raise too_slow from None
            raise
        finally:
            self.connection.settimeout(per_read_s)


class _Handler(BaseHTTPRequestHandler):
    server: "RetrievalServer"
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds each read of a request may wait (a request head and body also have deadlines in all)
    body_read = False

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        if self.server.verbose:
            super().log_message(format, *args)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the standard library's stream, replaced by one that keeps a head to its deadline
        self.rfile = _RequestStream(self.connection)

    def handle_one_request(self) -> None:
        try:
            first = self._first_byte_of_next_request()
            if not first:  # the client left, or sent nothing within the idle timeout
                self.close_connection = True
                return
            # This request's, not the last one's on a kept-alive connection, for a refusal before its line is read.
            self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"
            self.body_read = False
            # A TLS handshake (an https:// URL) holds no line end: the line read would wait for the timeout.
            if first == b"\x16":
                self._send(400, {"error": "this service speaks plain HTTP, not HTTPS: use an http:// URL"})
                return
            self.rfile.head_deadline = time.monotonic() + REQUEST_HEAD_S
            try:
                super().handle_one_request()
            except RequestHeadTooSlow:
                if self.request_version in ("HTTP/0.9", ""):  # a reply with a status line, as send_error's
                    self.request_version = "HTTP/1.1"
                self._send(408, {"error": f"the request line and headers did not arrive within {REQUEST_HEAD_S:g} s; "
                                          "send them whole at once"})
            finally:
                self.rfile.head_deadline = None  # the body has a deadline of its own, and so has the idle wait
        except (ConnectionError, TimeoutError):  # the client has gone, or stayed silent: nobody to answer
            self.close_connection = True

    def _first_byte_of_next_request(self) -> bytes:
        """The next request's first byte, waited for at most the server's idle timeout (a kept-alive
        connection holds a thread and a slot while it waits); b"" when none came. The rest of the
        request then has the handler's longer ``timeout`` for each read, REQUEST_HEAD_S for its
        line and headers in all, and REQUEST_BODY_S for its body."""
        self.connection.settimeout(self.server.idle_timeout_s)
        try:
            return self.rfile.peek(1)[:1]
        except TimeoutError:
            self.server.connections.count_idle_close()
            return b""
        finally:
            self.connection.settimeout(self.timeout)

    def parse_request(self) -> bool:  # the stdlib's, once per request on a kept-alive connection
        for _ in range(MAX_BLANK_LINES):
            if self.raw_requestline.strip():
                break
            self.raw_requestline = self.rfile.readline(65537)
        if not self.raw_requestline.strip():  # only empty lines, then the client left: no request
            self.close_connection = True
            return False
        if len(self.raw_requestline) > 65536:  # the stdlib's own check saw only the empty line
            self.requestline, self.request_version, self.command = "", "", ""  # as the stdlib sets them there
            self.send_error(414)
            return False
        if len(self.raw_requestline.split()) == 2:  # HTTP/0.9: no headers, so no body and no JSON
            # (refused before the stdlib's parse, which would wait for headers such a client never sends)
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
            self.command, self.request_version, self.close_connection = None, "", True
            self.send_error(400, f"HTTP/0.9 request ({shown(self.requestline)})")
            return False
        return super().parse_request()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's errors (a request line or headers it cannot read, an unknown
        method) in this service's JSON, never its HTML page."""
        if self.request_version in ("HTTP/0.9", ""):
            self.request_version = "HTTP/1.1"  # a reply with a status line and headers: what any client reads
        what = shown(message or self.responses.get(code, ("error",))[0], 200, quoted=False)
        if explain and code == 431:
            what += f" ({shown(explain, quoted=False)})"
        self._send(code, {"error": f"{what}: {_STDLIB_ERROR_HINTS.get(code, USAGE)}"})

    def _send(self, status: int, payload: dict, allow: str | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if allow is not None:
            self.send_header("Allow", allow)
        if status >= 400:
            # The request's body may be unread (a wrong method, a refused length): on a kept-alive
            # connection it would be read as the next request.
            self.send_header("Connection", "close")
            self.close_connection = True
        elif not self.close_connection and self.server.connections.contended():
            self.send_header("Connection", "close")  # a connection waits for a slot: this one gives its slot up
        elif not self.close_connection:
            # How long the connection waits for the next request, for the clients that read it.
            self.send_header("Keep-Alive", f"timeout={math.floor(self.server.idle_timeout_s)}")
        self.end_headers()
        if self.command != "HEAD":  # a reply to HEAD has the headers of the body alone
            self.wfile.write(body)
        if status >= 400 and not self.body_read:
            self._drain()

    def _drain(self) -> None:
        """Read and drop what the client still sends, for up to LINGER_S: closing a socket with
        unread bytes resets the connection, and a client still sending its body would see a
        broken pipe instead of the refusal just written."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            deadline = time.monotonic() + LINGER_S
            # From the socket: a stream whose read timed out (a head or body past its deadline) reads no more.
            while time.monotonic() < deadline and self.connection.recv(1 << 16):
                pass
        except OSError:  # the client has gone, or went on sending past the linger: nothing to save
            pass

    def _route(self) -> str:
        """The request's path without a query string or a trailing slash."""
        return urllib.parse.urlsplit(self.path).path.rstrip("/")

    def _wrong_method(self) -> None:
        allowed = {"/retrieve": "POST", "/health": "GET, HEAD"}.get(self._route())
        if allowed is None:
            path = shown(self._route() or "/")
            self._send(404, {"error": f"unknown path {path}; use POST /retrieve or GET /health"})
            return
        self._send(405, {"error": f"{self.command} is not served at {self._route()}; use {allowed}"}, allow=allowed)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _wrong_method  # noqa: N815 - the stdlib's names

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name (HEAD too: its reply leaves the body out)
        if self._route() != "/health":
            self._wrong_method()
            return
        self._send(200, {"status": "ok", "documents": self.server.document_count, "index": self.server.retriever.name})

    do_HEAD = do_GET  # noqa: N815 - the stdlib's name

    def handle_expect_100(self) -> bool:
        """"100 Continue" only to a request whose body will be read: a refused one gets its refusal
        at once, before its client sends the body."""
        if self.command == "POST" and self._route() == "/retrieve" and self._refusal_before_body() is None:
            return super().handle_expect_100()
        return True

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        if self._route() != "/retrieve":
            self._wrong_method()
            return
        refusal = self._refusal_before_body()
        if refusal is not None:
            self._send(*refusal)
            return
        length = int(self.headers.get("Content-Length", "0"))
        self.rfile.body_deadline = time.monotonic() + REQUEST_BODY_S
        try:
            raw = read_body(self.rfile, REQUEST_BODY_S, length, length=length)
        except BodyTooSlow:
            self._send(408, {"error": f"the request body did not arrive within {REQUEST_BODY_S:g} s; send it whole "
                                      "at once"})
            return
        except TimeoutError:  # nothing came for a whole read's timeout (the stdlib would close unanswered)
            self._send(408, {"error": f"the request body stopped arriving (nothing came for {self.timeout:g} s); "
                                      "send it whole at once"})
            return
        except (BodyCutShort, ConnectionError):  # nobody is left to answer
            self.close_connection = True
            return
        finally:
            self.rfile.body_deadline = None
        self.body_read = True
        try:
            sent_as = self.headers.get_content_type() if "Content-Type" in self.headers else None
            queries, topk, with_scores = parse_request(json_body(raw, sent_as))
        except ValueError as exc:
            self._send(400, {"error": f"bad request: {exc}"})
            return
        try:
            with self.server.lock:
                results = self.server.retriever.search(queries, topk)
        except Exception as exc:  # noqa: BLE001 - a failed search is the client's answer, not a dropped connection
            if self.server.verbose:
                traceback.print_exc()
            self._send(500, {"error": f"the search failed: {type(exc).__name__}: {exc}"})
            return
        if with_scores:
            payload = [[{"document": {"id": h.doc_id, "contents": to_contents(h)}, "score": h.score} for h in hits]
                       for hits in results]
        else:
            payload = [[{"id": h.doc_id, "contents": to_contents(h)} for h in hits] for hits in results]
        self._send(200, {"result": payload})

    def _refusal_before_body(self) -> tuple[int, dict] | None:
        """(status, payload) for a POST /retrieve whose headers already show it cannot be served."""
        if "Transfer-Encoding" in self.headers:
            # http.server does not decode chunked bodies; reading one as a Content-Length body would
            # answer as if the request were empty.
            return 411, {"error": f"send the request body with a Content-Length, not Transfer-Encoding: "
                                  f"{shown(self.headers['Transfer-Encoding'])}"}
        lengths = {value.strip() for value in self.headers.get_all("Content-Length", [])}
        if len(lengths) > 1:  # which one frames the body? (a request smuggling trick)
            return 400, {"error": f"bad request: {len(lengths)} different Content-Length headers; send one"}
        if not lengths:  # a body with no length: how much of what follows is it? (nothing is JSON either)
            return 411, {"error": f"send the request body with a Content-Length header: {REQUEST_SHAPE}"}
        length = lengths.pop()
        if not (length.isascii() and length.isdigit()):
            got = shown(length, quoted=False)
            return 400, {"error": f"bad request: Content-Length must be a byte count, got {got}"}
        if int(length) > MAX_BODY_BYTES:
            return 413, {"error": f"the request body is {int(length)} bytes; it must be at most {MAX_BODY_BYTES} "
                                  "bytes: send fewer queries per request"}
        encoding = self.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            return 415, {"error": f"the request body is {shown(encoding)}-encoded; send it uncompressed, as JSON"}
        problem = content_type_problem(self.headers)
        return None if problem is None else (415, {"error": problem})


class ConnectionSlots:
    """At most ``limit`` connections handled at once. The accept loop takes a slot before a
    connection gets its thread, and waits while none is free (the connections behind it wait in
    the listen backlog); a handler's thread gives its slot back when its connection ends."""

    def __init__(self, limit: int):
        self.limit = limit
        self.busy = 0  # connections being handled
        self.waiting = False  # whether the accept loop holds a connection that waits for a slot
        self.idle_closed = 0  # connections closed for sending no request within the idle timeout
        self._stopping = False
        self._changed = threading.Condition()

    def take(self) -> bool:
        """Wait for a free slot and take it; False when the server is shutting down."""
        with self._changed:
            try:
                while self.busy >= self.limit and not self._stopping:
                    self.waiting = True
                    self._changed.wait()
            finally:  # also when the wait is interrupted (Ctrl-C): no reply should close for nothing
                self.waiting = False
            if self._stopping:
                return False
            self.busy += 1
            return True

    def give_back(self) -> None:
        with self._changed:
            self.busy -= 1
            self._changed.notify_all()

    def contended(self) -> bool:
        """Whether a connection is waiting for a slot (a reply then closes its connection)."""
        return self.waiting

    def count_idle_close(self) -> None:
        with self._changed:
            self.idle_closed += 1

    def stop(self) -> None:
        """Make ``take`` give up, now and until ``reopen``: the server is shutting down."""
        self._set_stopping(True)

    def reopen(self) -> None:
        self._set_stopping(False)

    def _set_stopping(self, stopping: bool) -> None:
        with self._changed:
            self._stopping = stopping
            self._changed.notify_all()


class RetrievalServer(ThreadingHTTPServer):
    """The service on ``address``, over ``retriever`` (or one attached later). ``connections``
    counts the connections handled (``busy``), whether one waits for a slot, and the idle ones
    closed."""

    daemon_threads = True
    # Connections waiting to be accepted: socketserver's 5 refuses a burst of rollout workers
    # (64 at once lost 49 of them); the kernel caps it at net.core.somaxconn. Those beyond
    # max_connections wait here too.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], retriever: Retriever | None, verbose: bool = False,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S):
        _check_connection_limits(max_connections, idle_timeout_s)  # before the port is taken
        # IPv4 or IPv6, as the host names it ("::1" and "localhost" may be either).
        self.address_family = _address_family(*address)
        super().__init__(address, _Handler)
        self.retriever: Retriever | None = None
        self.document_count = 0
        self.lock = threading.Lock()
        self.verbose = verbose
        self.connections = ConnectionSlots(max_connections)
        self.idle_timeout_s = float(idle_timeout_s)
        if retriever is not None:
            self.attach(retriever)

    def process_request(self, request, client_address) -> None:  # the accept loop's, once per connection
        if not self.connections.take():
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (e.g. none left to start): nobody else gives the slot back
            self.connections.give_back()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.give_back()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        try:
            super().serve_forever(poll_interval)
        finally:
            self.connections.reopen()  # a later serve_forever waits for slots again

    def shutdown(self) -> None:
        self.connections.stop()  # an accept loop waiting for a slot would never see the request
        super().shutdown()

    def attach(self, retriever: Retriever) -> None:
        """Serve ``retriever`` (the socket may be bound first, so that a busy port is found before
        a long indexing run rather than after it)."""
        self.retriever = retriever
        self.document_count = len(getattr(retriever, "documents", ()))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/retrieve"


def _address_family(host: str, port: int) -> socket.AddressFamily:
    if not host:  # the socket layer reads "" as every interface, which nobody asking for "" means
        raise ConfigError("the host is empty; give 127.0.0.1 (this machine only) or, to serve other machines, "
                          "0.0.0.0 explicitly", field="host")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise OSError(f"unknown host {host!r} ({exc})") from None
    return infos[0][0]


def _check_connection_limits(max_connections: Any, idle_timeout_s: Any) -> None:
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ConfigError(f"max_connections must be a whole number >= 1 (connections handled at once; default "
                          f"{DEFAULT_MAX_CONNECTIONS}), got {max_connections!r}", field="max_connections")
    if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) \
            or not math.isfinite(idle_timeout_s) or idle_timeout_s <= 0:
        raise ConfigError(f"idle_timeout_s must be a number of seconds > 0 (how long a kept-alive connection may "
                          f"wait for its next request; default {IDLE_TIMEOUT_S:g}), got {idle_timeout_s!r}",
                          field="idle_timeout_s")


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False,
                max_connections: int = DEFAULT_MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S
                ) -> RetrievalServer:
    """A server over ``retriever``; port 0 picks a free port (see ``server.url``). At most
    ``max_connections`` connections are handled at once (more wait to be accepted); a kept-alive
    connection is closed after ``idle_timeout_s`` without a request."""
    return RetrievalServer((host, port), retriever, verbose=verbose, max_connections=max_connections,
                           idle_timeout_s=idle_timeout_s)


def serve(corpus, index: str = "bm25", host: str = "127.0.0.1", port: int = 8000,
          max_connections: int = DEFAULT_MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Load a corpus (a file's path, or a function that returns the documents), index it and serve
    it until interrupted (``rftgym serve-retriever``). The address is taken first: a busy port or a
    wrong host is reported before the indexing. ``max_connections`` and ``idle_timeout_s``: as
    for :func:`make_server`."""
    try:
        server = RetrievalServer((host, port), None, verbose=True, max_connections=max_connections,
                                 idle_timeout_s=idle_timeout_s)
    except OSError as exc:  # an unknown host, an address not this machine's, a port in use
        raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc}. Use a host name or address of this "
                          "machine (e.g. 127.0.0.1 or ::1) and a free --port (0 picks one)") from None
    try:
        server.attach(make_retriever(index, corpus() if callable(corpus) else load_corpus(corpus)))
        print(f"serving {server.document_count} documents ({index}) at {server.url}, at most {max_connections} "
              f"connection{'s' if max_connections != 1 else ''} at once", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if server.retriever is not None:
            server.retriever.close()
