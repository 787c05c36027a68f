"""Reading JSON-lines data files with errors that name the file and line.

Every loader of user data (tasks, corpora, datasets) reads through :func:`read_jsonl`, so a
blank line, a byte-order mark, a non-UTF-8 byte, a broken line or a line that is not an object
are handled, and reported, the same way everywhere.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Iterator

from .errors import DataFormatError


def missing_file(path: Path) -> str:
    """Why ``path`` is not a readable file, in a few words ("no such file", "a directory, not a file")."""
    if path.is_dir():
        return "a directory, not a file"
    return "not a regular file" if path.exists() else "no such file"


def read_jsonl(path: str | Path, shape: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line; ``shape`` says what a line must be
    (e.g. ``"one {question, answer} object per line"``) and ends every error message.
    ``.gz`` files are read through gzip."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"{path}: {missing_file(path)}; expected {shape}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        for number, raw in enumerate(_lines(handle, path), start=1):
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
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{where}: not valid JSON ({exc.msg}); expected {shape}") from exc
            except RecursionError:
                raise DataFormatError(f"{where}: the JSON is nested too deeply to read; expected {shape}") from None
            if not isinstance(record, dict):
                raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}; "
                                      f"expected {shape}")
            yield number, record


def _lines(handle, path: Path) -> Iterator[bytes]:
    """The file's lines; a broken ``.gz`` is a data error, not a traceback."""
    try:
        yield from handle
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataFormatError(f"{path}: not a readable gzip file ({exc or type(exc).__name__}); a .gz name "
                              "needs gzip-compressed JSON lines, other names are read as plain text") from None
