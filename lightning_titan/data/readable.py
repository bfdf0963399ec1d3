"""Which source file cannot be read, and why: run when `datasets` fails (its errors name no file).

Also the one place a text value is checked to be text: a column of ints or lists would otherwise fail deep
in the tokenizer as ``'int' object has no attribute 'encode'``.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pyarrow as pa
from datasets.exceptions import DatasetGenerationError

CHUNK = 1 << 20
READ_ERRORS = (DatasetGenerationError, UnicodeError, pa.ArrowException, json.JSONDecodeError)
TO_UTF8 = (
    "convert it to UTF-8 text (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) or leave it out of source"
)


def as_text(value: object, column: str, source: object) -> str:
    """The text of one document (None: empty); anything else is a wrong column, named with the fix."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise ValueError(
        f"text_column={column!r} of source {source!r} holds {type(value).__name__} values (e.g. "
        f"{value!r:.40}), not text; set text_column to a column of strings"
    )


def check_text_feature(features: object, column: str, source: object) -> None:
    """Before tokenising: the column's declared type, when the source declares one, is a string."""
    feature = features.get(column) if isinstance(features, dict) else None
    dtype = getattr(feature, "dtype", None)
    if feature is None or dtype in ("string", "large_string"):
        return
    shown = dtype or type(feature).__name__
    raise ValueError(
        f"text_column={column!r} of source {source!r} holds {shown} values, not text; set "
        "text_column to a column of strings"
    )


def unreadable(
    source: object, files: list[str], builder: str | None, err: BaseException
) -> ValueError:
    cause = err.__cause__ or err.__context__ or err
    for path in files:
        problem = file_problem(path, builder)
        if problem is not None:
            return ValueError(f"source file {path!r} {problem}")
    return ValueError(
        f"could not read source {source!r} ({len(files)} {builder or ''} file(s)): "
        f"{type(cause).__name__}: {str(cause)[:300]}; check that every file is valid {builder or 'data'}"
    )


def file_problem(path: str, builder: str | None) -> str | None:
    """What is wrong with one file ("is not UTF-8 text ... ; fix"), or None when nothing is found."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            return f"is not a Parquet file ({err}); write it with pandas/pyarrow or leave it out"
        return None
    problem = _encoding_problem(path)
    if problem is None and builder == "json":
        problem = _json_problem(path)
    return problem


def _encoding_problem(path: str) -> str | None:
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            nul = chunk.find(b"\0")
            if nul >= 0:  # valid UTF-8, but binary data or UTF-16/32 text
                return f"holds binary data (a NUL byte at offset {offset + nul}); {TO_UTF8}"
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                bad = chunk[err.start : err.start + 1].hex()
                return f"is not UTF-8 text (byte 0x{bad} at offset {offset + err.start}); {TO_UTF8}"
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"is not UTF-8 text (it ends inside a character); {TO_UTF8}"
    return None


def _json_problem(path: str) -> str | None:
    text = Path(path).read_text(encoding="utf-8")
    try:
        json.loads(text)  # one JSON document (a list of records, or {"data": [...]})
        return None
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return (
                    f"is not JSON Lines: line {number}: {err.msg}; give one JSON object per line "
                    "(or one JSON document), or leave it out of source"
                )
    return None
