"""The shared JSONL reader's messages for paths that are not files."""

from __future__ import annotations

import pytest

from rftgym.core.errors import DataFormatError
from rftgym.core.jsonl import read_jsonl


def test_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(DataFormatError, match="a directory, not a file; expected one object per line"):
        list(read_jsonl(tmp_path, "one object per line"))
    with pytest.raises(DataFormatError, match="no such file"):
        list(read_jsonl(tmp_path / "missing.jsonl", "one object per line"))
    (tmp_path / "ok.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n')
    assert list(read_jsonl(tmp_path / "ok.jsonl", "one object per line")) == [(1, {"a": 1}), (3, {"a": 2})]
