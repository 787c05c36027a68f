"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import os
from pathlib import Path


def unexpanded_path(path: str | os.PathLike) -> str | None:
    """Why ``path``, a place to write, reads as the shell left it: a leading ``~`` (which the shell
    does not expand after ``=``, as in ``--out=~/x``, nor inside quotes) or a ``$VAR``, which would
    make a directory of that very name; None when it reads as given."""
    text = os.fspath(path)
    if text.startswith("~"):
        return (f"{text!r} starts with '~', which nothing expanded (a shell does not after '=' or inside "
                "quotes): give the full path")
    if "$" in text and any(part.startswith("$") for part in Path(text).parts):
        return f"{text!r} holds a '$' variable that nothing expanded: give the path the shell would"
    return None


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a sibling file renamed over it: a failure or a kill while
    writing leaves the old file whole (and no sibling behind, short of a kill). OSError as raised."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def drop_unfinished_line(path: Path, block: int = 1 << 16) -> bool:
    """Truncate ``path`` after its last line end, when what follows it is a line cut short (its
    writer stopped mid-line); True if it did. Reads from the end, a block at a time: the usual
    file, whose last byte is a line end, costs one byte however large it is."""
    with open(path, "rb+") as handle:
        end = handle.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - block)
            handle.seek(start)
            found = handle.read(position - start).rfind(b"\n")
            if found >= 0:
                whole = start + found + 1
                break
            position = start
        else:
            whole = 0
        if whole == end:
            return False
        handle.truncate(whole)
        return True
