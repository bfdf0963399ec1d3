"""Packing: documents joined by the end-of-document id, cut into windows of S+1 tokens (``Packer``);
instruction records laid whole into padded windows (``RecordPacker``); and the batches a loader
serves (``collate_windows``)."""

from __future__ import annotations

import numpy as np
import torch

from lightning_titan.parallel.batching import PackedBatch
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX


class Packer:
    """Carries the unfinished window across documents, so only the very last partial window is ever lost."""

    def __init__(self, window: int, eod_id: int, leftover: np.ndarray | None = None) -> None:
        self.window = window
        self.eod_id = eod_id
        self._parts: list[np.ndarray] = []
        self._size = 0
        if leftover is not None and len(leftover):
            self._append(np.asarray(leftover, dtype=np.int64))

    def _append(self, ids: np.ndarray) -> None:
        self._parts.append(ids)
        self._size += len(ids)

    def add(self, ids: np.ndarray) -> None:
        """One document: its ids, then the end-of-document id."""
        self._append(np.asarray(ids, dtype=np.int64))
        self._append(np.array([self.eod_id], dtype=np.int64))

    def add_tokens(self, ids: np.ndarray) -> None:
        """Ids that already carry their end-of-document markers."""
        self._append(np.asarray(ids, dtype=np.int64))

    def take(self) -> np.ndarray:
        """Every full window now available, as [n, window]; the rest stays for the next documents."""
        n = self._size // self.window
        if n == 0:
            return np.empty((0, self.window), dtype=np.int64)
        flat = np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]
        cut = n * self.window
        rest = flat[cut:]
        self._parts, self._size = ([rest], len(rest)) if len(rest) else ([], 0)
        return flat[:cut].reshape(n, self.window)

    @property
    def leftover(self) -> np.ndarray:
        if not self._parts:
            return np.empty(0, dtype=np.int64)
        return self._parts[0] if len(self._parts) == 1 else np.concatenate(self._parts)


class RecordPacker:
    """Records (ids, labels), each at most ``window`` long, into windows the way the map-style
    preparation lays them (``records.pack_records`` runs this), one record at a time, so that a
    stream packs alike. Packed: a record joins the current window while it fits, else the window is
    padded (a document of its own) and a new one started; each window is (ids, labels, document
    ids) [3, window], a record's first label IGNORE_INDEX (the previous record's last token would
    predict it). Unpacked: one record a window, padded, (ids, labels) [2, window].

    ``leftover`` [rows, n]: the windows ready but not taken, then the unfinished window; a stream
    keeps it in its position and gives it back here."""

    def __init__(
        self, window: int, pad_id: int, pack: bool, leftover: np.ndarray | None = None
    ) -> None:
        self.window, self.pad_id, self.pack = window, pad_id, pack
        self.rows = 3 if pack else 2
        self._ready: list[np.ndarray] = []
        self._open = np.empty((self.rows, 0), dtype=np.int64)  # the unfinished window
        if leftover is not None and np.size(leftover):
            leftover = np.asarray(leftover, dtype=np.int64).reshape(self.rows, -1)
            full = leftover.shape[1] // window * window  # the open window is never full
            self._ready = list(np.moveaxis(leftover[:, :full].reshape(self.rows, -1, window), 1, 0))
            self._open = leftover[:, full:]

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        """One rendered record (its labels IGNORE_INDEX where it is no target)."""
        if not self.pack:
            self._ready.append(np.stack(pad_record(ids, labels, self.window, self.pad_id)))
            return
        if self._open.shape[1] + len(ids) > self.window:
            self.flush()
        labels = np.array(labels, dtype=np.int64)
        labels[0] = IGNORE_INDEX
        document = self._open[2, -1] + 1 if self._open.shape[1] else 0
        record = np.stack([ids, labels, np.full(len(ids), document)]).astype(np.int64)
        self._open = np.concatenate([self._open, record], axis=1)
        if self._open.shape[1] == self.window:  # full: no record fits any more
            self.flush()

    def flush(self) -> None:
        """Pad the unfinished window and make it ready (the end of the records)."""
        if not self._open.shape[1]:
            return
        ids_w, labels_w = pad_record(self._open[0], self._open[1], self.window, self.pad_id)
        docs_w = np.full(self.window, self._open[2, -1] + 1, dtype=np.int64)  # padding: its own
        docs_w[: self._open.shape[1]] = self._open[2]
        self._ready.append(np.stack([ids_w, labels_w, docs_w]))
        self._open = np.empty((self.rows, 0), dtype=np.int64)

    def take(self) -> np.ndarray:
        """Every window ready, as [n, rows, window]."""
        if not self._ready:
            return np.empty((0, self.rows, self.window), dtype=np.int64)
        windows, self._ready = np.stack(self._ready), []
        return windows

    @property
    def leftover(self) -> np.ndarray:
        ready = (
            [np.moveaxis(np.stack(self._ready), 0, 1).reshape(self.rows, -1)] if self._ready else []
        )
        return np.concatenate([*ready, self._open], axis=1)


def pad_record(
    ids: np.ndarray, labels: np.ndarray, window: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """One window's ids and labels padded to ``window``: the padding is ``pad_id``, never a target."""
    ids_w = np.full(window, pad_id, dtype=np.int64)
    labels_w = np.full(window, IGNORE_INDEX, dtype=np.int64)
    ids_w[: len(ids)], labels_w[: len(labels)] = ids, labels
    return ids_w, labels_w


def split_inputs_targets(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, S+1] windows -> (inputs [b, S], targets [b, S]) as int64: targets are inputs shifted by one."""
    windows = windows.long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def collate_windows(
    items: list | torch.Tensor | np.ndarray, text_eod_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | PackedBatch:
    """DataLoader collate: a stacked [b, S+1] block (``__getitems__``) or a list of [S+1] windows;
    [b, 2, S+1] (ids, labels) for instruction records: the targets are the labels shifted by one;
    [b, 3, S+1] (ids, labels, document ids) for packed records: a PackedBatch. ``text_eod_id``:
    plain text packed with document boundaries (``text_documents``)."""
    if isinstance(items, np.ndarray):
        windows = torch.from_numpy(items)
    elif isinstance(items, torch.Tensor):
        windows = items
    else:
        windows = torch.stack([torch.as_tensor(w) for w in items])
    if windows.dim() == 3:
        windows = windows.long()
        inputs, targets = windows[:, 0, :-1].contiguous(), windows[:, 1, 1:].contiguous()
        if windows.shape[1] == 3:
            return PackedBatch(inputs, targets, windows[:, 2, :-1].contiguous())
        return inputs, targets
    inputs, targets = split_inputs_targets(windows)
    if text_eod_id is None:
        return inputs, targets
    return text_documents(inputs, targets, text_eod_id)


def text_documents(inputs: torch.Tensor, targets: torch.Tensor, eod_id: int) -> PackedBatch:
    """Plain text with document boundaries: a document ends with its end-of-document id, the next
    starts after it; the end id's target (the next document's first token) is not counted."""
    ends = inputs == eod_id
    documents = torch.cumsum(ends, dim=1) - ends.long()  # the end id belongs to its document
    targets = targets.masked_fill(ends, IGNORE_INDEX)
    return PackedBatch(inputs, targets, documents)
