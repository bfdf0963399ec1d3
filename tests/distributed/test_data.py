"""Data pipeline: tokenizer, packing, layout-free map-style batches, streaming, resume, bad input, Lightning."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import random
import zlib
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Sampler

from lightning_titan import TitanDataModule
from lightning_titan.data import ByteTokenizer, DataPipeline, LayoutFreeSampler, Packer, prepare
from lightning_titan.data.corpus import Source
from lightning_titan.data.tokenizer import Tokenizer, load_tokenizer
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.runtime.launch import run_on_ranks

ALPHABET = "abcdefghijklmnopqrstuvwxyz     \n.,éü—你好🚀"
LAYOUTS = [(1, 1, 1), (2, 1, 2), (1, 2, 4)]


def write_jsonl(
    path: Path, n_docs: int, seed: int, column: str = "text", max_len: int = 600
) -> list[str]:
    rng = random.Random(seed)
    texts = [
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, max_len))) for _ in range(n_docs)
    ]
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({column: text, "other": 1}) + "\n")
    return texts


def byte_stream(texts: list[str]) -> list[int]:
    """Independent reference: UTF-8 bytes of each document, then the end-of-document id 256."""
    return [t for text in texts for t in [*text.encode("utf-8"), 256]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = write_jsonl(root / "docs.jsonl", n_docs=300, seed=0)
    return root, texts


def make_dm(root: Path, cls: type[DataPipeline] = TitanDataModule, **kwargs) -> TitanDataModule:
    args = dict(
        source=str(root / "docs.jsonl"),
        cache_dir=str(root / "cache"),
        seq_len=32,
        global_batch_size=8,
        val_fraction=0.1,
        seed=3,
    )
    return cls(**{**args, **kwargs})


def ready(dm: TitanDataModule, data_rank: int = 0, data_world: int = 1) -> TitanDataModule:
    dm.bind(data_rank, data_world).setup("fit")
    return dm


# -- tokenizer and packing ---------------------------------------------------------------------------
def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "héllo wörld — 你好 🚀\n\ttabs & ünïcödé"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eod_id]) == text
    assert (tok.vocab_size, tok.eod_id) == (257, 256)


def test_tokenizer_protocol_names_what_the_pipeline_calls():
    """`prepare` keys its cache by `name` and packs with `encode_array`: the Protocol must require both,
    and the built-in tokenizer must satisfy it (the HF one is checked where transformers is installed)."""

    class Unnamed:  # everything but `name`
        vocab_size, eod_id = 257, 256

        def encode(self, text: str) -> list[int]:
            return list(text.encode("utf-8"))

        def encode_array(self, text: str) -> np.ndarray:
            return np.asarray(self.encode(text))

        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode("utf-8")

    class WithoutPackingPath(Unnamed):
        name = "partial"
        encode_array = None  # Protocol checks treat a None member as absent

    assert isinstance(ByteTokenizer(), Tokenizer)
    assert not isinstance(WithoutPackingPath(), Tokenizer)
    assert not isinstance(Unnamed(), Tokenizer)
    arr = ByteTokenizer().encode_array("héllo")
    assert arr.ndim == 1 and arr.tolist() == ByteTokenizer().encode("héllo")


def test_packer_loses_only_the_tail():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=int(n)) for n in rng.integers(0, 50, size=40)]
    window = 9
    packer, served = Packer(window, eod_id=256), []
    for doc in docs:
        packer.add(doc)
        served.append(packer.take())
    windows = np.concatenate(served)
    expected = np.concatenate([np.append(d, 256) for d in docs])
    n = len(expected) // window
    assert windows.shape == (n, window)
    assert np.array_equal(windows.ravel(), expected[: n * window])
    assert np.array_equal(packer.leftover, expected[n * window :]) and len(packer.leftover) < window


def test_prepared_corpus_packs_every_token_and_shifts_targets(corpus):
    root, texts = corpus
    dm = ready(make_dm(root))
    window = dm.seq_len + 1
    for split, rows, is_val in (
        ("train", dm.corpus.train, False),
        ("validation", dm.corpus.validation, True),
    ):
        kept = [t for t in texts if (zlib.crc32(t.encode()) < 0.1 * 2**32) == is_val]
        expected = byte_stream(kept)
        n = len(expected) // window
        stored = np.asarray(rows.with_format("numpy")["input_ids"])
        assert stored.shape == (n, window)
        assert stored.ravel().tolist() == expected[: n * window]
        assert dm.corpus.meta[split]["tail"] == len(expected) - n * window < window
    loader = dm.train_dataloader()
    inputs, targets = next(iter(loader))
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (8, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    ids = list(itertools.islice(iter(loader.sampler), 8))
    rows = torch.tensor(
        np.asarray(dm.corpus.train.with_format("numpy")[ids]["input_ids"]), dtype=torch.long
    )
    assert torch.equal(torch.cat([inputs[:, :1], targets], dim=1), rows)


def test_parquet_and_text_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = write_jsonl(tmp_path / "unused.jsonl", 40, seed=9)
    pq.write_table(pa.table({"body": texts}), tmp_path / "docs.parquet")
    dm = ready(
        TitanDataModule(
            source=str(tmp_path / "*.parquet"),
            text_column="body",
            cache_dir=str(tmp_path),
            seq_len=32,
            global_batch_size=2,
            val_fraction=0.0,
        )
    )
    expected = byte_stream(texts)
    stored = np.asarray(dm.corpus.train.with_format("numpy")["input_ids"]).ravel().tolist()
    assert stored == expected[: len(stored)] and len(expected) - len(stored) < 33
    (tmp_path / "notes.txt").write_text("first paragraph\nstill first\n\nsecond one\n\n" * 30)
    dm = ready(
        TitanDataModule(
            source=str(tmp_path / "notes.txt"),
            cache_dir=str(tmp_path),
            seq_len=16,
            global_batch_size=2,
            val_fraction=0.0,
        )
    )
    assert dm.corpus.meta["train"]["documents"] == 60  # a blank line ends a document


def test_default_corpus_is_real_text_and_cached(tmp_path):
    dm = ready(TitanDataModule(max_bytes=60_000, cache_dir=str(tmp_path), val_fraction=0.0))
    text = ByteTokenizer().decode(
        dm.corpus.train.with_format("numpy")[:200]["input_ids"].ravel().tolist()
    )
    assert "def " in text and "import" in text
    path = dm.corpus.path
    stamp = (path / "meta.json").stat().st_mtime_ns
    again = ready(TitanDataModule(max_bytes=60_000, cache_dir=str(tmp_path), val_fraction=0.0))
    assert again.corpus.path == path and (path / "meta.json").stat().st_mtime_ns == stamp


def test_cache_dir_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LIGHTNING_TITAN_CACHE", raising=False)
    assert TitanDataModule().cache_dir == os.path.expanduser(
        os.path.join("~", ".cache", "lightning_titan")
    )
    monkeypatch.setenv("LIGHTNING_TITAN_CACHE", str(tmp_path))
    assert TitanDataModule().cache_dir == str(tmp_path)


def _prepare_at_once(barrier, cache_dir: str, source: str, queue) -> None:
    barrier.wait()
    path = prepare(Source(source), ByteTokenizer(), 32, 0.1, cache_dir)
    queue.put(str(path))


@pytest.mark.timeout(120)
def test_preparation_is_safe_when_ranks_start_together(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", n_docs=200, seed=5)
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(
            target=_prepare_at_once,
            args=(barrier, str(tmp_path / "c"), str(tmp_path / "docs.jsonl"), queue),
        )
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert all(p.exitcode == 0 for p in procs)
    paths = {queue.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    packed = tmp_path / "c" / "packed"
    assert sorted(p.name for p in packed.iterdir() if not p.name.endswith(".lock")) == [
        Path(paths.pop()).name
    ]


# -- layout-free map-style batches ------------------------------------------------------------------
def _same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


def test_global_batches_are_the_same_for_every_layout(corpus):
    root, _ = corpus
    steps, B = 4, 8
    reference = rows = None
    for dp, pp, ep in LAYOUTS:
        ranks = [ParallelDims(dp, pp, ep, rank) for rank in range(dp * pp * ep)]
        ids, batches = {}, {}
        for dims in ranks:
            dm = ready(make_dm(root), dims.data_rank, dims.data_world)
            loader = dm.train_dataloader()
            b = B // dims.data_world
            ids[dims.rank] = torch.tensor(
                list(itertools.islice(iter(loader.sampler), steps * b))
            ).view(steps, b)
            batches[dims.rank] = list(itertools.islice(loader, steps))
        if (
            reference is None
        ):  # independent of the sampler: the spec's seeded permutation, sliced by B
            order = torch.randperm(len(dm.corpus.train), generator=torch.Generator().manual_seed(3))
            reference = [order[k * B : (k + 1) * B] for k in range(steps)]
            rows = torch.tensor(
                np.asarray(dm.corpus.train.with_format("numpy")["input_ids"]), dtype=torch.long
            )
            assert not torch.equal(reference[0].sort().values, reference[1].sort().values)
        first_stages = sorted((d.data_rank, d.rank) for d in ranks if d.is_first_stage)
        for k in range(steps):
            step_ids = torch.cat([ids[rank][k] for _, rank in first_stages])
            assert torch.equal(step_ids, reference[k]), (dp, pp, ep, k)
            for dims in ranks:
                inputs, targets = batches[dims.rank][k]
                assert torch.equal(torch.cat([inputs[:, :1], targets], 1), rows[ids[dims.rank][k]])
        for dims in ranks:  # every stage of one pipeline reads the same batches
            first = dims.rank_of(dims.dp_rank, 0, dims.ep_rank)
            assert _same_batches(batches[dims.rank], batches[first])


def test_epochs_reshuffle_and_drop_the_partial_tail():
    sampler = LayoutFreeSampler(
        num_sequences=43, global_batch_size=8, data_rank=1, data_world=2, seed=7
    )
    assert len(sampler) == 5 * 4
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert len(epoch0) == len(epoch1) == 20 and epoch0 != epoch1
    order = torch.randperm(43, generator=torch.Generator().manual_seed(8))
    assert epoch1 == torch.cat([order[k * 8 + 4 : k * 8 + 8] for k in range(5)]).tolist()


# -- resume -----------------------------------------------------------------------------------------
def test_map_style_resume_serves_exactly_the_next_batch(corpus):
    root, _ = corpus
    reference = ready(make_dm(root), 1, 2)
    loader = reference.train_dataloader()
    per_epoch = len(loader)
    expected = list(loader)  # epoch 0
    loader.sampler.set_epoch(1)
    expected += list(itertools.islice(loader, 3))
    for k in (0, 5, per_epoch - 1, per_epoch, per_epoch + 2):
        dm = ready(make_dm(root), 1, 2)
        loader = dm.train_dataloader()
        consumed = list(itertools.islice(loader, min(k, per_epoch)))
        if k >= per_epoch:  # Lightning calls set_epoch at each epoch start
            loader.sampler.set_epoch(1)
            consumed += list(itertools.islice(loader, k - per_epoch))
        state = dm.state_dict()
        assert state["epoch"] * per_epoch + state["batches_in_epoch"] == k
        resumed = make_dm(root)
        resumed.load_state_dict(state)
        ready(resumed, 1, 2)
        loader = resumed.train_dataloader()
        if k >= per_epoch:
            loader.sampler.set_epoch(1)
        first = next(iter(loader))
        assert torch.equal(first[0], expected[k][0]) and torch.equal(first[1], expected[k][1]), k


def test_the_pipeline_without_lightning_serves_the_data_modules_batches(corpus):
    """DataPipeline, no Lightning in it, serves the batches TitanDataModule serves and saves the same
    position: the Lightning module adds only what it reads off a Trainer."""
    root, _ = corpus
    pipeline, module = ready(make_dm(root, DataPipeline), 1, 2), ready(make_dm(root), 1, 2)
    assert not isinstance(pipeline, TitanDataModule)
    got = list(itertools.islice(pipeline.train_dataloader(), 4))
    want = list(itertools.islice(module.train_dataloader(), 4))
    for (x, y), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy)
    assert pipeline.state_dict() == module.state_dict() != {}
    resumed = make_dm(root)  # from the pipeline's position: the fifth batch
    resumed.load_state_dict(pipeline.state_dict())
    following = next(iter(ready(resumed, 1, 2).train_dataloader()))
    fifth = list(itertools.islice(ready(make_dm(root), 1, 2).train_dataloader(), 5))[4]
    assert torch.equal(following[0], fifth[0]) and torch.equal(following[1], fifth[1])


def test_map_style_resume_under_another_layout(corpus):
    root, _ = corpus
    dm = ready(make_dm(root), 0, 2)
    list(itertools.islice(dm.train_dataloader(), 6))
    state = dm.state_dict()
    full = ready(make_dm(root), 0, 1).train_dataloader()
    expected = list(itertools.islice(full, 7))[6][0]
    parts = []
    for r in range(4):
        other = make_dm(root)
        other.load_state_dict(state)
        parts.append(next(iter(ready(other, r, 4).train_dataloader()))[0])
    assert torch.equal(torch.cat(parts), expected)


def test_resume_with_another_global_batch_raises(corpus):
    root, _ = corpus
    state = ready(make_dm(root)).state_dict()
    with pytest.raises(ValueError, match="global_batch_size=8.*global_batch_size=16"):
        make_dm(root, global_batch_size=16).load_state_dict(state)


# -- streaming --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uneven_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    files, texts = [], []
    for i, n_docs in enumerate([7, 2, 11]):
        files.append(str(root / f"part{i}.jsonl"))
        texts += write_jsonl(Path(files[-1]), n_docs, seed=10 + i, max_len=120)
    return root, files, texts


def make_stream_dm(root: Path, files: list[str], **kwargs) -> TitanDataModule:
    args = dict(
        source=files,
        streaming=True,
        seq_len=16,
        global_batch_size=4,
        shuffle_buffer=3,
        val_fraction=0.0,
        steps_per_epoch=5,
        cache_dir=str(root / "cache"),
        seed=1,
    )
    return TitanDataModule(**{**args, **kwargs})


def test_streaming_ranks_serve_equal_batch_counts(uneven_files):
    root, files, _ = uneven_files
    for world in (2, 4):
        counts = []
        for r in range(world):
            loader = ready(make_stream_dm(root, files), r, world).train_dataloader()
            epochs = [
                list(loader) for _ in range(3)
            ]  # shards of 7/2/11 docs run out at different times
            assert all(x.shape == (4 // world, 16) for epoch in epochs for x, _ in epoch)
            counts.append([len(e) for e in epochs])
        assert counts == [[5, 5, 5]] * world
        endless = ready(
            make_stream_dm(root, files, steps_per_epoch=None), world - 1, world
        ).train_dataloader()
        assert len(list(itertools.islice(endless, 40))) == 40


def test_streaming_pass_serves_every_document_once(uneven_files):
    root, files, texts = uneven_files
    dm = ready(
        make_stream_dm(root, files, global_batch_size=1, steps_per_epoch=None, shuffle_buffer=4)
    )
    n = len(byte_stream(texts)) // 17  # the full windows of one pass over the 20 documents
    windows = [torch.cat([x[0, :1], y[0]]) for x, y in itertools.islice(dm.train_dataloader(), n)]
    served = bytes(t if t != 256 else 0 for t in torch.cat(windows).tolist()).split(b"\0")
    docs = [piece.decode("utf-8") for piece in served[:-1]]  # the last piece is cut by the tail
    remaining = list(texts)
    for doc in docs:
        remaining.remove(doc)  # raises if a document was invented or served twice in the pass
    assert len(remaining) <= 1 and docs != texts[: len(docs)]  # all but the tail, shuffled


def test_streaming_validation_restarts_with_a_fixed_count(uneven_files):
    root, files, _ = uneven_files
    for r in range(2):
        dm = ready(make_stream_dm(root, files, val_fraction=0.5, val_batches=3), r, 2)
        loader = dm.val_dataloader()
        first, second = [x for x, _ in loader], [x for x, _ in loader]
        assert len(first) == 3 and all(
            torch.equal(a, b) for a, b in zip(first, second, strict=True)
        )


def test_streaming_resume_serves_exactly_the_next_batch(uneven_files):
    root, files, _ = uneven_files
    reference = ready(make_stream_dm(root, files), 0, 2)
    loader = reference.train_dataloader()
    expected = [x for _ in range(5) for x, _ in loader]
    assert loader.dataset.position.epoch >= 1  # the checks below cross a pass boundary
    for k in (0, 3, 7, 16, 23):
        dm = ready(make_stream_dm(root, files), 0, 2)
        loader, consumed = dm.train_dataloader(), 0
        while consumed < k:
            consumed += len(list(itertools.islice(loader, min(5, k - consumed))))
        state = dm.state_dict()
        resumed = make_stream_dm(root, files)
        resumed.load_state_dict(state)
        first = next(iter(ready(resumed, 0, 2).train_dataloader()))[0]
        assert torch.equal(first, expected[k]), k
    with pytest.raises(ValueError, match="saved with 2 data ranks.*this run has 4"):
        other = make_stream_dm(root, files)
        other.load_state_dict(state)
        ready(other, 0, 4).train_dataloader()


def _stream_checkpoint_on_ranks(rank: int, world: int, root: str, files: list[str]) -> dict:
    torch.set_num_threads(1)
    dm = ready(make_stream_dm(Path(root), files), rank, world)
    loader = dm.train_dataloader()
    list(itertools.islice(loader, 4))
    state = dm.state_dict()  # collective: every data rank's stream goes into the one checkpoint
    expected = next(iter(loader))[0]
    resumed = make_stream_dm(Path(root), files)
    resumed.load_state_dict(state)
    got = next(iter(ready(resumed, rank, world).train_dataloader()))[0]
    return {"state": state, "resumed_exactly": torch.equal(got, expected)}


@pytest.mark.timeout(120)
def test_streaming_checkpoint_holds_every_data_rank(uneven_files):
    root, files, _ = uneven_files
    results = run_on_ranks(
        _stream_checkpoint_on_ranks, 2, str(root), files, timeout_s=100, start_method="fork"
    )
    assert all(r["resumed_exactly"] for r in results)
    assert (
        results[0]["state"] == results[1]["state"]
    )  # rank 0 writes the file: it has rank 1's stream
    assert sorted(results[0]["state"]["streams"]) == [0, 1]
    assert results[0]["state"]["streams"][0] != results[0]["state"]["streams"][1]


# -- bad input --------------------------------------------------------------------------------------
def test_bad_inputs_raise_in_setup(tmp_path, corpus):
    root, _ = corpus
    write_jsonl(tmp_path / "body.jsonl", 20, seed=1, column="body")
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"text_column='text'.*\['body', 'other'\]"):
            ready(
                TitanDataModule(
                    source=str(tmp_path / "body.jsonl"),
                    cache_dir=str(tmp_path),
                    streaming=streaming,
                )
            )
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no documents"):
        ready(TitanDataModule(source=str(tmp_path / "empty.jsonl"), cache_dir=str(tmp_path)))
    write_jsonl(tmp_path / "small.jsonl", 2, seed=2, max_len=40)
    with pytest.raises(
        ValueError, match=r"training split packs into \d+ sequences.*global_batch_size=64"
    ):
        ready(
            TitanDataModule(
                source=str(tmp_path / "small.jsonl"), cache_dir=str(tmp_path), global_batch_size=64
            )
        )
    with pytest.raises(ValueError, match="validation split .*raise val_fraction"):
        ready(make_dm(root, val_fraction=0.001))
    with pytest.raises(ValueError, match="global_batch_size=8 is not divisible .* dp\\*ep=3"):
        ready(make_dm(root), 0, 3)
    with pytest.raises(ValueError, match="seq_len=0"):
        make_dm(root, seq_len=0)
    with pytest.raises(ValueError, match="does not exist"):
        TitanDataModule(source=str(tmp_path / "missing" / "x.jsonl"), cache_dir=str(tmp_path)).bind(
            0, 1
        ).setup()
    dm = make_dm(root)
    dm.check_model(vocab_size=257, seq_len=64)
    with pytest.raises(ValueError, match="257 ids but the model's vocab_size is 100"):
        dm.check_model(vocab_size=100, seq_len=64)
    with pytest.raises(ValueError, match="seq_len=32 exceeds the model's seq_len=16"):
        dm.check_model(vocab_size=257, seq_len=16)


def test_hf_tokenizer_by_local_path_or_a_clear_error(tmp_path):
    """With transformers: a Hugging Face tokenizer from a local folder (our byte tokenizer in HF form, as
    `titan export` writes it) tokenises like ByteTokenizer. Without: a clear error naming the package."""
    import json

    from lightning_titan.hf.export import byte_tokenizer_files

    for name, content in byte_tokenizer_files().items():
        (tmp_path / name).write_text(json.dumps(content, ensure_ascii=False))
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="transformers"):
            _ = TitanDataModule(tokenizer=str(tmp_path)).vocab_size
        return
    hf, byte = load_tokenizer(str(tmp_path)), ByteTokenizer()
    assert isinstance(hf, Tokenizer) and hf.name == str(tmp_path)
    text = "def f():\n    return 'héllo ✓'\n"
    assert (hf.vocab_size, hf.eod_id) == (byte.vocab_size, byte.eod_id) == (257, 256)
    assert hf.encode(text) == byte.encode(text) == hf.encode_array(text).tolist()
    assert hf.decode(hf.encode(text)) == text
    assert TitanDataModule(tokenizer=str(tmp_path)).vocab_size == 257


# -- Lightning --------------------------------------------------------------------------------------
class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Embedding(257, 257)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.samplers: set[type] = set()

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        self.batches.append((inputs.clone(), targets.clone()))
        self.samplers.add(type(self.trainer.train_dataloader.sampler))
        return torch.nn.functional.cross_entropy(self.head(inputs).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm, max_steps, tmp, ckpt_path=None, every=None, last=False) -> Recorder:
    model = Recorder()
    callbacks = (
        [ModelCheckpoint(dirpath=tmp, every_n_train_steps=every, save_top_k=-1)] if every else []
    )
    callbacks += [ModelCheckpoint(dirpath=tmp, save_top_k=0, save_last=True)] if last else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.timeout(180)
@pytest.mark.parametrize("streaming", [False, True])
def test_lightning_feeds_batches_and_resumes_mid_epoch(tmp_path, streaming):
    texts = write_jsonl(tmp_path / "docs.jsonl", 8, seed=4, max_len=60)
    per_epoch = (len(byte_stream(texts)) // 17) // 4
    assert 2 <= per_epoch < 5  # so that 7 steps cross an epoch (map) or a pass (stream) boundary
    args = dict(
        source=str(tmp_path / "docs.jsonl"),
        cache_dir=str(tmp_path / "c"),
        seq_len=16,
        global_batch_size=4,
        val_fraction=0.0,
        streaming=streaming,
        shuffle_buffer=3,
        steps_per_epoch=None,
    )  # an endless stream: Lightning prefetches one batch ahead of training there

    full = fit(TitanDataModule(**args), 7, tmp_path)
    assert len(full.batches) == 7
    if not streaming:
        assert full.samplers == {LayoutFreeSampler}
    fit(TitanDataModule(**args), 3, tmp_path / "ck", every=3)
    ckpt = next((tmp_path / "ck").glob("*step=3.ckpt"))
    resumed = fit(TitanDataModule(**args), 7, tmp_path, ckpt_path=str(ckpt))
    assert _same_batches(resumed.batches, full.batches[3:])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("streaming", [False, True])
def test_a_longer_run_resumed_from_a_finished_one_goes_on_with_its_epoch(
    tmp_path, streaming, recwarn
):
    """A run that reached max_steps mid-epoch closed Lightning's epoch; resumed with a larger max_steps
    it serves the uninterrupted run's next batches, and Lightning knows the loader's position (no
    "not resumable" warning)."""
    texts = write_jsonl(tmp_path / "docs.jsonl", 8, seed=4, max_len=60)
    assert 2 <= (len(byte_stream(texts)) // 17) // 4 < 4  # 4 steps end inside the second epoch
    args = dict(
        source=str(tmp_path / "docs.jsonl"),
        cache_dir=str(tmp_path / "c"),
        seq_len=16,
        global_batch_size=4,
        val_fraction=0.0,
        streaming=streaming,
        shuffle_buffer=3,
        steps_per_epoch=3,  # streaming: a finite pass, which Lightning can count
    )
    full = fit(TitanDataModule(**args), 9, tmp_path)
    fit(TitanDataModule(**args), 4, tmp_path / "ck", last=True)
    last = str(tmp_path / "ck" / "last.ckpt")
    loops = torch.load(last, weights_only=False)["loops"]
    # Lightning's epoch rule: the run that reached max_steps closed its epoch
    assert loops["fit_loop"]["epoch_progress"]["current"]["completed"] == 2
    resumed = fit(TitanDataModule(**args), 9, tmp_path, ckpt_path=last)
    assert _same_batches(resumed.batches, full.batches[4:])
    assert not [w for w in recwarn if "not resumable" in str(w.message)]


def test_lightning_keeps_our_sampler_under_ddp(corpus):
    """Lightning's rule (data_connector._requires_distributed_sampler) with a DDP Trainer: our sampler is
    kept, while a plain custom sampler would be wrapped in a DistributedSamplerWrapper keyed by global rank."""
    root, _ = corpus
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    ours = ready(make_dm(root)).train_dataloader()
    assert not trainer._data_connector._requires_distributed_sampler(ours)

    class Plain(Sampler):
        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    assert trainer._data_connector._requires_distributed_sampler(
        DataLoader(range(4), sampler=Plain())
    )
