"""JSONL records read on demand (mimo.data.record_file): the same records as parsing the file whole,
blank lines and CRLF endings, a line that is not JSON as a bad record under skip and error."""

import copy
import json
import os

import pytest

from mimo.config import load_config
from test_llava_data import HELLO, RED, llava_raw, sample_dir  # noqa: F401 (fixture)


def test_jsonl_records_read_on_demand_are_the_parsed_lines(tmp_path):
    from mimo.data.record_file import JsonLines, read_records
    from mimo.data.record_index import file_digest

    records = [dict(HELLO, id=f"r{i}", n=i, text="é ✓ " * i) for i in range(50)]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    path = tmp_path / "r.jsonl"
    # blank lines (also of spaces) are not records; CRLF and LF endings mix; no newline at the end
    path.write_bytes("\n".join(lines[:10]).encode() + b"\n\n   \n" + "\r\n".join(lines[10:]).encode())
    got, digest = read_records(str(path))
    assert digest == file_digest(str(path))  # the file's bytes, blank lines and line endings included
    assert isinstance(got, JsonLines) and len(got) == 50
    assert [got[i] for i in range(50)] == records
    assert got[-1] == records[-1] and list(got)[7] == records[7]
    copied = copy.copy(got)  # its own descriptor: deleting one never closes the other's
    del got
    assert copied[3] == records[3]
    listed = tmp_path / "r.json"
    listed.write_text(" \n" + json.dumps(records))
    assert read_records(str(listed)) == (records, file_digest(str(listed)))  # a JSON list: parsed whole
    bom = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors write: a list stays a list
    listed.write_bytes(bom + b"[\n" + ",\n".join(json.dumps(r) for r in records[:3]).encode() + b"\n]\n")
    assert read_records(str(listed))[0] == records[:3]
    path.write_bytes(bom + "\n".join(lines[:3]).encode())
    assert list(read_records(str(path))[0]) == records[:3]
    for empty in ("", "\n \n"):
        path.write_text(empty)
        with pytest.raises(Exception, match="holds no record"):
            read_records(str(path))


def _raw_with_broken_line(sample_dir, tmp_path, on_bad):  # noqa: F811
    img = os.path.join(sample_dir, "images", "img0000.png")
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join([json.dumps(dict(RED, id="good1", image=img)), '{"id": "cut", "conversations": [',
                               json.dumps(dict(HELLO, id="good2"))]))
    raw = llava_raw(sample_dir, str(path), shuffle=False, packing=False, on_bad_record=on_bad)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    return raw


def test_a_line_that_is_not_json_is_a_bad_record(sample_dir, tmp_path, capfd):  # noqa: F811
    from mimo.data import build_dataset
    from mimo.data.llava import DataError

    ds = build_dataset(load_config(_raw_with_broken_line(sample_dir, tmp_path, "skip")))
    assert [ds.plan(s).record_ids for s in range(3)] == [[["good1"]], [["good2"]], [["good1"]]]
    assert ds.plan(1).skipped_samples == 1
    err = capfd.readouterr().err
    assert "warning: data: skipping record '#1': line 2 of" in err and "is not valid JSON" in err
    ds = build_dataset(load_config(_raw_with_broken_line(sample_dir, tmp_path, "error")))
    ds.plan(0)
    with pytest.raises(DataError, match=r"error: data.path: record '#1': line 2 of .* is not valid JSON"):
        ds.plan(1)


def test_a_file_that_is_one_json_object_is_not_records(tmp_path):
    from mimo.data.llava import DataError
    from mimo.data.record_file import read_records

    record = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yes"}]}
    for name, text in (("one_line.json", json.dumps({"records": [record]})),
                       ("pretty.json", json.dumps({"records": [record], "version": 2}, indent=2)),
                       # a line of it (`"train"`) is JSON alone, but no line is an object: not JSONL
                       ("strings.json", json.dumps({"records": [record], "splits": ["train"]}, indent=2))):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(DataError) as exc:
            read_records(str(path))
        assert str(exc.value).startswith(f"error: data.path: {path}: one JSON object ({{'records'")
        assert str(exc.value).endswith("not records: give a JSON list of records, or JSONL (one record per line)")
    one = tmp_path / "one.jsonl"  # a file of one record is records
    one.write_text(json.dumps(record))
    assert list(read_records(str(one))[0]) == [record]


def test_a_long_first_line_or_bad_first_lines_never_read_the_file_whole(tmp_path, monkeypatch):
    """Only a file that may be one JSON object (one line, or first lines none of which is JSON alone) is
    parsed whole to say so; a JSONL file whose first line is long (over the 4 KiB first read) or bad is not.
    Lines nested deeper than Python's parser goes are bad records, not a crash."""
    from mimo.data import record_file
    from mimo.data.llava import BadRecord

    def whole(path):
        raise AssertionError(f"{path} parsed whole")

    monkeypatch.setattr(record_file, "_refuse_one_object", whole)
    long_first = dict(HELLO, id="long", text="x" * 6000)
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [long_first, HELLO, HELLO]))
    assert record_file.read_records(str(path))[0][0] == long_first
    path.write_text("\n".join(['{"cut": ', "[" * 100_000 + "]" * 100_000, json.dumps(HELLO)]))
    records = record_file.read_records(str(path))[0]
    with pytest.raises(BadRecord, match="line 2 of .*: JSON nested too deep to read"):
        records[1]
    assert records[2] == HELLO
    path.write_text("{\n" + '  "records": []\n' + "}\n")  # pretty-printed: parsed whole to say what it is
    with pytest.raises(AssertionError, match="parsed whole"):
        record_file.read_records(str(path))
