"""Map-style batches that do not depend on the layout, and the memory-mapped dataset they index."""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_titan.parallel.batching import local_batch_size


def epoch_order(num_sequences: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The order of every sequence id in one epoch: a permutation seeded by seed + epoch (or identity)."""
    if not shuffle:
        return torch.arange(num_sequences)
    return torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed + epoch))


class LayoutFreeSampler(DistributedSampler):
    """Step k's global batch is ``order[k*B:(k+1)*B]`` whatever dp, pp and ep are; data rank r reads the
    contiguous slice ``[r*b, (r+1)*b)`` of it, so every stage of one pipeline reads the same sequences.

    It subclasses ``DistributedSampler`` so that Lightning keeps it: with ``use_distributed_sampler=True``
    Lightning wraps any other sampler in a ``DistributedSamplerWrapper`` indexed by its own rank.

    Resuming at ``(epoch, start_batch)`` serves batches ``start_batch..`` of that epoch, while ``len()``
    still counts the whole epoch, as Lightning's ``batch_idx`` does when it restarts mid-epoch. The data
    epoch follows the position, not the number ``set_epoch`` is given: the first pass after a resume
    is the resumed epoch whatever Lightning calls it (a run that reached ``max_steps`` closed
    Lightning's epoch, and a longer run resumed from it counts one more), each later pass the next.
    """

    def __init__(
        self,
        num_sequences: int,
        global_batch_size: int,
        data_rank: int,
        data_world: int,
        seed: int = 0,
        shuffle: bool = True,
        epoch: int = 0,
        start_batch: int = 0,
    ) -> None:
        self.local_batch_size = local_batch_size(global_batch_size, data_world)
        super().__init__(
            range(num_sequences),  # type: ignore[arg-type]  # only its len() is used
            num_replicas=data_world,
            rank=data_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.num_sequences = num_sequences
        self.global_batch_size = global_batch_size
        self.num_batches = num_sequences // global_batch_size  # the partial tail batch is dropped
        self.epoch = epoch
        self._resume_at = (epoch, start_batch)
        self._first_pass: int | None = None  # the set_epoch number of the pass that starts there
        self._served = (epoch, start_batch)  # (epoch, batches whose indices were handed out)

    def resume(self, epoch: int, start_batch: int) -> None:
        """Serve from batch ``start_batch`` of data epoch ``epoch`` on the next pass."""
        self._resume_at, self._first_pass = (epoch, start_batch), None
        self._served = (epoch, start_batch)

    def __len__(self) -> int:
        return self.num_batches * self.local_batch_size

    def global_batch(self, step: int, epoch: int | None = None) -> torch.Tensor:
        """The B sequence ids of global step ``step`` of an epoch (the same for every layout)."""
        order = epoch_order(
            self.num_sequences, self.seed, self.epoch if epoch is None else epoch, self.shuffle
        )
        return order[step * self.global_batch_size : (step + 1) * self.global_batch_size]

    def __iter__(self) -> Iterator[int]:
        if self._first_pass is None:
            self._first_pass = self.epoch
        passes = max(0, self.epoch - self._first_pass)  # stateless: a pass begun again is the same
        epoch = self._resume_at[0] + passes
        start = self._resume_at[1] if passes == 0 else 0
        self._served = (epoch, start)
        order = epoch_order(self.num_sequences, self.seed, epoch, self.shuffle)
        b, lo = self.local_batch_size, self.rank * self.local_batch_size
        for step in range(start, self.num_batches):
            first = step * self.global_batch_size + lo
            # counted before the last index leaves, i.e. once the DataLoader has the whole batch
            self._served = (epoch, step + 1)
            yield from order[first : first + b].tolist()

    @property
    def served(self) -> tuple[int, int]:
        """(epoch, batches handed out in it): the position when nothing prefetches (num_workers=0)."""
        return self._served


class PackedSequences(Dataset):
    """Rows of one prepared split as numpy views of the memory-mapped Arrow file (no copy, no Python loop)."""

    def __init__(self, dataset: datasets.Dataset) -> None:
        self._dataset = dataset
        self._open()

    def _open(self) -> None:
        self.window = self._dataset.features["input_ids"].length
        self._chunks = self._column("input_ids")
        # instruction records (records.py) carry their labels; plain text's targets are its ids
        has_labels = "labels" in self._dataset.column_names
        self._label_chunks = self._column("labels") if has_labels else None
        # packed records: each token's document id (records.py)
        has_documents = "documents" in self._dataset.column_names
        self._document_chunks = self._column("documents") if has_documents else None
        sizes = [len(c) for c in self._chunks]
        self._starts = np.cumsum([0, *sizes])

    def _column(self, name: str) -> list[np.ndarray]:
        column = self._dataset.data.column(name)
        return [
            c.flatten().to_numpy(zero_copy_only=True).reshape(-1, self.window)
            for c in column.chunks
        ]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> np.ndarray:
        """A whole batch at once; the DataLoader calls this instead of one ``__getitem__`` per row.
        [b, S+1] ids, or [b, 2, S+1] ids and labels where the split has labels, or [b, 3, S+1]
        ids, labels and document ids where its records are packed."""
        idx = np.asarray(indices, dtype=np.int64)
        ids = self._rows(self._chunks, idx)
        if self._label_chunks is None:
            return ids
        rows = [ids.astype(np.int64), self._rows(self._label_chunks, idx).astype(np.int64)]
        if self._document_chunks is not None:
            rows.append(self._rows(self._document_chunks, idx).astype(np.int64))
        return np.stack(rows, axis=1)

    def _rows(self, chunks: list[np.ndarray], idx: np.ndarray) -> np.ndarray:
        if len(chunks) == 1:
            return chunks[0][idx]
        chunk = np.searchsorted(self._starts, idx, side="right") - 1
        out = np.empty((len(idx), self.window), dtype=chunks[0].dtype)
        for c in np.unique(chunk):
            mask = chunk == c
            out[mask] = chunks[c][idx[mask] - self._starts[c]]
        return out

    def __getstate__(self) -> dict:
        # workers re-open the memory map instead of receiving a pickled copy of the data
        return {"_dataset": self._dataset}

    def __setstate__(self, state: dict) -> None:
        self._dataset = state["_dataset"]
        self._open()
