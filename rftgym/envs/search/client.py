"""The client of a retrieval service in Search-R1's ``/retrieve`` shape (such as
:mod:`.server`, ``rftgym serve-retriever``).

:class:`RemoteRetriever` is a :class:`Retriever` whose searches go to the service: one
connection per search (never one held idle between an agent's searches, which would keep a slot
of a shared service busy), a timeout for each attempt as a whole (connecting, sending, the
reply's headers and body: a service trickling bytes cannot stretch it), retries with backoff
that wait out a busy service's ``Retry-After``, a refusal's reason read from its JSON
``{"error": ...}``, and an error saying how to start the service when it is down. What a service sends is cleaned before it can reach an
observation. :func:`check_service_url` validates an env's ``retriever_url``.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

from ...core.errors import ConfigError, RftgymError, warn_caller
from ...core.values import valid_text
from ...core.web import (BodyCutShort, BodyTooLarge, BodyTooSlow, Deadline, NameLookupTooSlow, build_opener,
                         error_body_time, is_loopback, open_within, plain_http_answer, read_body, read_error_body,
                         retry_after_s)
from .corpora import split_flashrag_contents
from .retrievers import Hit, Retriever, _check_search_args

MAX_REPLY_BYTES = 512 * 1024 * 1024  # the longest reply read
MAX_ID_CHARS, MAX_TITLE_CHARS = 200, 500
MAX_ERROR_BYTES = 64 * 1024  # of a refusal's body, read for its reason


class RetrievalServiceError(RftgymError, RuntimeError):
    """The retrieval service is down, timed out or answered in an unexpected shape."""


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


def _error_detail(error: urllib.error.HTTPError, deadline: Deadline) -> str:
    """What a refusal says: the ``error`` of this service's JSON body (or of any service that
    answers so), else the start of the body as text; read by the attempt's ``deadline``, so that
    a body trickled in cannot hold the client."""
    raw = read_error_body(error, error_body_time(deadline), MAX_ERROR_BYTES)
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

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5,
                 serve_command: str = "rftgym serve-retriever --corpus <file> --index bm25"):
        """``timeout``: seconds each attempt may take in all, from connecting to the reply's last
        byte; ``retries``: attempts after the first, the n-th after ``backoff * 2**(n-1)`` s (or a
        busy service's ``Retry-After``, if longer). ``serve_command``: the command that serves the
        corpus this client is for, which a service that cannot be reached is told to start."""
        self.url = check_service_url(url)
        self.serve_command = serve_command
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        # A service on this machine is never reached through an HTTP(S)_PROXY from the environment.
        handlers = [_NoRedirect()] + ([urllib.request.ProxyHandler({})]
                                      if is_loopback(urllib.parse.urlsplit(self.url).hostname) else [])
        self._opener = build_opener(*handlers)  # connections that a request's deadline can shut

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
            warn_caller(
                f"the retrieval service at {self.url} returned {what} of the env's documents (by id, title or text) "
                f"when asked for {len(sample)} of them: it indexes another corpus than {source}, so searches cannot "
                "find the documents that hold the answers. Serve the env's corpus (rftgym serve-retriever --corpus "
                "FILE, or --world-seed N --world-size N for the generated world), or give as dataset_path the "
                "questions of the corpus the service indexes.",
                RuntimeWarning)

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
            deadline = Deadline(self.timeout)
            try:
                with open_within(self._opener, request, deadline) as response:
                    raw = self._read(response, deadline)
            except urllib.error.HTTPError as exc:
                with exc:
                    detail = _error_detail(exc, deadline)
                if 300 <= exc.code < 400:
                    raise RetrievalServiceError(
                        f"{self.url} answered with a redirect ({exc.code}) to {exc.headers.get('Location')!r}, which "
                        "is not followed; give the service's own URL as retriever_url") from None
                if exc.code < 500 and exc.code not in (408, 429):  # the request is wrong: asking again won't help
                    raise RetrievalServiceError(f"{self.url} rejected the request ({exc.code}): {detail}") from None
                last_error = f"it failed with HTTP {exc.code}: {detail[:300]}"
                wait_at_least = retry_after_s(exc.headers) or 0.0
                continue
            except NameLookupTooSlow as exc:  # the resolver, not the service: the message says what to check
                last_error = str(exc)
                continue
            except (BodyTooSlow, TimeoutError):  # the body, or what came before it (RequestTooSlow), or one read
                last_error = (f"the reply took over {self.timeout:g} s to arrive; for a service that is slow rather "
                              "than down, raise retriever_timeout_s (--env-arg retriever_timeout_s=60)")
                continue
            except BodyCutShort as exc:
                last_error = str(exc)
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                if self.url.startswith("https:") and plain_http_answer(reason):  # no retry mends that
                    raise RetrievalServiceError(f"{self.url}: the service does not speak TLS ({reason}); if it "
                                                "serves plain HTTP, give an http:// retriever_url") from None
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
            f"(last: {last_error}). Is it running and healthy? Start one with: {self.serve_command}") from None

    def _read(self, response, deadline: Deadline) -> bytes:
        """The body, by the attempt's ``deadline`` and at most MAX_REPLY_BYTES."""
        try:
            return read_body(response, deadline.left(), MAX_REPLY_BYTES)
        except BodyTooLarge:
            raise RetrievalServiceError(f"{self.url} sent a reply of over {MAX_REPLY_BYTES >> 20} MiB; lower "
                                        "top_k or the number of queries per search") from None


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
