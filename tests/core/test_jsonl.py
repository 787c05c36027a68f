"""The shared JSONL reader's messages for paths that are not files."""

from __future__ import annotations

import gzip

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


def test_a_device_a_broken_gzip_and_deep_nesting_are_named(tmp_path):
    with pytest.raises(DataFormatError, match="/dev/null: not a regular file"):
        list(read_jsonl("/dev/null", "one object per line"))
    (tmp_path / "plain.jsonl.gz").write_text('{"a": 1}\n')
    with pytest.raises(DataFormatError, match=r"plain.jsonl.gz: not a readable gzip file .*read as plain text"):
        list(read_jsonl(tmp_path / "plain.jsonl.gz", "one object per line"))
    whole = gzip.compress(b'{"a": 1}\n{"a": 2}\n')
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:-6])
    with pytest.raises(DataFormatError, match="cut.jsonl.gz: not a readable gzip file"):
        list(read_jsonl(tmp_path / "cut.jsonl.gz", "one object per line"))
    (tmp_path / "ok.jsonl.gz").write_bytes(whole)
    assert [r for _, r in read_jsonl(tmp_path / "ok.jsonl.gz", "x")] == [{"a": 1}, {"a": 2}]
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataFormatError, match="deep.jsonl:1: the JSON is nested too deeply"):
        list(read_jsonl(tmp_path / "deep.jsonl", "one object per line"))
