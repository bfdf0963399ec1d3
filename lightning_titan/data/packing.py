"""Packing: documents joined by the end-of-document id, cut into windows of S+1 tokens; and the
batches a loader serves (``collate_windows``)."""

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
