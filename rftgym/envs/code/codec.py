"""A small type-tagged JSON codec for values returned by code under test, and their comparison.

Values are encoded *inside* the sandbox (the encoder's source, :data:`ENCODER_SOURCE`, is pasted
into every harness program) and decoded and compared on the host, so that expected outputs never
enter the sandbox and a returned object cannot fake equality with a custom ``__eq__``.

Encoding: ``["i", 3]``, ``["f", 0.5]`` (``"nan"``, ``"inf"``, ``"-inf"`` as strings), ``["s", "x"]``,
``["b", true]``, ``["n"]``, ``["l", [...]]``, ``["t", [...]]``, ``["d", [[k, v], ...]]``,
``["set", [...]]``, ``["fs", [...]]``, and ``["r", "repr(x)"]`` for anything else. Subclasses of
the builtin types encode as their base type (a namedtuple is a tuple, a Counter a dict), as
Python's ``==`` would treat them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ...core.values import valid_text

# Runs inside the sandbox (stdlib only) and on the host; keep it self-contained.
ENCODER_SOURCE = r'''
def _rft_encode(value, depth=0):
    if depth > 60:
        return ["r", "<too deep>"]
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", bool(value)]
    if isinstance(value, int):
        return ["i", int.__int__(value)]
    if isinstance(value, float):
        value = float.__float__(value)
        if value != value:
            return ["f", "nan"]
        if value in (float("inf"), float("-inf")):
            return ["f", "inf" if value > 0 else "-inf"]
        return ["f", value]
    if isinstance(value, str):
        return ["s", str.__str__(value)]
    if isinstance(value, list):
        return ["l", [_rft_encode(v, depth + 1) for v in list.__iter__(value)]]
    if isinstance(value, tuple):
        return ["t", [_rft_encode(v, depth + 1) for v in tuple.__iter__(value)]]
    if isinstance(value, dict):
        return ["d", [[_rft_encode(k, depth + 1), _rft_encode(v, depth + 1)] for k, v in dict.items(value)]]
    if isinstance(value, frozenset):
        return ["fs", [_rft_encode(v, depth + 1) for v in frozenset.__iter__(value)]]
    if isinstance(value, set):
        return ["set", [_rft_encode(v, depth + 1) for v in set.__iter__(value)]]
    try:
        text = repr(value)
    except BaseException as exc:
        text = "<unrepresentable %s>" % type(exc).__name__
    return ["r", str(text)[:10000]]


def _rft_dumps(value):
    import json
    return json.dumps(_rft_encode(value), allow_nan=False, separators=(",", ":"))
'''

_namespace: dict[str, Any] = {}
exec(compile(ENCODER_SOURCE, "<rftgym-encoder>", "exec"), _namespace)  # our own source, see above


def encode(value: Any) -> str:
    """The JSON text of ``value`` under the type-tagged encoding (what the sandbox reports)."""
    return _namespace["_rft_dumps"](value)


@dataclass(frozen=True)
class Opaque:
    """A value that had no JSON form; it equals only an Opaque with the same repr."""

    text: str

    def __repr__(self) -> str:
        return self.text


def decode(text: str) -> Any:
    """Inverse of :func:`encode` (``["r", ...]`` becomes :class:`Opaque`)."""
    return _from_tagged(json.loads(text))


def _from_tagged(node: Any) -> Any:
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise ValueError(f"not a tagged value: {node!r}")
    tag = node[0]
    if tag == "n":
        return None
    if tag in ("i", "b", "s"):
        return node[1]
    if tag == "f":
        return float(node[1])
    if tag == "l":
        return [_from_tagged(v) for v in node[1]]
    if tag == "t":
        return tuple(_from_tagged(v) for v in node[1])
    if tag == "d":
        pairs = [(_hashable(_from_tagged(k)), _from_tagged(v)) for k, v in node[1]]
        _check_hashes([key for key, _ in pairs])
        return dict(pairs)
    if tag in ("set", "fs"):
        members = [_hashable(_from_tagged(v)) for v in node[1]]
        _check_hashes(members)
        return set(members) if tag == "set" else frozenset(members)
    if tag == "r":
        return Opaque(node[1])
    raise ValueError(f"unknown tag {tag!r}")


# Distinct members that share a hash cost a set or dict quadratic time to build. Values reported by
# code under test can be made to (ints that are multiples of 2**61 - 1 all hash to 0), which would
# stall the host for minutes; honest outputs share a hash rarely (hash(-1) == hash(-2)).
MAX_SHARED_HASHES = 64


def _check_hashes(members: list) -> None:
    hashes = [hash(member) for member in members]
    if len(hashes) - len(set(hashes)) > MAX_SHARED_HASHES:
        raise ValueError(f"a set or dict of {len(hashes)} members of which over {MAX_SHARED_HASHES} share hashes")


def _hashable(value: Any) -> Any:
    # A dict key or set member decoded as a list can only come from a tampered stream.
    return Opaque(repr(value)) if isinstance(value, (list, dict, set)) else value


FLOAT_TOLERANCE = 1e-6


def values_equal(expected: Any, got: Any, tol: float = FLOAT_TOLERANCE) -> bool:
    """Python's ``==`` on decoded values, except that an expected float is matched within ``tol``
    (absolute or relative, like HumanEval's ``abs(a - b) < 1e-6``) and nan equals nan. An expected
    int is matched exactly, as HumanEval's ``==`` does: 55.0 matches 55, 55.00003 does not."""
    if isinstance(expected, float) or isinstance(got, float):
        if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
            if not isinstance(expected, float):
                return expected == got  # int against float: exact, and without overflow
            try:
                a, b = float(expected), float(got)
            except OverflowError:  # an int too big for a float is no float's match
                return False
            if math.isnan(a) or math.isnan(b):
                return math.isnan(a) and math.isnan(b)
            if math.isinf(a) or math.isinf(b):
                return a == b
            return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
        return False
    if isinstance(expected, (list, tuple)) or isinstance(got, (list, tuple)):
        # list != tuple, as in Python.
        if type(expected) is not type(got) or len(expected) != len(got):
            return False
        return all(values_equal(a, b, tol) for a, b in zip(expected, got))
    if isinstance(expected, dict) or isinstance(got, dict):
        if not (isinstance(expected, dict) and isinstance(got, dict)) or expected.keys() != got.keys():
            return False
        return all(values_equal(expected[k], got[k], tol) for k in expected)
    if isinstance(expected, (set, frozenset)) or isinstance(got, (set, frozenset)):
        return isinstance(expected, (set, frozenset)) and isinstance(got, (set, frozenset)) and expected == got
    if isinstance(expected, Opaque) or isinstance(got, Opaque):
        return expected == got
    return type(expected) in (int, bool, str, type(None)) and expected == got


# How a task's outputs compare (CodeTask.compare_as): "exact" is values_equal; the others relax
# only a returned list or tuple (and, for the unordered two, a set), as the dataset's own asserts
# do ("sequence": tuple(f(x)) == tuple(y); "multiset": sorted(f(x)) == sorted(y); "set":
# set(f(x)) == set(y)) or as a reference whose order comes from a set's iteration needs.
COMPARISONS = ("exact", "sequence", "multiset", "set")
_MATCHED_BY_SEARCH = 300  # unordered outputs longer than this must match exactly (repr for repr), in O(n)


def equal_as(expected: Any, got: Any, how: str, tol: float = FLOAT_TOLERANCE) -> bool:
    """:func:`values_equal`, with a returned collection compared as ``how`` (see :data:`COMPARISONS`)."""
    if how == "exact":
        return values_equal(expected, got, tol)
    collections = (list, tuple) if how == "sequence" else (list, tuple, set, frozenset)
    if not (isinstance(expected, collections) and isinstance(got, collections)):
        return values_equal(expected, got, tol)
    if how == "sequence":
        return len(expected) == len(got) and all(values_equal(a, b, tol) for a, b in zip(expected, got))
    expected, got = list(expected), list(got)
    if len(expected) == len(got) and all(values_equal(a, b, tol) for a, b in zip(expected, got)):
        return True  # in the same order (what exact comparison accepts is accepted here, at any length)
    # Items alike in their type-tagged encoding are equal (no repr: an object's may read as "5").
    same = _encodings(expected), _encodings(got)
    if how == "set":
        if None not in same and set(same[0]) == set(same[1]):
            return True
        if max(len(expected), len(got)) > _MATCHED_BY_SEARCH:
            return False
        return (all(any(values_equal(e, g, tol) for g in got) for e in expected)
                and all(any(values_equal(e, g, tol) for e in expected) for g in got))
    if len(expected) != len(got):
        return False
    if None not in same and sorted(same[0]) == sorted(same[1]):
        return True
    if len(expected) > _MATCHED_BY_SEARCH:
        return False
    unmatched = list(got)   # each expected item takes one item of got that it matches
    for item in expected:
        match = next((i for i, candidate in enumerate(unmatched) if values_equal(item, candidate, tol)), None)
        if match is None:
            return False
        del unmatched[match]
    return True


def _encodings(items: list) -> list[str] | None:
    try:
        return [encode(item) for item in items]
    except (ValueError, TypeError, RecursionError, OverflowError):
        return None


def encoded_equal(expected: str, got: str | None, tol: float = FLOAT_TOLERANCE, how: str = "exact") -> bool:
    """Compare two encodings (as ``how``: see :data:`COMPARISONS`); a missing or undecodable
    ``got`` never matches."""
    if got is None:
        return False
    try:
        return equal_as(decode(expected), decode(got), how, tol)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError):
        return False


def normalize_stdout(text: str) -> str:
    """Stdout as compared: line endings unified, trailing spaces and trailing blank lines dropped."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).rstrip("\n")


def stdout_equal(expected: str, got: str | None) -> bool:
    return got is not None and normalize_stdout(expected) == normalize_stdout(got)


def display(encoded: str | None, limit: int = 200) -> str:
    """A short human-readable form of an encoded value (for info dicts and prompts)."""
    if encoded is None:
        return "<none>"
    try:
        text = repr(decode(encoded))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError):
        text = encoded
    text = valid_text(text)  # a string the code returned may hold lone surrogates
    return text if len(text) <= limit else text[: limit - 3] + "..."
