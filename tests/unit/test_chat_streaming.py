"""Streaming chat and prompt/completion records: the windows equal the map-style preparation's for
the same records (ids, -100 labels, document ids; packed or one a window), a resumed stream serves
the uninterrupted one's next batches, and a malformed record is named as the stream reaches it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_titan.data import DataPipeline
from lightning_titan.data.corpus import Source
from lightning_titan.data.packing import RecordPacker, collate_windows
from lightning_titan.data.records import check_records
from lightning_titan.data.sampler import PackedSequences
from lightning_titan.lightning.datamodule import TitanDataModule
from lightning_titan.parallel.batching import PackedBatch
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX

EOD = 256  # the byte tokenizer's end-of-document id


def chats(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        turns = [{"role": "user", "content": f"q{i}" + "u" * int(rng.integers(0, 6))}]
        turns.append({"role": "assistant", "content": "a" * int(rng.integers(1, 9))})
        if i % 3 == 0:  # a second exchange: two trained turns in one record
            turns += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "b"}]
        rows.append({"messages": turns})
    return rows


def pairs(n: int) -> list[dict]:
    return [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}" * (1 + i % 4)} for i in range(n)]


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pipeline(source: Path | list[str], cache: Path, **kwargs) -> DataPipeline:
    args = dict(seq_len=96, global_batch_size=1, val_fraction=0.0, tokenizer="byte")
    args.update(cache_dir=str(cache), shuffle_buffer=1)
    source = [str(s) for s in source] if isinstance(source, list) else str(source)
    return DataPipeline(source=source, **{**args, **kwargs})


def ready(pipe: DataPipeline, data_rank: int = 0, data_world: int = 1) -> DataPipeline:
    pipe.bind(data_rank, data_world)
    pipe.prepare_data()
    pipe.setup()
    return pipe


CASES = {  # file, rows, options: every format, packed or not, both train_on, a held-out share
    "chat_packed": ("c.jsonl", chats(40), dict(val_fraction=0.3)),
    "chat_unpacked_all": ("c.jsonl", chats(24), dict(pack=False, train_on="all")),
    "pairs_parquet_packed": ("p.parquet", pairs(80), dict(val_fraction=0.3)),
    "pairs_unpacked": ("p.jsonl", pairs(16), dict(pack=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_records_are_the_map_style_windows(tmp_path, case):
    """One data rank, one file, documents unshuffled (shuffle_buffer=1): the stream lays the same
    records into the same windows, in the file's order, as the map-style preparation; only the
    last open window differs (the stream fills it from its next pass)."""
    name, rows, options = CASES[case]
    source = write(tmp_path / name, rows)
    mapped = ready(pipeline(source, tmp_path / "cache", **options))
    assert mapped.corpus is not None
    windows = PackedSequences(mapped.corpus.train)
    want = [torch.from_numpy(windows[i].astype(np.int64)) for i in range(len(windows))]
    assert len(want) >= 6 and want[0].shape[0] == (2 if options.get("pack") is False else 3)
    stream = ready(pipeline(source, tmp_path / "cache", streaming=True, **options))
    loader = stream.train_dataloader()
    # the loader's batch is the map-style one: a PackedBatch packed, the pair one a window
    batch = next(iter(loader))
    expected = collate_windows([want[0]])
    assert type(batch) is type(expected) and isinstance(batch, PackedBatch) != ("unpacked" in case)
    for a, b in zip(batch, expected, strict=True):
        assert torch.equal(a, b)
    # the windows after it (an iter() goes on where the last stopped)
    full = len(want) if options.get("pack") is False else len(want) - 1
    got = list(itertools.islice(iter(loader.dataset), full - 1))
    for i in range(1, full):
        assert torch.equal(got[i - 1], want[i]), (case, i)
    if options.get("val_fraction"):  # the held-out records: the same hash, the same windows
        held_out = PackedSequences(mapped.corpus.validation)
        assert len(held_out) >= 2
        served = next(iter(stream.val_dataloader()))
        for a, b in zip(served, collate_windows([held_out[0].astype(np.int64)]), strict=True):
            assert torch.equal(a, b)
    assert (batch[1] == IGNORE_INDEX).any() and (batch[1] != IGNORE_INDEX).any()


def test_a_record_packer_rebuilt_from_its_leftover_goes_on_alike():
    """Taken or not, the windows ready and the open one are the leftover; a packer rebuilt from it
    at any point lays the remaining records as the first one does."""
    rng = np.random.default_rng(0)
    records = [rng.integers(0, 256, int(n)) for n in rng.integers(1, 12, 40)]
    for pack in (True, False):
        whole = RecordPacker(16, EOD, pack)
        for ids in records:
            whole.add(ids, ids)
        whole.flush()
        want = whole.take()
        for cut in range(len(records)):
            first = RecordPacker(16, EOD, pack)
            for ids in records[:cut]:
                first.add(ids, ids)  # not taken: ready windows wait in the leftover
            then = RecordPacker(16, EOD, pack, first.leftover)
            for ids in records[cut:]:
                then.add(ids, ids)
            then.flush()
            assert np.array_equal(then.take(), want), (pack, cut)


def _take(pipe: DataPipeline, n: int) -> list:
    return list(itertools.islice(pipe.train_dataloader(), n))


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("pack", [True, False])
def test_a_resumed_record_stream_serves_the_uninterrupted_batches(tmp_path, pack):
    """Two data ranks, three files, shuffled in windows: stopped after k batches, the position
    (the stream at the window's start, records taken, the packer's leftover ids, labels and
    document ids) restored in a new pipeline serves the uninterrupted stream's next batches, across
    a pass boundary."""
    files = [str(write(tmp_path / f"part{i}.jsonl", chats(9 + 4 * i, seed=i))) for i in range(3)]
    kw = dict(streaming=True, shuffle_buffer=3, global_batch_size=4, seed=3, pack=pack)
    for rank in range(2):
        reference = ready(pipeline(files, tmp_path / "cache", **kw), rank, 2)
        expected = _take(reference, 16)
        assert reference._train_stream is not None
        assert reference._train_stream.position.epoch >= 1  # the checks cross a pass boundary
        rows = set()
        for k in (1, 2, 5, 9, 13):
            pipe = ready(pipeline(files, tmp_path / "cache", **kw), rank, 2)
            _take(pipe, k)
            state = pipe.state_dict()
            rows.add(np.asarray(state["streams"][rank]["position"]["leftover"]).shape[0])
            resumed = pipeline(files, tmp_path / "cache", **kw)
            json.dumps(state)  # plain types only: it goes in checkpoints
            resumed.load_state_dict(state)
            again = _take(ready(resumed, rank, 2), 3)
            assert all(_same(a, b) for a, b in zip(again, expected[k : k + 3], strict=True)), k
        assert rows == {3 if pack else 2}  # a leftover of ids, labels (and document ids) each time


def test_a_malformed_record_is_named_as_the_stream_reaches_it(tmp_path, capfd):
    """Named by file and line (parquet: row) when read; the pre-launch check does not read a stream.
    A record longer than the window is skipped, named once and counted."""
    good = chats(6)
    bad = {"messages": [{"role": "user", "content": 3}]}
    cases = {
        "chat.jsonl": (
            [*good, bad],
            r":7: this chat record turn 0 \(user\) has content int 3; content is a string; fix",
        ),
        "pc.parquet": (
            [*pairs(4), {"prompt": "p", "completion": ""}],
            r" row 4: this prompt_completion record has an empty completion",
        ),
    }
    for name, (rows, message) in cases.items():
        source = write(tmp_path / name, rows)
        check_records(Source(str(source)), str(tmp_path / "cache"), streaming=True)  # no read
        pipe = ready(pipeline(source, tmp_path / "cache", streaming=True))  # reads the first
        with pytest.raises(ValueError, match=f"^{source}{message}"):
            _take(pipe, 40)
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps(good[0]) + "\n\n" + "{not json\n")
    with pytest.raises(ValueError, match=rf"^{lines}:3 is not JSON \(.*\); give one JSON object"):
        _take(ready(pipeline(lines, tmp_path / "cache", streaming=True)), 40)
    long = {"prompt": "p" * 40, "completion": "c"}
    source = write(tmp_path / "long.jsonl", [*pairs(3), long, *pairs(3), long, *pairs(4)])
    pipe = ready(pipeline(source, tmp_path / "cache", streaming=True, seq_len=32))
    loader = pipe.train_dataloader()
    list(itertools.islice(loader, 4))  # past both long records
    assert loader.dataset.documents.skipped_too_long == 2  # type: ignore[attr-defined]
    err = capfd.readouterr().err
    assert err.count("longer than seq_len + 1 = 33 tokens") == 1 and f"{source}:4, 42 tokens" in err


class Recorder(L.LightningModule):
    """Keeps each batch it trains on (the loss a stand-in: the data is what is tested)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Embedding(257, 257)
        self.batches: list[tuple[torch.Tensor, ...]] = []

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, PackedBatch)
        self.batches.append(tuple(t.clone() for t in batch))
        logits = self.head(batch.inputs).flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, batch.targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm: TitanDataModule, max_steps: int, root: Path, ckpt_path: str | None = None) -> Recorder:
    model, every = Recorder(), ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[every],
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.timeout(120)
def test_lightning_trains_on_a_chat_stream_and_resumes_from_its_checkpoint(tmp_path):
    """TitanDataModule(streaming=True) on a chat file under a Trainer: packed batches, and a run
    resumed from its step-3 checkpoint trains on the uninterrupted run's batches 3 to 6."""
    source = write(tmp_path / "c.jsonl", chats(30))
    args = dict(source=str(source), cache_dir=str(tmp_path / "cache"), seq_len=96, tokenizer="byte",
                global_batch_size=2, val_fraction=0.0, streaming=True, shuffle_buffer=4)  # fmt: skip
    full = fit(TitanDataModule(**args), 6, tmp_path / "full")
    assert len(full.batches) == 6
    ckpt = next((tmp_path / "full").glob("*step=3.ckpt"))
    resumed = fit(TitanDataModule(**args), 6, tmp_path / "again", ckpt_path=str(ckpt))
    assert len(resumed.batches) == 3
    assert all(_same(a, b) for a, b in zip(resumed.batches, full.batches[3:], strict=True))
