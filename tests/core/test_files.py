"""core/files.py: a line cut short at a file's end is dropped, whatever its length."""

from __future__ import annotations

import pytest

from rftgym.core.files import drop_unfinished_line


@pytest.mark.parametrize("content, kept", [
    (b"a\nb\n", b"a\nb\n"),                  # whole lines: left as they are
    (b"a\nb\nhalf", b"a\nb\n"),              # the cut last line goes
    (b"half", b""),                          # a file of one cut line is emptied
    (b"", b""),
    (b"a\n" + b"x" * 10, b"a\n"),            # a cut line longer than the block read at a time
    (b"a\n" * 3 + b"x" * 25, b"a\n" * 3),
])
def test_an_unfinished_last_line_is_dropped(tmp_path, content, kept):
    path = tmp_path / "episodes.jsonl"
    path.write_bytes(content)
    assert drop_unfinished_line(path, block=4) is (kept != content)
    assert path.read_bytes() == kept
