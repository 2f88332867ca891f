"""Training data as people have it: records read from JSONL, JSON, Parquet, CSV and text files.

A record is one of three kinds, told apart by its fields:

* **text**: a string field, ``text`` or the one named by ``text_field`` (a CSV without such a
  column gives its first column, a ``.txt`` file is one record);
* **chat**: ``messages``, a list of ``{"role": ..., "content": ...}`` turns;
* **prompt/completion**: ``prompt`` and ``completion``, two strings (or two lists of turns,
  which make a chat record).

A file's first record sets the file's kind, and every other record must have its fields, or
reading stops with one sentence naming the record's line (:class:`~memfit.workload.WorkloadError`).

Files load through Hugging Face ``datasets`` when it is installed (its Arrow readers; install
``memfit[data]``); without it JSONL, JSON and CSV are read with the standard library and
Parquet with ``pyarrow``. When ``datasets`` refuses a file (a line that is not JSON, records
whose fields disagree in type), the standard library reads it again, which names the line at
fault.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..workload import WorkloadError
from .stopping import check_stop

__all__ = ["DATA_SUFFIXES", "Record", "read_records"]

#: File suffixes :func:`read_records` reads, by format.
DATA_SUFFIXES: dict[str, str] = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
}

_EXAMPLE = {
    "text": '{"text": "..."}',
    "chat": '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}',
    "prompt": '{"prompt": "...", "completion": "..."}',
}
_FIELDS = {
    "chat": ("a chat record", "'messages' list"),
    "prompt": ("a prompt/completion record", "'prompt' and 'completion'"),
}


@dataclass(frozen=True, slots=True)
class Record:
    """One training example as read, before tokenising.

    Attributes:
        kind: ``"text"``, ``"chat"`` or ``"prompt"`` (prompt/completion strings).
        where: The file and line (or record, or row) it came from, for messages.
        text: A text record's text.
        messages: A chat record's turns (``role`` and ``content`` strings, nothing else).
        prompt: A prompt/completion record's prompt.
        completion: A prompt/completion record's completion.
    """

    kind: str
    where: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    completion: str | None = None


def read_records(
    paths: Sequence[str | os.PathLike[str]], *, text_field: str = "text"
) -> list[Record]:
    """Read the records of data files, in order.

    Args:
        paths: ``.jsonl``, ``.json``, ``.parquet``, ``.csv`` or ``.txt`` (``.text``, ``.md``)
            files.
        text_field: The field (or CSV column) holding a text record's text.

    Returns:
        The records; empty texts are skipped.

    Raises:
        WorkloadError: one sentence naming the file (and the line, record or row) for a
            missing or empty file, an unknown suffix, a line that is not JSON, a record
            without the fields of its file's kind, or Parquet without a reader installed.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise WorkloadError(
            f"no data files given; give one or more {', '.join(sorted(DATA_SUFFIXES))} files"
        )
    records: list[Record] = []
    for raw in paths:
        check_stop()  # a SIGTERM or SIGINT stops reading between files (StopRequested)
        records.extend(_read_file(Path(raw), text_field))
    return records


def _read_file(path: Path, text_field: str) -> list[Record]:
    accepted = ", ".join(sorted(DATA_SUFFIXES))
    if not path.is_file():
        raise WorkloadError(f"data file {str(path)!r} does not exist; give paths to {accepted} files")
    kind = DATA_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise WorkloadError(
            f"data file {str(path)!r} has suffix {path.suffix or '(none)'!r}, which memfit cannot "
            f"read; use one of {accepted}"
        )
    if path.stat().st_size == 0 or (kind != "parquet" and not _has_text(path)):
        raise WorkloadError(f"data file {str(path)!r} is empty; give a file with some data in it")
    name = repr(str(path))
    if kind == "text":
        return [Record("text", f"data file {name}", text=path.read_text(encoding="utf-8", errors="replace"))]
    rows, where = _rows(path, kind)
    records = _records(rows, where, text_field, csv_first_column=kind == "csv")
    if not records:
        raise WorkloadError(
            f"data file {name} has no text in any record; give records with a non-empty "
            f"'{text_field}' string, 'messages', or 'prompt' and 'completion'"
        )
    return records


def _has_text(path: Path) -> bool:
    with path.open("rb") as f:
        return any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


# ---------------------------------------------------------------------------------- rows
def _rows(path: Path, kind: str) -> tuple[list[Any], Callable[[int], str]]:
    """The file's rows (mappings) and a function from a row's index to where it is."""
    name = f"data file {str(path)!r}"
    lines = _line_numbers(path, kind) if kind in ("jsonl", "csv") else []
    noun = "record" if kind == "json" else "row"

    def where(i: int) -> str:
        return f"{name} line {lines[i]}" if i < len(lines) else f"{name} {noun} {i + 1}"

    rows = _rows_through_datasets(path, kind)
    if rows is not None:
        return rows, where
    if kind == "jsonl":
        return _jsonl_rows(path, name), where
    if kind == "json":
        return _json_rows(path, name), where
    if kind == "csv":
        return _csv_rows(path), where
    return _parquet_rows(path, name), where


def _rows_through_datasets(path: Path, kind: str) -> list[Any] | None:
    """The rows as ``datasets`` reads them, or ``None`` when it is not installed or refuses
    the file (the standard library's reading then names the fault)."""
    try:
        import datasets
    except ImportError:
        return None
    readers: dict[str, Callable[..., Any]] = {
        "jsonl": datasets.Dataset.from_json,
        "json": datasets.Dataset.from_json,
        # Every cell a string, empty cells empty: as the csv module reads them (pandas would
        # turn a column of numbers into numbers and an empty cell into NaN).
        "csv": functools.partial(_csv_through_datasets, datasets),
        "parquet": datasets.Dataset.from_parquet,
    }
    # The rows are all taken into memory here, so the Arrow files datasets prepares are only
    # a step on the way: a folder of our own, removed after, rather than the user's cache.
    with _quiet_datasets(datasets), tempfile.TemporaryDirectory(prefix="memfit-data-") as cache:
        try:
            table = readers[kind](str(path), cache_dir=cache, keep_in_memory=True)
            return list(table.to_list())
        except Exception:  # any refusal: read again below, which names the line at fault
            return None


def _csv_through_datasets(datasets: Any, path: str, **kwargs: Any) -> Any:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        header = next(csv.reader(f), [])
    strings = datasets.Features({name: datasets.Value("string") for name in header})
    return datasets.Dataset.from_csv(path, features=strings, na_filter=False, **kwargs)


@contextlib.contextmanager
def _quiet_datasets(datasets: Any) -> Iterator[None]:
    # Its progress bars would draw over memfit's own status line, and its log lines ("Failed
    # to read file ... with error ...") would come before memfit's own sentence on a file it
    # refuses (which is read again below to name the line at fault); put back as they were.
    was_off = datasets.utils.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not was_off:
            datasets.utils.enable_progress_bars()


def _jsonl_rows(path: Path, name: str) -> list[Any]:
    rows = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise WorkloadError(
                f"{name} line {n} is not valid JSON ({e.msg}); each line must be a JSON object "
                f"such as {_EXAMPLE['text']} or {_EXAMPLE['chat']}"
            ) from None
    return rows


def _json_rows(path: Path, name: str) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise WorkloadError(
            f"{name} is not valid JSON ({e.msg} at line {e.lineno}); give a JSON list of "
            "records, or one record per line in a .jsonl file"
        ) from None
    if isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list):
        raise WorkloadError(f"{name} holds a JSON {type(data).__name__}; give a JSON list of records")
    return data


def _csv_rows(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return list(csv.DictReader(text.splitlines()))


def _parquet_rows(path: Path, name: str) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise WorkloadError(
            f"{name} is Parquet, which needs the datasets or pyarrow package to read, and "
            "neither is installed here: pip install 'memfit[data]', or convert the file to JSONL"
        ) from None
    try:
        return list(pq.read_table(str(path)).to_pylist())
    except Exception as e:  # pyarrow raises its own error types for broken files
        raise WorkloadError(f"{name} cannot be read as Parquet ({' '.join(str(e).split())})") from None


def _line_numbers(path: Path, kind: str) -> list[int]:
    """The line each record of a JSONL or CSV file starts on (blank lines hold none), in one
    pass: messages name lines, and ``datasets`` keeps only the records."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if kind == "jsonl":
        return [n for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    reader = csv.reader(text.splitlines())
    next(reader, None)  # the header
    starts, start = [], reader.line_num + 1
    for row in reader:
        if row:  # csv.DictReader and pandas skip blank lines too
            starts.append(start)
        start = reader.line_num + 1
    return starts


# ---------------------------------------------------------------------------------- records
def _records(
    rows: Sequence[Any], where: Callable[[int], str], text_field: str, *, csv_first_column: bool
) -> list[Record]:
    if not rows:
        return []
    first = _kind_of(rows[0], text_field)
    if first is None and csv_first_column and isinstance(rows[0], Mapping) and text_field == "text":
        # A CSV without a 'text' column: its first column is the text (as before records).
        column = next(iter(rows[0]), None)
        if column is not None:
            text_field, first = column, "text"
    if first is None:
        raise WorkloadError(
            f"{where(0)} has none of the fields memfit reads: a '{text_field}' string, a "
            "'messages' list, or 'prompt' and 'completion'; write records such as "
            f"{_EXAMPLE['text']} or {_EXAMPLE['chat']}"
        )
    out = []
    for i, row in enumerate(rows):
        record = _record(row, i, first, where, text_field)
        if record is not None:
            out.append(record)
    return out


def _present(row: Mapping[str, Any], key: str) -> bool:
    # datasets fills a field a record lacks with None (its columns are the union of all).
    return row.get(key) is not None


def _kind_of(row: Any, text_field: str) -> str | None:
    if not isinstance(row, Mapping):
        return None
    if _present(row, "messages"):
        return "chat"
    if _present(row, "prompt") and _present(row, "completion"):
        return "prompt"
    if _present(row, text_field):
        return "text"
    return None


def _record(row: Any, i: int, kind: str, where: Callable[[int], str], text_field: str) -> Record | None:
    if kind == "text":
        value = row.get(text_field) if isinstance(row, Mapping) else None
        if not isinstance(value, str):
            raise WorkloadError(
                f"{where(i)} has no '{text_field}' string, which every record of a text file "
                f"needs (the first record has one); write records such as {_EXAMPLE['text']}"
            )
        return Record("text", where(i), text=value) if value.strip() else None
    if _kind_of(row, text_field) != kind:
        what, fields = _FIELDS[kind]
        raise WorkloadError(
            f"{where(i)} is not {what} like the file's first one: it has no {fields}, which "
            f"every record of the file needs; write records such as {_EXAMPLE[kind]}"
        )
    if kind == "chat":
        return _chat(_messages(row["messages"], i, where, "messages"), i, where)
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Record("prompt", where(i), prompt=prompt, completion=completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        # Conversational prompt/completion: the turns of both, in order, are one chat.
        turns = _messages(prompt, i, where, "prompt") + _messages(completion, i, where, "completion")
        return _chat(turns, i, where)
    raise WorkloadError(
        f"{where(i)} has a 'prompt' and a 'completion' that are not both strings (or both lists "
        f"of turns); write records such as {_EXAMPLE['prompt']}"
    )


def _messages(
    value: Any, i: int, where: Callable[[int], str], field: str
) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise WorkloadError(
            f"{where(i)} has a '{field}' that is not a non-empty list of turns; write turns "
            'such as {"role": "user", "content": "..."}'
        )
    turns = []
    for n, turn in enumerate(value, start=1):
        role = turn.get("role") if isinstance(turn, Mapping) else None
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise WorkloadError(
                f"{where(i)} has a turn ({field} item {n}) without a 'role' and a 'content' "
                'string; write turns such as {"role": "user", "content": "..."}'
            )
        turns.append({"role": role, "content": content})
    return tuple(turns)


def _chat(turns: tuple[dict[str, str], ...], i: int, where: Callable[[int], str]) -> Record:
    if not any(t["role"] == "assistant" for t in turns):
        raise WorkloadError(
            f"{where(i)} has no 'assistant' turn, so nothing in it would be learned (the loss "
            "counts the last assistant turn's tokens); add the answer as an assistant turn"
        )
    return Record("chat", where(i), messages=turns)
