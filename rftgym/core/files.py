"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import os
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a sibling file renamed over it: a failure or a kill while
    writing leaves the old file whole (and no sibling behind, short of a kill). OSError as raised."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
