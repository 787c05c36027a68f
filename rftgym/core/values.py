"""What counts as an integer or a number in a config, an option or an env's info.

Python's ``bool`` is an ``int`` (``True == 1``), so a flag given where a count or a score belongs
would pass a plain ``isinstance`` check; numpy's integers and floats, which data pipelines and
seeded generators hand around, should pass. These two predicates say both once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Set as AbstractSet

import numpy as np


def a_type(value) -> str:
    """``value``'s type with its article, for a message: ``an int``, ``a dict``."""
    name = type(value).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def is_int(value) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def int_tuple(value) -> tuple[int, ...]:
    """An int, a decimal string (``--env-arg hops=2``) or a sequence of them, as a tuple of ints;
    TypeError for anything else: ``int()`` alone would turn 1.5 or True quietly into 1, and
    iterating would read a dict's keys, a bytes' byte values or a set in no set order."""
    if isinstance(value, (bytes, bytearray, memoryview, Mapping, AbstractSet)):
        raise TypeError(f"not integers: {value!r} (give an int or a list of ints)")
    items = (value,) if isinstance(value, (str, numbers.Integral)) else value
    items = tuple(items)  # TypeError for what is not iterable
    if not all(is_int(v) or (isinstance(v, str) and v.strip().isdecimal()) for v in items):
        raise TypeError(f"not integers: {value!r}")
    return tuple(int(v) for v in items)


def is_finite_real(value) -> bool:
    """A real number, Python's or numpy's (integers too), not a bool, and neither NaN nor infinite
    (nor an integer too large for a float, e.g. 10**400)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def valid_text(text: str) -> str:
    """``text`` with lone surrogates (valid in JSON and in Python strings, not in UTF-8: no
    tokenizer, encoder or file takes them) replaced by U+FFFD."""
    if text.isascii():  # the common case, and the cheapest test
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def checked_megabytes(value, name: str, zero_means: str) -> float:
    """``value`` as a float number of megabytes, 0 or more; else a ConfigError that names it as
    ``name`` (a field, or the flag that gave it) and says what 0 means."""
    from .errors import ConfigError

    if not is_finite_real(value) or value < 0:
        raise ConfigError(f"{name} must be a number of megabytes, 0 or more (0 {zero_means}), got {value!r}",
                          field=name.lstrip("-").replace("-", "_"))
    return float(value)
