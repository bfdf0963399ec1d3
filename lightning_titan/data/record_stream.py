"""Streaming instruction records (chat, prompt/completion): read one at a time, rendered and packed
as the map-style preparation does (``records.py``: the same template, labels, held-out hash and
``RecordPacker``), so a streamed window is one the map-style path would build from the same records.

Local files are read by ``records.placed_records`` (the map-style reader), not by a `datasets`
builder, so that a record keeps its place ("file:line" for JSON Lines, "file record i" for a JSON
list, "file row i" for Parquet): a malformed record is named as the stream reaches it (the
pre-launch check cannot read a whole stream). Each file is one shard of the stream, as `datasets`
shards files, so shard shuffling and the split by data rank work alike; each example is {"where",
"record": the record as JSON}. A hub dataset's rows are records as they come, named by the
dataset and the record's start.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np

from lightning_titan.data.chat import render
from lightning_titan.data.corpus import Source, load_documents, local_files
from lightning_titan.data.packing import RecordPacker
from lightning_titan.data.records import (
    held_out_key,
    named,
    parse_record,
    placed_records,
    record_format,
    records_packed,
)
from lightning_titan.data.streaming import Documents, TextDocuments
from lightning_titan.data.tokenizer import Tokenizer

_FEATURES = datasets.Features(
    {"where": datasets.Value("string"), "record": datasets.Value("string")}
)


def source_stream(
    src: Source, cache_dir: str, data_format: str, texts: list[str] | None, data_world: int
) -> datasets.IterableDataset:
    """The source as a stream of examples: documents as `datasets` reads them (text), else records,
    one shard a local file (a hub dataset's rows: its own stream)."""
    files = local_files(src.source) if src.source is not None else None
    if data_format == "text" or files is None:
        return load_documents(src, cache_dir, streaming=True, texts=texts, data_world=data_world)
    return datasets.IterableDataset.from_generator(
        _placed_records, features=_FEATURES, gen_kwargs={"files": files}
    )


def _placed_records(files: list[str]) -> Iterator[dict[str, str]]:
    """One shard's examples: {"where", "record"} of ``files``, the record unparsed (a line that is
    not JSON is named where the window parses it)."""
    for where, text in placed_records(files):
        yield {"where": where, "record": text}


def stream_documents(src: Source, data_format: str, tokenizer: Tokenizer, window: int) -> Documents:
    """What a stream's examples are: text, or records rendered and packed as map-style."""
    if data_format == "text":
        return TextDocuments(src, tokenizer.encode_array, tokenizer.eod_id, window)
    return RecordDocuments(src, data_format, tokenizer, window, records_packed(src.pack))


class RecordDocuments:
    """What a records stream's examples are to ``StreamingWindows``: each read and held out as
    ``records.py`` holds it out, rendered by ``data_format`` and ``src.train_on``, packed by
    ``RecordPacker``. A record longer than the window is skipped: the first one is named on
    stderr, every one counted in ``skipped_too_long``."""

    def __init__(
        self, src: Source, data_format: str, tokenizer: Tokenizer, window: int, pack: bool
    ) -> None:
        self.src, self.data_format, self.tokenizer = src, data_format, tokenizer
        self.window, self.pack = window, pack
        self.skipped_too_long = 0

    def check(self, stream: datasets.IterableDataset) -> None:
        """Nothing to check before reading: each record is checked as it is read."""

    def read(self, example: dict) -> tuple[str, tuple[str, object]]:
        """(the held-out key, (where, the record)); a line that is not JSON raises, named."""
        if set(example) != set(_FEATURES):  # a hub dataset's row
            name = self.src.source if isinstance(self.src.source, str) else "source"
            return held_out_key(example), (f"{name} record {held_out_key(example)[:60]}", example)
        where = example["where"]
        record = parse_record(where, example["record"])
        return held_out_key(record), (where, record)

    def packer(self, leftover: np.ndarray) -> RecordPacker:
        return RecordPacker(self.window, self.tokenizer.eod_id, self.pack, leftover)

    def add(self, packer: RecordPacker, document: Any) -> None:
        where, record = document
        kind = record_format(record, self.data_format, self.src)
        with named(where, kind):
            rendered = render(record, kind, self.tokenizer, self.src.train_on)
        if len(rendered.ids) > self.window:
            self.skipped_too_long += 1
            if self.skipped_too_long == 1:
                print(
                    f"skipped a {kind} record longer than seq_len + 1 = {self.window} tokens "
                    f"({where}, {len(rendered.ids)} tokens); raise seq_len to keep such records "
                    "(the stream skips the others without naming them)",
                    file=sys.stderr,
                )
            return
        packer.add(rendered.ids, rendered.labels)
