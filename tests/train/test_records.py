"""Records from every format, through ``datasets`` and through the standard library, and the
sentence (with the line) for a record that lacks its file's fields."""

from __future__ import annotations

import json
import sys

import pytest

from memfit.train import records as records_module
from memfit.train.records import Record, read_records
from memfit.workload import WorkloadError

CHAT = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]


@pytest.fixture(params=["datasets", "stdlib"])
def reader(request, monkeypatch):
    """Read through ``datasets`` (when installed) or with the standard library alone."""
    if request.param == "datasets":
        pytest.importorskip("datasets")
    else:
        monkeypatch.setattr(records_module, "_rows_through_datasets", lambda path, kind: None)
    return request.param


def _jsonl(path, rows, blank_after=()):
    lines = []
    for i, row in enumerate(rows):
        lines.append(json.dumps(row))
        if i in blank_after:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_text_chat_and_prompt_completion(tmp_path, reader):
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "one"}, {"text": ""}, {"text": "two", "id": 3}])
    chat = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[::-1] + CHAT[1:]}])
    pc = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    got = read_records([text, chat, pc])
    assert [r.kind for r in got] == ["text", "text", "chat", "chat", "prompt"]
    assert [r.text for r in got[:2]] == ["one", "two"]  # the empty text is skipped
    assert got[2].messages == tuple(CHAT)
    assert got[4].prompt == "2+2?" and got[4].completion == "4"
    assert got[1].where == f"data file {str(text)!r} line 3"


def test_conversational_prompt_completion_is_a_chat(tmp_path, reader):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": CHAT[:1], "completion": CHAT[1:]}])
    (record,) = read_records([path])
    assert record.kind == "chat" and record.messages == tuple(CHAT)


def test_json_csv_txt_and_text_field(tmp_path, reader):
    js = tmp_path / "a.json"
    js.write_text(json.dumps([{"body": "alpha"}, {"body": "beta"}]))
    assert [r.text for r in read_records([js], text_field="body")] == ["alpha", "beta"]
    csv_text = tmp_path / "b.csv"
    csv_text.write_text('id,text\n1,"first, row"\n2,\n3,42\n')
    assert [r.text for r in read_records([csv_text])] == ["first, row", "42"]
    csv_first = tmp_path / "c.csv"
    csv_first.write_text("body,label\nalpha,1\nbeta,0\n")
    assert [r.text for r in read_records([csv_first])] == ["alpha", "beta"]
    csv_pc = tmp_path / "d.csv"
    csv_pc.write_text("prompt,completion\n2+2?,4\n")
    assert read_records([csv_pc])[0].completion == "4"
    txt = tmp_path / "e.txt"
    txt.write_text("plain text\nover lines")
    assert read_records([txt]) == [Record("text", f"data file {str(txt)!r}", text="plain text\nover lines")]


def test_parquet(tmp_path, reader):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}, {"messages": CHAT}]), str(path))
    got = read_records([path])
    assert [r.messages for r in got] == [tuple(CHAT)] * 2
    assert got[1].where == f"data file {str(path)!r} row 2"


def test_parquet_without_a_reader_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "_rows_through_datasets", lambda path, kind: None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "a.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(WorkloadError, match=r"needs the datasets or pyarrow package"):
        read_records([path])


@pytest.mark.parametrize(
    ("rows", "line", "needle"),
    [
        # A chat file's record without 'messages': line 4 (a blank line 2 holds no record).
        ([{"messages": CHAT}, {"messages": CHAT}, {"prompt": "x"}], 4, "is not a chat record"),
        ([{"messages": CHAT}, {"messages": [{"role": "user"}]}], 3, "without a 'role' and a 'content'"),
        ([{"messages": CHAT}, {"messages": CHAT[:1]}], 3, "has no 'assistant' turn"),
        ([{"messages": CHAT}, {"messages": []}], 3, "not a non-empty list of turns"),
        ([{"prompt": "a", "completion": "b"}, {"completion": "b"}], 3, "not a prompt/completion record"),
        ([{"text": "a"}, {"text": 7}], 3, "has no 'text' string"),
        ([{"body": "a"}], 1, "has none of the fields memfit reads"),
    ],
)
def test_a_bad_record_names_its_line(tmp_path, reader, rows, line, needle):
    path = _jsonl(tmp_path / "bad.jsonl", rows, blank_after=(0,))
    with pytest.raises(WorkloadError) as info:
        read_records([path])
    message = str(info.value)
    assert f"data file {str(path)!r} line {line} " in message, message
    assert needle in message and "\n" not in message


def test_a_line_that_is_not_json_is_named(tmp_path, reader):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n{not json\n")
    with pytest.raises(WorkloadError, match=r"line 3 is not valid JSON"):
        read_records([path])


def test_csv_lines_count_quoted_line_breaks(tmp_path, reader):
    path = tmp_path / "a.csv"
    path.write_text('prompt,completion\n"two\nlines",b\nc,\n')
    # Row 2 (line 4: row 1 spans lines 2-3) has an empty completion: still a string, kept.
    assert [r.completion for r in read_records([path])] == ["b", ""]
    assert records_module._line_numbers(path, "csv") == [2, 4]


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "  \n", "is empty"),
        ("data.xml", "<a/>", "cannot read"),
        ("blank.csv", "text\n,\n", "has no text in any record"),
    ],
)
def test_file_errors_are_one_sentence(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(WorkloadError, match=match) as info:
        read_records([path])
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_no_paths():
    with pytest.raises(WorkloadError, match="no data files"):
        read_records([])


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_datasets_reads_each_format_itself(tmp_path, kind):
    """Through datasets when installed: no silent fall back to the standard library."""
    pytest.importorskip("datasets")
    rows = [{"prompt": "2+2?", "completion": "4"}, {"prompt": "3+3?", "completion": ""}]
    path = tmp_path / f"a.{kind}"
    if kind == "jsonl":
        _jsonl(path, rows, blank_after=(0,))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        path.write_text("prompt,completion\n2+2?,4\n3+3?,\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    assert records_module._rows_through_datasets(path, kind) == rows


def test_a_file_datasets_refuses_prints_nothing_before_memfits_sentence(tmp_path, capfd):
    pytest.importorskip("datasets")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(WorkloadError, match="cannot be read as Parquet"):
        read_records([bad])
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""  # datasets' "Failed to read ..." is silent
