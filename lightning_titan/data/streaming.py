"""Streaming mode (the usual Hugging Face way): shuffle, ``split_dataset_by_node`` by data rank, pack per rank.

Batches here depend on the layout: each data rank packs its own shard of the stream, so a different
dp*ep gives different sequences. Use the map-style mode when runs must match across layouts.

Exact resume: Hugging Face's shuffle buffer is not part of ``IterableDataset.state_dict()`` (it is
refilled and its contents lost on load). So ``IterableDataset.shuffle(seed + pass, buffer_size=1)``
shuffles only the shard order, and documents are shuffled here, in windows of ``shuffle_buffer``
documents with a permutation seeded by (seed, data rank, pass, window). The position is the stream's
``state_dict()`` at the window's start, the documents taken from the window and the packer's leftover
tokens: small, and restoring it serves exactly the next batch.

What a document is (plain text, or a chat / prompt-completion record: ``record_stream.py``) is the
stream's ``documents``: how an example is read and held out, and the packer its windows come from.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import IterableDataset

from lightning_titan.data.corpus import Source, check_text_column, is_validation, reading
from lightning_titan.data.packing import Packer
from lightning_titan.data.readable import as_text, check_text_feature


@dataclass
class StreamPosition:
    """Where one data rank's stream stands at a batch boundary (plain types: it goes in checkpoints)."""

    epoch: int = 0  # this rank's pass over its shard
    window: int = 0  # shuffle window within the pass
    window_state: dict | None = None  # stream.state_dict() at the window's start (None: pass start)
    docs_taken: int = 0  # documents of the window already packed
    # packed tokens not yet served: [n] text; [rows, n] records (ids, labels[, document ids])
    leftover: list = field(default_factory=list)


@dataclass(frozen=True)
class _Mark:
    """A position recorded at every batch boundary, cheaply: the leftover stays as array views until a
    checkpoint asks for it (copying a long document's rest at every batch would dominate the cost)."""

    batches: int
    epoch: int
    window: int
    window_state: dict | None
    docs_taken: int
    leftover: tuple[np.ndarray, ...]

    def position(self) -> StreamPosition:
        state = copy.deepcopy(self.window_state)
        return StreamPosition(
            self.epoch, self.window, state, self.docs_taken, _joined(self.leftover)
        )

    @classmethod
    def at(cls, batches: int, position: StreamPosition) -> _Mark:
        leftover = (np.asarray(position.leftover, dtype=np.int64),)
        state = copy.deepcopy(position.window_state)
        return cls(batches, position.epoch, position.window, state, position.docs_taken, leftover)


def _joined(parts: tuple[np.ndarray, ...]) -> list:
    """The leftover as plain lists: text parts (windows [m, S+1], the packer's rest [n]) end to end;
    record parts (windows [m, rows, S+1], the packer's rest [rows, n]) row by row, [rows, total]."""
    if not parts:
        return []
    if parts[-1].ndim == 1:
        return np.concatenate([np.ravel(part) for part in parts]).tolist()
    rows = parts[-1].shape[0]
    flat = [np.moveaxis(part, -2, 0).reshape(rows, -1) for part in parts]
    return np.concatenate(flat, axis=1).tolist()


class Documents(Protocol):
    """What a stream's examples are: read (held-out key, document), checked, packed."""

    def check(self, stream: datasets.IterableDataset) -> None: ...

    def read(self, example: dict) -> tuple[str, Any]: ...

    def packer(self, leftover: np.ndarray) -> Any: ...

    def add(self, packer: Any, document: Any) -> None: ...


class TextDocuments:
    """Plain text: the text column's strings, tokenised, joined by the end id, cut by ``Packer``."""

    def __init__(
        self, src: Source, encode: Callable[[str], np.ndarray], eod_id: int, window: int
    ) -> None:
        self.src, self.encode, self.eod_id, self.window = src, encode, eod_id, window

    def check(self, stream: datasets.IterableDataset) -> None:
        check_text_column(stream.column_names, self.src.column, self.src.source)
        check_text_feature(stream.features, self.src.column, self.src.source)

    def read(self, example: dict) -> tuple[str, str]:
        if self.src.column not in example:
            check_text_column(list(example), self.src.column, self.src.source)
        text = as_text(example[self.src.column], self.src.column, self.src.source)
        return text, text

    def packer(self, leftover: np.ndarray) -> Packer:
        return Packer(self.window, self.eod_id, leftover)

    def add(self, packer: Packer, text: str) -> None:
        packer.add(self.encode(text))


class StreamingWindows(IterableDataset):
    """One data rank's endless stream of S+1 windows; each ``iter()`` serves ``batches_per_iter`` batches
    (all of them, forever, when None) and continues where the previous one stopped.

    Every rank serves the same number of batches because the count is fixed, not read off the data: a
    rank whose shard runs out starts its next pass (reshuffled by seed + pass) instead of stopping.
    Validation streams (``restart=True``) start from the beginning on every ``iter()``.
    """

    def __init__(
        self,
        make_stream: Callable[[int], datasets.IterableDataset],
        documents: Documents,
        seq_len: int,
        local_batch_size: int,
        validation: bool,
        val_fraction: float,
        seed: int,
        data_rank: int,
        shuffle_buffer: int,
        batches_per_iter: int | None,
        restart: bool = False,
        source: Source | None = None,
    ) -> None:
        self.make_stream, self.documents = make_stream, documents
        self.window_len, self.local_batch_size = seq_len + 1, local_batch_size
        self.validation, self.val_fraction = validation, val_fraction
        self.seed, self.data_rank, self.shuffle_buffer = seed, data_rank, max(1, shuffle_buffer)
        self.batches_per_iter, self.restart = batches_per_iter, restart
        self.source = source  # names the file a read error comes from
        # the last few batch boundaries: a consumer that prefetches is ahead of what training used
        self._marks: deque[_Mark] = deque([_Mark.at(0, StreamPosition())], maxlen=8)

    def __len__(self) -> int:
        if self.batches_per_iter is None:
            raise TypeError("an endless stream has no length")
        return self.batches_per_iter * self.local_batch_size

    @property
    def batches_served(self) -> int:
        return self._marks[-1].batches

    @property
    def position(self) -> StreamPosition:
        return self._marks[-1].position()

    def state_dict(self, batches: int | None = None) -> dict:
        """The position after ``batches`` served batches (default: all served so far); pass the count
        training really consumed when the consumer prefetches."""
        batches = self.batches_served if batches is None else batches
        for mark in reversed(self._marks):
            if mark.batches == batches:
                return {"batches": batches, "position": asdict(mark.position())}
        known = [mark.batches for mark in self._marks]
        raise ValueError(f"no stream position kept for {batches} batches (kept: {known})")

    def load_state_dict(self, state: dict) -> None:
        self._marks.clear()
        self._marks.append(_Mark.at(int(state["batches"]), StreamPosition(**state["position"])))

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.restart:
            return self._serve(StreamPosition(), 0, self.batches_per_iter, record=False)
        limit = None
        if self.batches_per_iter is not None:
            limit = self.batches_per_iter - self.batches_served % self.batches_per_iter
        return self._serve(self.position, self.batches_served, limit, record=True)

    def _serve(
        self, pos: StreamPosition, served: int, limit: int | None, record: bool
    ) -> Iterator[torch.Tensor]:
        b, end = self.local_batch_size, None if limit is None else served + limit
        packer = self.documents.packer(np.asarray(pos.leftover, dtype=np.int64))
        in_batch = 0
        while True:
            stream = self.make_stream(pos.epoch)
            if pos.window_state is not None:
                _load_quietly(
                    stream, copy.deepcopy(pos.window_state)
                )  # marks share pos.window_state
            fresh_pass, found = pos.window_state is None and pos.docs_taken == 0, False
            docs_iter = iter(stream)
            while docs := self._read_window(docs_iter):
                found = True
                rng = np.random.default_rng([self.seed, self.data_rank, pos.epoch, pos.window])
                order = rng.permutation(len(docs))
                for j in range(pos.docs_taken, len(docs)):
                    self.documents.add(packer, docs[order[j]])
                    pos.docs_taken = j + 1
                    windows = packer.take()
                    for i, window in enumerate(windows):
                        in_batch += 1
                        if in_batch == b:  # record before the batch's last window leaves
                            in_batch, served = 0, served + 1
                            if record:
                                rest = (windows[i + 1 :], packer.leftover)
                                self._marks.append(
                                    _Mark(
                                        served, pos.epoch, pos.window, pos.window_state, j + 1, rest
                                    )
                                )
                        yield torch.from_numpy(window)
                        if in_batch == 0 and served == end:
                            return
                pos.window, pos.docs_taken = pos.window + 1, 0
                pos.window_state = stream.state_dict()  # a fresh dict: marks may keep the old one
            if fresh_pass and not found:
                raise ValueError(
                    f"data rank {self.data_rank} got no {'validation' if self.validation else 'training'} "
                    "documents from the stream; use fewer data ranks (dp*ep), more files/shards, a larger "
                    "val_fraction, or the map-style mode (streaming=False)"
                )
            pos.epoch, pos.window, pos.window_state, pos.docs_taken = pos.epoch + 1, 0, None, 0

    def _read_window(self, docs_iter: Iterator[dict]) -> list:
        docs: list = []
        with reading(self.source) if self.source is not None else contextlib.nullcontext():
            for example in docs_iter:
                key, document = self.documents.read(example)
                if is_validation(key, self.val_fraction) == self.validation:
                    docs.append(document)
                    if len(docs) == self.shuffle_buffer:
                        break
        return docs


def rank_stream(
    stream: datasets.IterableDataset, seed: int, data_rank: int, data_world: int
) -> datasets.IterableDataset:
    """One data rank's documents for one pass: shard order shuffled by ``seed``, then split by data rank."""
    # buffer_size=1 shuffles the shard order only: the buffer is then always empty between examples, so
    # the stream's state_dict() is exact (documents are shuffled in StreamingWindows instead)
    stream = stream.shuffle(seed=seed, buffer_size=1)
    return split_dataset_by_node(stream, rank=data_rank, world_size=data_world)


def check_rank_shard(
    stream: datasets.IterableDataset,
    src: Source,
    documents: Documents,
    val_fraction: float,
    data_rank: int,
    data_world: int,
) -> None:
    """Fail in setup, on the rank concerned, rather than hang later: the text column exists and this rank's
    shard holds training (and, if wanted, validation) documents. Reads until it has seen both kinds."""
    documents.check(stream)
    missing = {False} | ({True} if val_fraction > 0 else set())
    with reading(src):
        for example in stream:
            key, _ = documents.read(example)
            missing.discard(is_validation(key, val_fraction))
            if not missing:
                return
    kind = "any" if False in missing else "validation"
    raise ValueError(
        f"data rank {data_rank} of {data_world} gets no {kind} documents from source {src.source!r}; use "
        "fewer data ranks (dp*ep), a source with more files/shards, a larger val_fraction (or 0 for no "
        "validation), or the map-style mode (streaming=False)"
    )


def _load_quietly(stream: datasets.IterableDataset, state: dict) -> None:
    """Load a position; silence the warning about a lost shuffle buffer, which is empty at buffer_size=1."""
    logger = logging.getLogger("datasets.iterable_dataset")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        stream.load_state_dict(state)
    finally:
        logger.setLevel(level)
