"""Map-style preparation of instruction records (chat, prompt/completion) into windows of S+1.

Packed (the default for records): records are laid into a window in order while they fit, and the
window is padded to S+1 with the end-of-document id once the next record does not; a third column
holds each token's document id (the padding one more document), from which the model attends
within a document only and restarts RoPE positions (``model/documents.py``). A record's first label
is IGNORE_INDEX: it would be the previous record's last token's target, across the boundary.
Unpacked: one record a window, padded; a record then attends to itself only without any mask.
Either way the labels are IGNORE_INDEX on the prompt side and the padding. Policy for bad records: a
malformed one stops preparation with its file and line; one longer than the window is skipped,
counted and reported (cutting it would train on a cut answer).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from lightning_titan.data.chat import BadRecord, detect_format, pieces, render
from lightning_titan.data.corpus import Source, is_validation, load_documents, local_files
from lightning_titan.data.packing import RecordPacker, pad_record
from lightning_titan.data.readable import file_problem
from lightning_titan.data.tokenizer import Tokenizer, token_dtype

Record = tuple[str, object]  # (where: "file:line" or "row i", the parsed record)
Window = tuple[np.ndarray, ...]  # ids, labels[, document ids], each [S+1]


def records_packed(pack: bool | None) -> bool:
    """Whether records are packed: as asked, else yes (with per-document attention packing changes
    no record's loss, and a window of one short record is mostly padding)."""
    return True if pack is None else pack


def resolve_format(src: Source, cache_dir: str, streaming: bool = False) -> str:
    """The format to read ``src`` as: the one asked for, else from the first record's columns
    (``streaming``: read from the stream's declared columns rather than preparing the dataset)."""
    if src.data_format != "auto":
        return src.data_format
    if src.source is None:
        return "text"
    files = local_files(src.source)
    if files is not None and all(_suffix(f) == ".txt" for f in files):
        return "text"
    if files is not None and all(_suffix(f) in (".json", ".jsonl") for f in files):
        try:
            first = next(iter_records(src, cache_dir), None)
        except ValueError:  # not JSON or not UTF-8: the text path names the file and the fix
            return "text"
        columns = list(first[1]) if first is not None and isinstance(first[1], dict) else []
    else:
        columns = list(load_documents(src, cache_dir, streaming=streaming).column_names or [])
    return detect_format(columns, src.text_column)


def iter_records(src: Source, cache_dir: str) -> Iterator[Record]:
    """Every record with its place: JSON Lines by line (a file holding one JSON list by index), other
    sources by row. A line that is not JSON stops here, named."""
    files = local_files(src.source) if src.source is not None else None
    if files is None or not all(_suffix(f) in (".json", ".jsonl") for f in files):
        rows = load_documents(src, cache_dir)
        name = src.source if isinstance(src.source, str) else "source"
        for i, row in enumerate(rows):
            yield f"{name} row {i}", row
        return
    for where, text in placed_records(files):
        yield where, parse_record(where, text)


def placed_records(files: list[str]) -> Iterator[tuple[str, str]]:
    """(where, the record's JSON text) of every record of local files, read as they are needed (a
    stream reads the same): JSON Lines by line ("file:line"), a file holding one JSON list by index
    ("file record i", read whole), Parquet by row ("file row i")."""
    for path in files:
        if _suffix(path) == ".parquet":
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
                for record in batch.to_pylist():
                    yield f"{path} row {row}", json.dumps(record, default=str)
                    row += 1
            continue
        try:
            with open(path, encoding="utf-8") as f:
                head = f.read(4096)
                if head.lstrip().startswith("["):
                    for i, record in enumerate(json_document(path, head + f.read())):
                        yield f"{path} record {i}", json.dumps(record)
                    continue
                f.seek(0)
                for number, line in enumerate(f, start=1):
                    if line.strip():
                        yield f"{path}:{number}", line
        except UnicodeDecodeError as err:
            raise ValueError(f"source file {path!r} {file_problem(path, 'json')}") from err


def parse_record(where: str, text: str) -> object:
    """One record from its JSON text; text that is not JSON stops here, named."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where} is not JSON ({err.msg}); give one JSON object per line"
        ) from None


def json_document(path: str, text: str) -> list:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON (line {err.lineno}: {err.msg})") from err
    return list(rows)


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def build_records(
    src: Source,
    data_format: str,
    tokenizer: Tokenizer,
    seq_len: int,
    val_fraction: float,
    cache_dir: str,
    work: Path,
    pack: bool = False,
) -> dict[str, dict]:
    """Render every record into windows of ``seq_len + 1`` ids and labels (and document ids when
    ``pack``), one Arrow file per split under ``work``; returns each split's stats."""
    window = seq_len + 1
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "validation": []}
    tokens = {"train": 0, "validation": 0}
    too_long: list[str] = []
    for where, record in iter_records(src, cache_dir):
        kind = record_format(record, data_format, src)
        with named(where, kind):
            rendered = render(record, kind, tokenizer, src.train_on)
        if len(rendered.ids) > window:
            too_long.append(f"{where} ({len(rendered.ids)} tokens)")
            continue
        split = "validation" if is_validation(held_out_key(record), val_fraction) else "train"
        out[split].append((rendered.ids, rendered.labels))
        tokens[split] += len(rendered.ids)
    kept = len(out["train"]) + len(out["validation"])
    if too_long:
        print(
            f"skipped {len(too_long)} of {kept + len(too_long)} {data_format} records longer than "
            f"seq_len + 1 = {window} tokens (first: {', '.join(too_long[:3])}); raise seq_len to keep them",
            file=sys.stderr,
        )
    if kept == 0:
        raise ValueError(
            f"source {src.source!r} has no {data_format} record that fits seq_len + 1 = {window} tokens "
            f"({len(too_long)} skipped as longer); raise seq_len or give shorter records"
        )
    stats: dict[str, dict[str, float]] = {}
    for split, records in out.items():
        if pack:
            rows = pack_records(records, window, tokenizer.eod_id)
        else:
            rows = [pad_record(ids, labels, window, tokenizer.eod_id) for ids, labels in records]
        _write(work / f"{split}.arrow", rows, window, tokenizer.vocab_size, pack)
        n = len(records)
        stats[split] = {"documents": n, "tokens": tokens[split], "sequences": len(rows), "tail": 0}
        stats[split]["skipped_too_long"] = len(too_long) if split == "train" else 0
        # the share of the windows' tokens that are records' (the rest is padding)
        stats[split]["packing_efficiency"] = round(tokens[split] / max(1, len(rows) * window), 4)
    if pack:
        train = stats["train"]
        print(
            f"packed {train['documents']} {data_format} records into {train['sequences']} "
            f"sequences of seq_len + 1 = {window} tokens: packing efficiency "
            f"{train['packing_efficiency']:.1%} (the share of tokens that are not padding)",
            file=sys.stderr,
        )
    return stats


def pack_records(
    records: list[tuple[np.ndarray, np.ndarray]], window: int, pad_id: int
) -> list[Window]:
    """Records (ids, labels), each at most ``window`` long, laid in order into windows of (ids,
    labels, document ids) as ``RecordPacker`` lays them (a stream packs with the same one)."""
    packer = RecordPacker(window, pad_id, pack=True)
    windows: list[Window] = []
    for ids, labels in records:
        packer.add(ids, labels)
        windows.extend(tuple(w) for w in packer.take())
    packer.flush()
    return windows + [tuple(w) for w in packer.take()]


def check_records(src: Source, cache_dir: str, streaming: bool = False) -> None:
    """Every record of a local instruction source is well formed, else a ValueError naming its file
    and line: ``titan fit`` runs this before it starts ranks, so the message is the only line. A
    stream is not read whole here: its records are checked as the stream reaches them."""
    if streaming or src.source is None or local_files(src.source) is None:
        return  # the default corpus is text; a hub dataset is checked as it is prepared
    data_format = resolve_format(src, cache_dir)
    if data_format == "text":
        return
    for where, record in iter_records(src, cache_dir):
        kind = record_format(record, data_format, src)
        with named(where, kind):
            pieces(record, kind)


@contextlib.contextmanager
def named(where: str, kind: str) -> Iterator[None]:
    """A BadRecord becomes a ValueError that says where the record is and what to do."""
    try:
        yield
    except BadRecord as err:
        raise ValueError(f"{where}: this {kind} record {err}; fix or remove it") from None


def record_format(record: object, data_format: str, src: Source) -> str:
    """format=auto reads each record as its fields say, so one source may mix chat and
    prompt/completion files; a record that is neither is read as the source's format (and named)."""
    if src.data_format != "auto" or not isinstance(record, dict):
        return data_format
    kind = detect_format(list(record), src.text_column)
    return data_format if kind == "text" else kind


def held_out_key(record: object) -> str:
    """What the held-out hash reads: the record, independent of key order and of the file it came from."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, default=str)


def _write(path: Path, rows: list[Window], window: int, vocab_size: int, pack: bool) -> None:
    """Fixed-size list columns: ``input_ids`` (the tokenizer's dtype) and ``labels`` (int32), and
    ``documents`` (int32) when packed."""
    dtype = token_dtype(vocab_size)
    kinds = [("input_ids", dtype), ("labels", np.dtype(np.int32))]
    kinds += [("documents", np.dtype(np.int32))] if pack else []
    columns, fields = [], []
    for i, (name, kind) in enumerate(kinds):
        values = np.stack([r[i] for r in rows]) if rows else np.empty((0, window), np.int64)
        columns.append(
            pa.FixedSizeListArray.from_arrays(pa.array(values.astype(kind).ravel()), window)
        )
        fields.append((name, pa.list_(pa.from_numpy_dtype(kind), window)))
    schema = pa.schema(fields)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch(columns, schema))
