"""The shared JSON and JSON-lines readers' messages for paths and contents they cannot read."""

from __future__ import annotations

import gzip
import os
import threading

import pytest

from rftgym.core.errors import DataFormatError
from rftgym.core.jsonl import is_jsonl, read_json, read_jsonl


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


@pytest.mark.parametrize("read", [read_json, lambda path, shape: list(read_jsonl(path, shape))])
def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path, read):
    fifo = tmp_path / "data.json"
    os.mkfifo(fifo)
    # Were the pipe opened, this writer would end the wait (an empty read, then another error).
    writer = threading.Timer(5.0, lambda: os.close(os.open(fifo, os.O_WRONLY)))
    writer.start()
    try:
        with pytest.raises(DataFormatError, match="data.json: not a regular file"):
            read(fifo, "one object")
    finally:
        writer.cancel()
        if writer.is_alive():
            writer.join()


@pytest.mark.parametrize("read", [read_json, lambda path, shape: list(read_jsonl(path, shape))])
def test_unreadable_paths_are_data_errors(tmp_path, read):
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    with pytest.raises(DataFormatError, match="a.json: a symbolic link that leads to no file; expected x"):
        read(tmp_path / "a.json", "x")
    with pytest.raises(DataFormatError, match="cannot be read"):
        read(tmp_path / ("n" * 300 + ".json"), "x")  # longer than a file name may be
    (tmp_path / "file").write_text("{}")
    with pytest.raises(DataFormatError, match="no such file"):
        read(tmp_path / "file" / "inner.json", "x")
    with pytest.raises(DataFormatError, match=r"~/nowhere.json: no such file \('~' and '\$VAR' are not expanded"):
        read("~/nowhere.json", "x")
    if os.path.exists("/proc/self/mem"):  # a file whose read fails (EIO)
        with pytest.raises(DataFormatError, match="/proc/self/mem: cannot be read"):
            read("/proc/self/mem", "x")


def test_an_empty_json_file_is_named_as_empty_not_cut_short(tmp_path):
    for text in ("", "  \n"):
        (tmp_path / "empty.json").write_text(text)
        with pytest.raises(DataFormatError, match=r"empty.json: the file is empty; expected x$"):
            read_json(tmp_path / "empty.json", "x")


def test_an_integer_too_long_to_read_is_a_data_error(tmp_path):
    (tmp_path / "big.jsonl").write_text('{"a": ' + "9" * 5000 + "}\n")
    with pytest.raises(DataFormatError, match="big.jsonl:1: a value cannot be read .*4300 digits"):
        list(read_jsonl(tmp_path / "big.jsonl", "x"))
    (tmp_path / "big.json").write_text("[" + "9" * 5000 + "]")
    with pytest.raises(DataFormatError, match="big.json: a value cannot be read"):
        read_json(tmp_path / "big.json", "x")


def test_read_json_takes_a_byte_order_mark_and_gzip_and_names_json_lines(tmp_path):
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + b'{"a": [1]}')
    assert read_json(tmp_path / "bom.json", "x") == {"a": [1]}
    (tmp_path / "z.json.gz").write_bytes(gzip.compress(b'[{"a": 1}]'))
    assert read_json(tmp_path / "z.json.gz", "x") == [{"a": 1}]
    (tmp_path / "unnamed.json").write_bytes(gzip.compress(b'[{"a": 2}]'))  # gzip without the name: by its bytes
    assert read_json(tmp_path / "unnamed.json", "x") == [{"a": 2}]
    (tmp_path / "unnamed.jsonl").write_bytes(gzip.compress(b'{"a": 3}\n'))
    assert [r for _, r in read_jsonl(tmp_path / "unnamed.jsonl", "x")] == [{"a": 3}]
    (tmp_path / "lines.json").write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(DataFormatError, match=r"holds more than one JSON value .* name ends in .jsonl \(or .jsonl.gz\); expected x"):
        read_json(tmp_path / "lines.json", "x")
    (tmp_path / "broken.json").write_text('{"a": 1,\n "b": }')
    with pytest.raises(DataFormatError, match=r"broken.json: not valid JSON \(Expecting value, line 2 column 7\)"):
        read_json(tmp_path / "broken.json", "x")


def test_json_lines_are_known_by_name():
    assert is_jsonl("a.jsonl") and is_jsonl("a.jsonl.gz") and is_jsonl("dir.v2/A.JSONL")
    assert not is_jsonl("a.json") and not is_jsonl("a.json.gz") and not is_jsonl("a.gz") and not is_jsonl("jsonl")
