"""Reading JSON and JSON-lines data files with errors that name the file and line.

Every loader of user data (tasks, corpora, datasets) reads through :func:`read_jsonl` or
:func:`read_json`, so a blank line, a byte-order mark, a non-UTF-8 byte, gzip compression, a
broken line, a line that is not an object, and a path that is not a readable regular file are
handled, and reported, the same way everywhere.
"""

from __future__ import annotations

import gzip
import json
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import DataFormatError


def missing_file(path: Path) -> str:
    """Why ``path`` is not a readable file, in a few words ("no such file", "a directory, not a file")."""
    try:
        if path.is_dir():
            return "a directory, not a file"
        if path.exists():
            return "not a regular file (a device, pipe or socket)"
        if path.is_symlink():
            return "a symbolic link that leads to no file"
        unexpanded = str(path).startswith("~") or "$" in str(path)
        return "no such file" + (" ('~' and '$VAR' are not expanded here; give the path the shell would)"
                                 if unexpanded else "")
    except OSError as exc:  # e.g. a name too long, a symbolic-link loop
        return f"cannot be read ({exc.strerror or exc})"


def is_jsonl(path: str | Path) -> bool:
    """Whether ``path`` names a JSON-lines file (``.jsonl``, or ``.jsonl.gz`` compressed), by its name."""
    suffixes = [s.lower() for s in Path(path).suffixes[-2:]]
    return suffixes[-1:] == [".jsonl"] or suffixes == [".jsonl", ".gz"]


GZIP_MAGIC = b"\x1f\x8b"


def _open(path: Path, shape: str):
    """``path`` opened for reading bytes (through gzip for a ``.gz`` name), or a data error that says why
    it cannot be: only a regular file is read, since a pipe or a device could block forever."""
    try:
        regular = path.is_file()
    except OSError:
        regular = False
    if not regular:
        raise DataFormatError(f"{path}: {missing_file(path)}; expected {shape}")
    try:
        # Compressed whatever its name: gzip's magic bytes (a .gz name is read as gzip in any case,
        # so that one which is not says so).
        with open(path, "rb") as probe:
            compressed = path.suffix.lower() == ".gz" or probe.read(2) == GZIP_MAGIC
        return gzip.open(path, "rb") if compressed else open(path, "rb")
    except OSError as exc:
        raise DataFormatError(f"{path}: cannot be read ({exc.strerror or exc}); expected {shape}") from None


def _runs_past_the_line(exc: Exception) -> bool:
    """Whether :func:`json.loads` refused the text because it ended inside a value (a string left
    open runs to the end of the text as well): cut short, or continued on the next line."""
    return isinstance(exc, json.JSONDecodeError) and (exc.pos >= len(exc.doc.rstrip())
                                                      or exc.msg.startswith("Unterminated string"))


def _decode_error(where: str, exc: Exception, shape: str) -> DataFormatError:
    """The data error for JSON text that :func:`json.loads` refused at ``where``."""
    if isinstance(exc, RecursionError):
        return DataFormatError(f"{where}: the JSON is nested too deeply to read; expected {shape}")
    if isinstance(exc, json.JSONDecodeError):
        at = f"column {exc.colno}" if exc.lineno == 1 else f"line {exc.lineno} column {exc.colno}"
        ends_early = _runs_past_the_line(exc)
        cut = "; the text ends before its JSON does (cut short, e.g. by an interrupted write?)" if ends_early else ""
        return DataFormatError(f"{where}: not valid JSON ({exc.msg}, {at}){cut}; expected {shape}")
    # ValueError: an integer past Python's limit on digits converted from text.
    return DataFormatError(f"{where}: a value cannot be read ({exc}); expected {shape}")


def read_json(path: str | Path, shape: str):
    """The one JSON value in ``path`` (``.gz`` read through gzip; a byte-order mark is skipped);
    ``shape`` says what it must be and ends every error message."""
    path = Path(path)
    with _open(path, shape) as handle, _reading(path):
        data = handle.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"{path}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from exc
    del data  # a large corpus: not twice in memory while it is parsed
    if not text.strip():  # (not a value cut short: there is none)
        raise DataFormatError(f"{path}: the file is empty; expected {shape}")
    try:
        return json.loads(text)
    except (RecursionError, ValueError) as exc:  # JSONDecodeError is a ValueError
        if isinstance(exc, json.JSONDecodeError) and exc.msg == "Extra data" and text.lstrip().startswith("{"):
            raise DataFormatError(f"{path}: holds more than one JSON value (JSON lines?); a JSON-lines file is "
                                  f"read as such when its name ends in .jsonl (or .jsonl.gz); expected {shape}"
                                  ) from None
        raise _decode_error(str(path), exc, shape) from None


def read_jsonl(path: str | Path, shape: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line; ``shape`` says what a line must be
    (e.g. ``"one {question, answer} object per line"``) and ends every error message.
    ``.gz`` files are read through gzip."""
    path = Path(path)
    with _open(path, shape) as handle:
        lines = _lines(handle, path)
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                # utf-8-sig on the first line: files saved by some editors start with a BOM.
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataFormatError(f"{where}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (RecursionError, ValueError) as exc:
                following = next((more for more in lines if more.strip()), None) if _runs_past_the_line(exc) else None
                # A record's line cut short, the next record starting at its own line's start (a pretty-
                # printed file's next line is "{" after "[", or indented):
                if following is not None and following.startswith(b"{") and line.strip().startswith("{") \
                        and line.strip() != "{":
                    raise DataFormatError(f"{where}: not valid JSON ({exc.msg}); the line ends before its object "
                                          f"does (a missing closing '}}', ']' or '\"'?); expected {shape}") from None
                if following is not None:
                    raise DataFormatError(f"{where}: the JSON value goes on past the end of the line, and JSON "
                                          "lines holds each object whole on one line (is this a JSON file, e.g. a "
                                          f"pretty-printed list, or an object split over lines?); expected {shape}"
                                          ) from None
                raise _decode_error(where, exc, shape) from None
            if not isinstance(record, dict):
                listed = " (a JSON list: JSON lines holds each object on a line of its own, not in a list)" \
                    if isinstance(record, list) and record and all(isinstance(r, dict) for r in record) else ""
                raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}{listed}; "
                                      f"expected {shape}")
            yield number, record


def _lines(handle, path: Path) -> Iterator[bytes]:
    with _reading(path):
        yield from handle


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A broken ``.gz`` or a failed read of ``path`` as a data error, not a traceback."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataFormatError(f"{path}: not a readable gzip file ({exc or type(exc).__name__}); a .gz name "
                              "needs gzip-compressed JSON, other names are read as plain text") from None
    except OSError as exc:
        raise DataFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
