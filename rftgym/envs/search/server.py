"""A retrieval HTTP service in Search-R1's ``/retrieve`` shape, and its client.

Many rollout workers (and other frameworks, e.g. Search-R1 and FlashRAG pipelines) can share one
index by querying one server::

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"}, "score": 1.2}, ...], ...]}

With ``"return_scores": false`` each result is the bare document ``{"id", "contents"}``.
``GET /health`` answers ``{"status": "ok", "documents": N, "index": "bm25"}``.

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
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from ...core.errors import RftgymError
from .corpora import load_corpus, split_flashrag_contents
from .retrievers import Hit, Retriever, _check_search_args, make_retriever

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_TOPK = 1000


class RetrievalServiceError(RftgymError, RuntimeError):
    """The retrieval service is down, timed out or answered in an unexpected shape."""


def to_contents(hit: Hit) -> str:
    """FlashRAG's document text: the quoted title, a newline, the text."""
    return f'"{hit.title}"\n{hit.text}'


class _Handler(BaseHTTPRequestHandler):
    server: "RetrievalServer"
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a client may leave a request unfinished (e.g. a body short of its Content-Length)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.rstrip("/") != "/health":
            self._send(404, {"error": "unknown path; use POST /retrieve or GET /health"})
            return
        self._send(200, {"status": "ok", "documents": self.server.document_count, "index": self.server.retriever.name})

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.rstrip("/") != "/retrieve":
            self._send(404, {"error": "unknown path; use POST /retrieve"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if length < 0:
                raise ValueError(f"Content-Length must be a byte count, got {length}")
            if length > MAX_BODY_BYTES:
                raise ValueError(f"the request body must be at most {MAX_BODY_BYTES} bytes")
            request = json.loads(self.rfile.read(length) or b"null")
            queries, topk, with_scores = _parse_request(request)
        except (ValueError, UnicodeDecodeError) as exc:
            self._send(400, {"error": f"bad request: {exc}"})
            return
        except RecursionError:
            self._send(400, {"error": "bad request: the JSON is nested too deeply"})
            return
        with self.server.lock:
            results = self.server.retriever.search(queries, topk)
        if with_scores:
            payload = [[{"document": {"id": h.doc_id, "contents": to_contents(h)}, "score": h.score} for h in hits]
                       for hits in results]
        else:
            payload = [[{"id": h.doc_id, "contents": to_contents(h)} for h in hits] for hits in results]
        self._send(200, {"result": payload})


def _parse_request(request: Any) -> tuple[list[str], int, bool]:
    if not isinstance(request, dict):
        raise ValueError('expected a JSON object {"queries": [...], "topk": k, "return_scores": bool}')
    queries = request.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('"queries" must be a list of strings')
    topk = request.get("topk", 3)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f'"topk" must be an int in [1, {MAX_TOPK}]')
    return queries, topk, bool(request.get("return_scores", True))


class RetrievalServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], retriever: Retriever, verbose: bool = False):
        super().__init__(address, _Handler)
        self.retriever = retriever
        self.document_count = len(getattr(retriever, "documents", ()))
        self.lock = threading.Lock()
        self.verbose = verbose

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/retrieve"


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False) -> RetrievalServer:
    """A server over ``retriever``; port 0 picks a free port (see ``server.url``)."""
    if not host:  # the socket layer reads "" as every interface, which nobody asking for "" means
        raise RetrievalServiceError("the host is empty; give 127.0.0.1 (this machine only) or, to serve other "
                                    "machines, 0.0.0.0 explicitly")
    return RetrievalServer((host, port), retriever, verbose=verbose)


def serve(corpus: str, index: str = "bm25", host: str = "127.0.0.1", port: int = 8000) -> None:
    """Load a corpus, index it and serve it until interrupted (``rftgym serve-retriever``)."""
    server = make_server(make_retriever(index, load_corpus(corpus)), host, port, verbose=True)
    print(f"serving {server.document_count} documents ({index}) at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.retriever.close()


_PROBED: set[str] = set()  # the URLs that have answered a probe in this process


class RemoteRetriever(Retriever):
    """A :class:`Retriever` backed by a retrieval service in Search-R1's ``/retrieve`` shape."""

    name = "remote"

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise RetrievalServiceError(f"the retrieval service URL must start with http:// or https://, got {url!r}")
        self.url = url if url.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def probe(self) -> None:
        """One one-document search, once per URL and process: a service that is down, or answers
        in another shape, is then found when the first env is made rather than at the agent's
        first search (``/health`` is this project's own; other Search-R1-style services have only
        ``/retrieve``)."""
        if self.url not in _PROBED:
            self.search(["probe"], 1)
            _PROBED.add(self.url)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = _check_search_args(queries, k)
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": int(k), "return_scores": True}).encode()
        payload = self._post(body)
        try:
            results = payload["result"]
            if len(results) != len(queries):
                raise ValueError(f"{len(results)} result lists for {len(queries)} queries")
            return [[self._hit(item) for item in hits][:k] for hits in results]
        except (KeyError, TypeError, ValueError) as exc:
            raise RetrievalServiceError(f"{self.url} answered in an unexpected shape ({exc}); expected "
                                        '{"result": [[{"document": {"id", "contents"}, "score"}]]}') from exc

    @staticmethod
    def _hit(item: dict) -> Hit:
        document = item["document"] if "document" in item else item
        title, text = split_flashrag_contents(str(document["contents"]))
        return Hit(str(document["id"]), title, text, float(item.get("score", 0.0)))

    def _post(self, body: bytes) -> dict:
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                if exc.code < 500:  # the request itself is wrong: retrying will not help
                    detail = exc.read().decode("utf-8", "replace")[:300]
                    raise RetrievalServiceError(f"{self.url} rejected the request ({exc.code}): {detail}") from exc
                last_error = exc
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
                last_error = exc
                continue
            # It answered: a body that is not JSON is its shape, which asking again will not change.
            try:
                return json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                problem = "nested too deeply" if isinstance(exc, RecursionError) else "not UTF-8 JSON"
                raise RetrievalServiceError(
                    f"{self.url} answered, but its body is {problem} (it begins {raw[:80]!r}); expected "
                    '{"result": [[{"document": {"id", "contents"}, "score"}]]}. Is this URL a Search-R1-style '
                    "/retrieve service (e.g. rftgym serve-retriever)?") from None
        raise RetrievalServiceError(
            f"the retrieval service at {self.url} did not answer after {self.retries + 1} attempts ({last_error}). "
            "Is it running? Start it with: rftgym serve-retriever --corpus <file> --index bm25"
        ) from last_error
