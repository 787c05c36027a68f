"""What the retrieval service reads from a request: its Content-Type, its JSON body and the body's
fields, each refused with a message that says what to send instead."""

from __future__ import annotations

import difflib
import json
from typing import Any

MAX_TOPK = 1000
MAX_RESULTS = 100_000  # queries x topk per request: the reply is built whole in memory
REQUEST_SHAPE = '{"queries": ["..."], "topk": 3, "return_scores": true}'
REQUEST_FIELDS = ("queries", "topk", "return_scores")
# Tools that send a body as written label it so by default (curl -d, urllib): read as JSON too.
LENIENT_TYPES = ("application/x-www-form-urlencoded", "text/plain")


def content_type_problem(headers) -> str | None:
    """Why a request's Content-Type cannot label its JSON body, or None: none given, a JSON type
    (``application/json``, ``application/*+json``), or a default of tools that send a body as
    written (LENIENT_TYPES), in UTF-8."""
    if "Content-Type" not in headers:
        return None
    media = headers.get_content_type()  # lower case; "text/plain" for a value it cannot read
    maintype, _, subtype = media.partition("/")
    if not (maintype == "application" and (subtype == "json" or subtype.endswith("+json"))) \
            and media not in LENIENT_TYPES:
        return (f"the request body is labelled {shown(headers['Content-Type'])}; send it as JSON, "
                f"{REQUEST_SHAPE}, with Content-Type: application/json")
    charset = (headers.get_content_charset() or "utf-8").lower()
    if charset not in ("utf-8", "utf8", "us-ascii", "ascii"):
        return f"the request body is in {shown(charset)}; send it in UTF-8 (Content-Type: application/json)"
    return None


def json_body(raw: bytes, sent_as: str | None) -> Any:
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
        raise ValueError(f"the request body is not JSON{labelled} ({exc}; it begins {shown(raw[:40])}); send the "
                         f"JSON object {REQUEST_SHAPE} with Content-Type: application/json") from None


def shown(value: Any, limit: int = 100, quoted: bool = True) -> str:
    """A client's text (or bytes) for an error message: cut to ``limit`` characters, quoted."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    text = text if len(text) <= limit else text[:limit] + "..."
    return repr(text) if quoted else text


def parse_request(request: Any) -> tuple[list[str], int, bool]:
    if not isinstance(request, dict):
        raise ValueError(f"expected a JSON object {REQUEST_SHAPE}, got {json_kind(request)}")
    for key in request:
        meant = meant_field(key)
        if meant is not None:  # a misspelt "top_k" would otherwise be answered with the default 3 documents
            raise ValueError(f"unknown field {shown(key)} (did you mean \"{meant}\"?); the fields are \"queries\", "
                             f"\"topk\" and \"return_scores\": {REQUEST_SHAPE}")
    queries = request.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError(f'"queries" must be a list of strings, e.g. {REQUEST_SHAPE}')
    topk = request.get("topk")
    topk = 3 if topk is None else topk  # as in Search-R1, where null is the server's default
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f'"topk" must be an int in [1, {MAX_TOPK}], got {shown(json.dumps(topk))}')
    if len(queries) * topk > MAX_RESULTS:
        raise ValueError(f"{len(queries)} queries x topk {topk} is more than {MAX_RESULTS:,} results in one request; "
                         "send fewer queries per request")
    scores = request.get("return_scores", True)
    if not isinstance(scores, bool):
        raise ValueError(f'"return_scores" must be true or false, got {shown(json.dumps(scores))}')
    return queries, topk, scores


# Spellings of the request's fields in other retrieval APIs, too far from ours for a close match.
FIELD_ALIASES = {"k": "topk", "n": "topk", "top_n": "topk", "num_docs": "topk", "q": "queries", "query": "queries", "texts": "queries",
                 "scores": "return_scores", "with_scores": "return_scores"}


def meant_field(key: str) -> str | None:
    """The field an unknown ``key`` is a misspelling of (``top_k``, ``query``, ``return_score``),
    or None for one of ours or an unrelated extra (a request id), which is ignored, as Search-R1's
    server ignores extra fields."""
    if key in REQUEST_FIELDS or not isinstance(key, str):
        return None
    folded = key.lower().replace("-", "_")
    if folded in FIELD_ALIASES:
        return FIELD_ALIASES[folded]
    squeezed = folded.replace("_", "")
    # Close only: a field of another client (query_ids, top_p, return_scores_only) is no misspelling.
    close = difflib.get_close_matches(squeezed, [f.replace("_", "") for f in REQUEST_FIELDS], n=1, cutoff=0.9)
    return None if not close else next(f for f in REQUEST_FIELDS if f.replace("_", "") == close[0])


def json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
