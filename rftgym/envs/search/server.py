"""A retrieval HTTP service in Search-R1's ``/retrieve`` shape, and its client.

Many rollout workers (and other frameworks, e.g. Search-R1 and FlashRAG pipelines) can share one
index by querying one server::

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"}, "score": 1.2}, ...], ...]}

With ``"return_scores": false`` each result is the bare document ``{"id", "contents"}``;
``"topk"`` is 3 when left out or null. ``GET /health`` answers
``{"status": "ok", "documents": N, "index": "bm25"}``.

Every refusal is a JSON object ``{"error": "..."}`` that says what was wrong and what to send
instead: 400 (a request line, JSON body or field it cannot read, an unknown field such as a
misspelt ``top_k``, HTTP/0.9, an https:// client), 404 (another path), 405 (another method of a
known path), 408 (a body too slow to arrive), 411 (a body without a Content-Length), 413 (a body
over 8 MiB), 415 (a body labelled as another type, such as text/html, though curl's and
urllib's default label is read as JSON; a compressed body; a charset other than UTF-8), 414 and 431 (a
request line or headers too long), 501 (an unknown method), 505 (HTTP/2 or later); a search that
fails is a 500 with its reason. The service goes on serving other clients after any of them.

:func:`make_server` builds a server over any :class:`Retriever` (standard library
``http.server``, one thread per request, searches serialized by a lock because the indexes are
not documented as thread-safe); :func:`serve` runs it until interrupted (what the
``rftgym serve-retriever`` command should call). :class:`RemoteRetriever` is the client: a
:class:`Retriever` whose searches go to the service, with a timeout, retries with backoff, and
an error saying how to start the service when it is down.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from ...core.errors import ConfigError, RftgymError
from ...core.values import valid_text
from ...core.web import BodyCutShort, BodyTooLarge, BodyTooSlow, is_loopback, read_body, retry_after_s
from .corpora import load_corpus, split_flashrag_contents
from .retrievers import Hit, Retriever, _check_search_args, make_retriever

MAX_BODY_BYTES = 8 * 1024 * 1024
REQUEST_BODY_S = 60.0  # the whole request body must arrive within this (each read has the handler's timeout)
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
MAX_TOPK = 1000
MAX_RESULTS = 100_000  # queries x topk per request: the reply is built whole in memory
MAX_REPLY_BYTES = 512 * 1024 * 1024  # the client's limit on a reply
MAX_ID_CHARS, MAX_TITLE_CHARS = 200, 500
MAX_ERROR_BYTES = 64 * 1024  # of a refusal's body, read for its reason


class RetrievalServiceError(RftgymError, RuntimeError):
    """The retrieval service is down, timed out or answered in an unexpected shape."""


def to_contents(hit: Hit) -> str:
    """FlashRAG's document text: the quoted title, a newline, the text."""
    return f'"{hit.title}"\n{hit.text}'


REQUEST_SHAPE = '{"queries": ["..."], "topk": 3, "return_scores": true}'
USAGE = (f"this service answers POST /retrieve with a JSON body {REQUEST_SHAPE} (Content-Type: application/json) "
         "and GET /health, over HTTP/1.1")
REQUEST_FIELDS = ("queries", "topk", "return_scores")
# Tools that send a body as written label it so by default (curl -d, urllib): read as JSON too.
LENIENT_TYPES = ("application/x-www-form-urlencoded", "text/plain")
MAX_BLANK_LINES = 8  # empty lines read past before a request line (RFC 9112 2.2: some clients send one)
# Hints for the errors the standard library finds before a request reaches this service's code.
_STDLIB_ERROR_HINTS = {
    414: "queries go in the JSON body of POST /retrieve, not in the URL",
    431: "send fewer and shorter headers (at most 100, each under 64 KiB)",
    501: "this service serves POST /retrieve and GET /health (method names are upper case)",
    505: "send HTTP/1.1 (or HTTP/1.0)",
}


class _Handler(BaseHTTPRequestHandler):
    server: "RetrievalServer"
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a client may leave a request unfinished (e.g. a body short of its Content-Length)
    body_read = False

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        if self.server.verbose:
            super().log_message(format, *args)

    def handle_one_request(self) -> None:
        try:
            # A TLS handshake (an https:// URL) holds no line end: the line read would wait for the timeout.
            if self.rfile.peek(1)[:1] == b"\x16":
                self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"
                self._send(400, {"error": "this service speaks plain HTTP, not HTTPS: use an http:// URL"})
                return
            super().handle_one_request()
        except (ConnectionError, TimeoutError):  # the client has gone, or stayed silent: nobody to answer
            self.close_connection = True

    def parse_request(self) -> bool:  # the stdlib's, once per request on a kept-alive connection
        self.body_read = False
        for _ in range(MAX_BLANK_LINES):
            if self.raw_requestline.strip():
                break
            self.raw_requestline = self.rfile.readline(65537)
        if not self.raw_requestline.strip():  # only empty lines, then the client left: no request
            self.close_connection = True
            return False
        if not super().parse_request():
            return False
        if len(self.requestline.split()) == 2:  # HTTP/0.9: no headers, so no body and no JSON
            self.send_error(400, f"HTTP/0.9 request ({_shown(self.requestline)})")
            return False
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's errors (a request line or headers it cannot read, an unknown
        method) in this service's JSON, never its HTML page."""
        if self.request_version in ("HTTP/0.9", ""):
            self.request_version = "HTTP/1.1"  # a reply with a status line and headers: what any client reads
        what = _shown(message or self.responses.get(code, ("error",))[0], 200, quoted=False)
        if explain and code == 431:
            what += f" ({_shown(explain, quoted=False)})"
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
            while time.monotonic() < deadline and self.rfile.read1(1 << 16):
                pass
        except OSError:  # the client has gone, or went on sending past the linger: nothing to save
            pass

    def _route(self) -> str:
        """The request's path without a query string or a trailing slash."""
        return urllib.parse.urlsplit(self.path).path.rstrip("/")

    def _wrong_method(self) -> None:
        allowed = {"/retrieve": "POST", "/health": "GET, HEAD"}.get(self._route())
        if allowed is None:
            path = _shown(self._route() or "/")
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
        try:
            raw = read_body(self.rfile, REQUEST_BODY_S, length, length=length)
        except BodyTooSlow:
            self._send(408, {"error": f"the request body did not arrive within {REQUEST_BODY_S:g} s; send it whole "
                                      "at once"})
            return
        except (BodyCutShort, ConnectionError):  # nobody is left to answer
            self.close_connection = True
            return
        self.body_read = True
        try:
            sent_as = self.headers.get_content_type() if "Content-Type" in self.headers else None
            queries, topk, with_scores = _parse_request(_json_body(raw, sent_as))
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
                                  f"{_shown(self.headers['Transfer-Encoding'])}"}
        lengths = {value.strip() for value in self.headers.get_all("Content-Length", [])}
        if len(lengths) > 1:  # which one frames the body? (a request smuggling trick)
            return 400, {"error": f"bad request: {len(lengths)} different Content-Length headers; send one"}
        length = lengths.pop() if lengths else "0"
        if not (length.isascii() and length.isdigit()):
            got = _shown(length, quoted=False)
            return 400, {"error": f"bad request: Content-Length must be a byte count, got {got}"}
        if int(length) > MAX_BODY_BYTES:
            return 413, {"error": f"the request body is {int(length)} bytes; it must be at most {MAX_BODY_BYTES} "
                                  "bytes: send fewer queries per request"}
        encoding = self.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            return 415, {"error": f"the request body is {_shown(encoding)}-encoded; send it uncompressed, as JSON"}
        problem = _content_type_problem(self.headers)
        return None if problem is None else (415, {"error": problem})


def _content_type_problem(headers) -> str | None:
    """Why a request's Content-Type cannot label its JSON body, or None: none given, a JSON type
    (``application/json``, ``application/*+json``), or a default of tools that send a body as
    written (LENIENT_TYPES), in UTF-8."""
    if "Content-Type" not in headers:
        return None
    media = headers.get_content_type()  # lower case; "text/plain" for a value it cannot read
    maintype, _, subtype = media.partition("/")
    if not (maintype == "application" and (subtype == "json" or subtype.endswith("+json"))) \
            and media not in LENIENT_TYPES:
        return (f"the request body is labelled {_shown(headers['Content-Type'])}; send it as JSON, "
                f"{REQUEST_SHAPE}, with Content-Type: application/json")
    charset = (headers.get_content_charset() or "utf-8").lower()
    if charset not in ("utf-8", "utf8", "us-ascii", "ascii"):
        return f"the request body is in {_shown(charset)}; send it in UTF-8 (Content-Type: application/json)"
    return None


def _json_body(raw: bytes, sent_as: str | None) -> Any:
    """The request body's JSON, or a ValueError that says what the body was instead (``sent_as``:
    the media type its Content-Type named, if any)."""
    labelled = f" (it came as {sent_as})" if sent_as in LENIENT_TYPES else ""
    if not raw.strip():
        raise ValueError(f"the request body is empty; send the JSON object {REQUEST_SHAPE}")
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"the request body is not UTF-8 text ({exc.reason} at byte {exc.start}); send the JSON "
                         f"object {REQUEST_SHAPE} in UTF-8") from None
    except RecursionError:
        raise ValueError(f"the JSON is nested too deeply; send the JSON object {REQUEST_SHAPE}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the request body is not JSON{labelled} ({exc}; it begins {_shown(raw[:40])}); send the "
                         f"JSON object {REQUEST_SHAPE} with Content-Type: application/json") from None


def _shown(value: Any, limit: int = 100, quoted: bool = True) -> str:
    """A client's text (or bytes) for an error message: cut to ``limit`` characters, quoted."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    text = text if len(text) <= limit else text[:limit] + "..."
    return repr(text) if quoted else text


def _same_document(document, hit: Hit, exact: bool = False) -> bool:
    """Whether ``hit`` is ``document``: by id with its title (another world or version numbers its
    own documents alike), or by title or text (a service may number the same documents its way).
    ``exact``: by title and text, whatever the id (a generated world of a neighbouring size has
    the same ids and names, and other facts)."""
    if exact:
        return hit.title == document.title and _opening(hit.text) == _opening(document.text)
    if hit.doc_id == str(document.id) and document.title in (hit.title, ""):
        return True
    return (bool(document.title) and hit.title == document.title) or \
        (bool(document.text.strip()) and hit.text[:200] == document.text[:200])


def _opening(text: str) -> str:
    return " ".join(text.split())[:200]


def _parse_request(request: Any) -> tuple[list[str], int, bool]:
    if not isinstance(request, dict):
        raise ValueError(f"expected a JSON object {REQUEST_SHAPE}, got {_json_kind(request)}")
    unknown = [key for key in request if key not in REQUEST_FIELDS]
    if unknown:  # a misspelt "top_k" would otherwise be answered with the default 3 documents
        raise ValueError(f"unknown field {_shown(unknown[0])}; the fields are \"queries\", \"topk\" and "
                         f"\"return_scores\": {REQUEST_SHAPE}")
    queries = request.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError(f'"queries" must be a list of strings, e.g. {REQUEST_SHAPE}')
    topk = request.get("topk")
    topk = 3 if topk is None else topk  # as in Search-R1, where null is the server's default
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f'"topk" must be an int in [1, {MAX_TOPK}], got {_shown(json.dumps(topk))}')
    if len(queries) * topk > MAX_RESULTS:
        raise ValueError(f"{len(queries)} queries x topk {topk} is more than {MAX_RESULTS:,} results in one request; "
                         "send fewer queries per request")
    scores = request.get("return_scores", True)
    if not isinstance(scores, bool):
        raise ValueError(f'"return_scores" must be true or false, got {_shown(json.dumps(scores))}')
    return queries, topk, scores


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


class RetrievalServer(ThreadingHTTPServer):
    daemon_threads = True
    # Connections waiting to be accepted: socketserver's 5 refuses a burst of rollout workers
    # (64 at once lost 49 of them); the kernel caps it at net.core.somaxconn.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], retriever: Retriever | None, verbose: bool = False):
        # IPv4 or IPv6, as the host names it ("::1" and "localhost" may be either).
        self.address_family = _address_family(*address)
        super().__init__(address, _Handler)
        self.retriever: Retriever | None = None
        self.document_count = 0
        self.lock = threading.Lock()
        self.verbose = verbose
        if retriever is not None:
            self.attach(retriever)

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


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False) -> RetrievalServer:
    """A server over ``retriever``; port 0 picks a free port (see ``server.url``)."""
    return RetrievalServer((host, port), retriever, verbose=verbose)


def serve(corpus, index: str = "bm25", host: str = "127.0.0.1", port: int = 8000) -> None:
    """Load a corpus (a file's path, or a function that returns the documents), index it and serve
    it until interrupted (``rftgym serve-retriever``). The address is taken first: a busy port or a
    wrong host is reported before the indexing."""
    try:
        server = RetrievalServer((host, port), None, verbose=True)
    except OSError as exc:  # an unknown host, an address not this machine's, a port in use
        raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc}. Use a host name or address of this "
                          "machine (e.g. 127.0.0.1 or ::1) and a free --port (0 picks one)") from None
    try:
        server.attach(make_retriever(index, corpus() if callable(corpus) else load_corpus(corpus)))
        print(f"serving {server.document_count} documents ({index}) at {server.url}", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if server.retriever is not None:
            server.retriever.close()


_PROBED: set[tuple[str, int]] = set()  # (URL, k) pairs that have answered a probe in this process
_CORPUS_CHECKED: set[tuple[str, int, str]] = set()  # (URL, corpus size, first id) checked in this process


def check_service_url(url: Any) -> str:
    """``url`` as the retrieval service's ``/retrieve`` endpoint, or a ConfigError saying what is
    wrong with it: an http(s) URL with a host, a port in 1-65535 (urllib would wrap a larger one
    round to another port), and no query or fragment."""
    example = "e.g. http://127.0.0.1:8000/retrieve"
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"retriever_url must be the service's URL, {example}; got {url!r}", field="retriever_url")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:  # a bad IPv6 literal, a port that is not a number or out of range
        raise ConfigError(f"retriever_url {url!r} is not a valid URL ({exc}); {example}", field="retriever_url") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"retriever_url must be an http:// or https:// URL with a host, {example}; got {url!r}",
                          field="retriever_url")
    if port == 0 or parts.query or parts.fragment or any(c.isspace() for c in url.strip()):
        raise ConfigError(f"retriever_url {url!r} has a port 0, a query, a fragment or a space; {example}",
                          field="retriever_url")
    path = parts.path.rstrip("/")
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc, path if path.endswith("/retrieve")
                                    else path + "/retrieve", "", ""))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is reported, not followed: urllib would follow it anywhere, as a GET without the
    request's body."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 (urllib's hook)
        return None


def _clean(text: str, limit: int | None = None) -> str:
    """A service's text as an observation may hold it: lone surrogates (valid in JSON, not in
    UTF-8) replaced, at most ``limit`` characters."""
    text = valid_text(text)
    return text if limit is None or len(text) <= limit else text[:limit] + "…"


def _error_detail(error: urllib.error.HTTPError) -> str:
    """What a refusal says: the ``error`` of this service's JSON body (or of any service that
    answers so), else the start of the body as text."""
    try:
        raw = error.read(MAX_ERROR_BYTES)
    except (OSError, ValueError, AttributeError, http.client.HTTPException):  # cut short, or no body at all
        return "(no readable reason)"
    try:
        message = json.loads(raw.decode("utf-8-sig")).get("error")
    except (ValueError, AttributeError, RecursionError):  # not JSON, or JSON without an "error"
        message = None
    if isinstance(message, str) and message.strip():
        return _clean(message, 1000)
    return _clean(raw[:300].decode("utf-8", "replace")).strip() or "(no reason given)"


class RemoteRetriever(Retriever):
    """A :class:`Retriever` backed by a retrieval service in Search-R1's ``/retrieve`` shape."""

    name = "remote"

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5):
        self.url = check_service_url(url)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        # A service on this machine is never reached through an HTTP(S)_PROXY from the environment.
        handlers = [_NoRedirect()] + ([urllib.request.ProxyHandler({})]
                                      if is_loopback(urllib.parse.urlsplit(self.url).hostname) else [])
        self._opener = urllib.request.build_opener(*handlers)

    def probe(self, k: int = 1) -> None:
        """One search for ``k`` documents, once per URL and process: a service that is down, answers
        in another shape or refuses ``k`` is then found when the first env is made rather than at
        the agent's first search (``/health`` is this project's own; other Search-R1-style
        services have only ``/retrieve``)."""
        if (self.url, k) not in _PROBED:
            self.search(["probe"], k)
            _PROBED.add((self.url, k))

    def check_corpus(self, documents: Sequence, source: str, k: int, whole: bool = False) -> None:
        """Warn, once per URL and corpus in a process, when the service finds none of ``documents``
        when asked for three of them by title: it then indexes another corpus than the env's own
        (``source`` names it), so the gold answers' documents can never come back. With ``whole``
        (a corpus the service must hold all of, such as a generated world, whose names are its
        own), also when it misses any of the three, each compared by title and text: a world of
        another size shares some names, and even all of them with other facts."""
        if not documents:
            return
        key = (self.url, len(documents), str(documents[0].id))
        if key in _CORPUS_CHECKED:
            return
        sample = list(documents[:: max(1, len(documents) // 3)])[:3]
        # A document without a title (FlashRAG contents without a title line) is asked for by its
        # first words instead.
        sample = [d for d in sample if d.title or d.text.strip()]  # nothing to ask for by an empty one
        if not sample:
            return
        results = self.search([d.title or " ".join(d.text.split()[:12]) for d in sample], k)
        _CORPUS_CHECKED.add(key)
        found = sum(any(_same_document(d, hit, exact=whole) for hit in hits) for d, hits in zip(sample, results))
        if found == 0 or (whole and found < len(sample)):
            what = "none" if found == 0 else f"only {found}"
            warnings.warn(
                f"the retrieval service at {self.url} returned {what} of the env's documents (by id, title or text) "
                f"when asked for {len(sample)} of them: it indexes another corpus than {source}, so searches cannot "
                "find the documents that hold the answers. Serve the env's corpus (rftgym serve-retriever --corpus "
                "FILE, or --world-seed N --world-size N for the generated world), or give as dataset_path the "
                "questions of the corpus the service indexes.",
                RuntimeWarning, stacklevel=4)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = _check_search_args(queries, k)
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": int(k), "return_scores": True}).encode()
        payload = self._post(body)
        if isinstance(payload, dict) and "result" not in payload and isinstance(payload.get("error"), str):
            raise RetrievalServiceError(f"{self.url} answered with an error: {_clean(payload['error'], 1000)}")
        try:
            results = payload["result"]
            if not isinstance(results, list) or len(results) != len(queries):
                raise ValueError(f"{len(results) if isinstance(results, list) else 'no'} result lists for "
                                 f"{len(queries)} queries")
            return [[self._hit(item) for item in hits][:k] for hits in results]
        except (KeyError, TypeError, ValueError) as exc:
            raise RetrievalServiceError(f"{self.url} answered in an unexpected shape ({exc}); expected "
                                        '{"result": [[{"document": {"id", "contents"}, "score"}]]}') from None

    @staticmethod
    def _hit(item: dict) -> Hit:
        document = item["document"] if "document" in item else item
        doc_id, contents, score = document["id"], document["contents"], item.get("score", 0.0)
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or not isinstance(contents, str):
            raise ValueError(f"a document needs a string (or int) 'id' and string 'contents', got id {doc_id!r}")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"a score must be a finite number, got {score!r}")
        title, text = split_flashrag_contents(contents)
        # Ids and titles go into the observation whole (texts are cut there): a line each at most.
        return Hit(_clean(str(doc_id), MAX_ID_CHARS).replace("\n", " "), _clean(title, MAX_TITLE_CHARS),
                   _clean(text), float(score))

    def _post(self, body: bytes) -> dict:
        last_error, wait_at_least = "no attempt", 0.0
        for attempt in range(self.retries + 1):
            if attempt:  # a busy service's Retry-After is waited out
                time.sleep(max(self.backoff * 2 ** (attempt - 1), wait_at_least))
                wait_at_least = 0.0
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    raw = self._read(response)
            except urllib.error.HTTPError as exc:
                with exc:
                    detail = _error_detail(exc)
                if 300 <= exc.code < 400:
                    raise RetrievalServiceError(
                        f"{self.url} answered with a redirect ({exc.code}) to {exc.headers.get('Location')!r}, which "
                        "is not followed; give the service's own URL as retriever_url") from None
                if exc.code < 500 and exc.code not in (408, 429):  # the request is wrong: asking again won't help
                    raise RetrievalServiceError(f"{self.url} rejected the request ({exc.code}): {detail}") from None
                last_error = f"it failed with HTTP {exc.code}: {detail[:300]}"
                wait_at_least = retry_after_s(exc.headers) or 0.0
                continue
            except BodyTooSlow:
                last_error = f"the reply took over {self.timeout:g} s to arrive"
                continue
            except BodyCutShort as exc:
                last_error = str(exc)
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                last_error = f"no answer: {reason}"
                continue
            # It answered: a body that is not JSON is its shape, which asking again will not change.
            try:
                return json.loads(raw.decode("utf-8-sig"))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                problem = "nested too deeply" if isinstance(exc, RecursionError) else f"not UTF-8 JSON ({exc})"
                raise RetrievalServiceError(
                    f"{self.url} answered, but its body is {problem}; it begins {raw[:80]!r}; expected "
                    '{"result": [[{"document": {"id", "contents"}, "score"}]]}. Is this URL a Search-R1-style '
                    "/retrieve service (e.g. rftgym serve-retriever)?") from None
        raise RetrievalServiceError(
            f"the retrieval service at {self.url} failed {self.retries + 1} attempt{'s' if self.retries else ''} "
            f"(last: {last_error}). Is it "
            "running and healthy? Start one with: rftgym serve-retriever --corpus <file> --index bm25") from None

    def _read(self, response) -> bytes:
        """The body, within ``timeout`` of the headers and at most MAX_REPLY_BYTES."""
        try:
            return read_body(response, self.timeout, MAX_REPLY_BYTES)
        except BodyTooLarge:
            raise RetrievalServiceError(f"{self.url} sent a reply of over {MAX_REPLY_BYTES >> 20} MiB; lower "
                                        "top_k or the number of queries per search") from None
