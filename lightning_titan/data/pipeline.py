"""The data pipeline, without Lightning: text -> tokens -> packed S+1 windows -> (inputs, targets)
batches for each data rank, and the position to resume them from.

Map-style (default): the corpus is prepared once into a memory-mapped cache and step k's global batch is
the same B sequences for every layout (see sampler.py). Streaming: see streaming.py.
``TitanDataModule`` (``lightning/datamodule.py``) is this pipeline as a LightningDataModule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from typing_extensions import Self

from lightning_titan.data.chat import check_options
from lightning_titan.data.checks import (
    check_args,
    check_counts,
    check_model_fits,
    check_resume,
    check_split_sizes,
)
from lightning_titan.data.corpus import Source, default_corpus_texts
from lightning_titan.data.loader import ResumableLoader
from lightning_titan.data.packing import collate_windows
from lightning_titan.data.prepare import PackedCorpus, default_cache_dir, prepare, prepare_and_load
from lightning_titan.data.record_stream import source_stream, stream_documents
from lightning_titan.data.records import resolve_format
from lightning_titan.data.sampler import LayoutFreeSampler, PackedSequences
from lightning_titan.data.streaming import (
    Documents,
    StreamingWindows,
    check_rank_shard,
    rank_stream,
)
from lightning_titan.data.tokenizer import Tokenizer, load_tokenizer, resolve_tokenizer
from lightning_titan.parallel.batching import local_batch_size


class DataPipeline:
    """Args:
    seq_len: tokens per training sequence S (windows of S+1 give inputs and shifted targets).
    global_batch_size: sequences per optimizer step over all data ranks; each rank gets B / (dp*ep).
    source: None for the embedded default corpus (this Python's standard library sources); else a
        Hugging Face dataset name, or local file(s) / folder / glob of .txt, .json(l) or .parquet.
    text_column: the column holding the text.
    source_config: the Hugging Face dataset's config name, if it has several.
    source_split: the Hugging Face split to read.
    tokenizer: "byte" (built in, vocab 257), a Hugging Face tokenizer name or path, or "auto": the
        tokenizer files of the model's Hugging Face folder (TitanLM ``init_from``) when it has them,
        else "byte".
    seed: seeds the epoch permutations (map-style) and the shuffles (streaming).
    val_fraction: share of documents held out for validation (chosen by a hash of their text); 0: none.
    streaming: read the source as a stream split by data rank (batches then depend on the layout).
    shuffle_buffer: streaming only: documents shuffled together.
    steps_per_epoch: streaming only: batches per epoch (None: endless, bound training with max_steps).
    val_batches: streaming only: validation batches per run.
    max_bytes: cap on the source's text, whole documents in order (map-style; the default corpus, 4 MB
        unless set, in both modes).
    num_workers: DataLoader worker processes (map-style only).
    num_proc: processes for tokenising while preparing (None: by size and cores).
    cache_dir: prepared data; default $LIGHTNING_TITAN_CACHE or ~/.cache/lightning_titan.
    format: "auto" (from the columns: text_column, else ``messages``, else ``prompt`` and
        ``completion``), "text", "chat" or "prompt_completion" (instruction records, packed
        by default (``pack``); docs/finetuning.md).
    train_on: instruction records: "responses" (the assistant turns / the completion are the only
        targets) or "all" (every token).
    pack: several documents a sequence, each attending only to itself with positions from 0
        (None: the format's default: chat and prompt/completion records packed, text not; text
        packed is cut into documents at its end-of-document ids; docs/finetuning.md).
    """

    def __init__(
        self,
        seq_len: int = 64,
        global_batch_size: int = 8,
        source: str | list[str] | None = None,
        text_column: str = "text",
        source_config: str | None = None,
        source_split: str = "train",
        tokenizer: str = "auto",
        seed: int = 0,
        val_fraction: float = 0.01,
        streaming: bool = False,
        shuffle_buffer: int = 1000,
        steps_per_epoch: int | None = None,
        val_batches: int = 4,
        max_bytes: int | None = None,
        num_workers: int = 0,
        num_proc: int | None = None,
        cache_dir: str | None = None,
        format: str = "auto",
        train_on: str = "responses",
        pack: bool | None = None,
    ) -> None:
        super().__init__()  # cooperative: in TitanDataModule, the LightningDataModule's
        check_args(seq_len, global_batch_size, val_fraction, streaming, num_workers, shuffle_buffer)
        check_counts(max_bytes, steps_per_epoch, val_batches)
        check_options(format, train_on)
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.val_fraction, self.streaming, self.num_workers = val_fraction, streaming, num_workers
        self.shuffle_buffer, self.steps_per_epoch = shuffle_buffer, steps_per_epoch
        self.val_batches, self.num_proc = val_batches, num_proc
        self.cache_dir = cache_dir or default_cache_dir()
        self.tokenizer_spec = tokenizer
        self.model_folder: str | None = None  # TitanLM's init_from (use_model_folder)
        if pack is not None and not isinstance(pack, bool):
            raise ValueError(f"pack={pack!r} must be true, false or null (the format's default)")
        self.src = Source(
            source, text_column, source_config, source_split, max_bytes, format, train_on, pack
        )
        self.corpus: PackedCorpus | None = None
        self._bound: tuple[int, int] | None = None
        self._layout: tuple[int, int] | None = None
        self._pending: dict | None = (
            None  # a loaded position, applied when the train loader is built
        )
        self._train_sampler: LayoutFreeSampler | None = None
        self._train_stream: StreamingWindows | None = None

    # -- layout -------------------------------------------------------------------------------
    def bind(self, data_rank: int, data_world: int) -> Self:
        """Fix this pipeline's data rank and world (tests, or use without a Trainer)."""
        if not 0 <= data_rank < data_world:
            raise ValueError(f"data_rank={data_rank} must lie in [0, data_world={data_world})")
        self._bound = (data_rank, data_world)
        return self

    def _unbound_layout(self) -> tuple[int, int]:
        """The data rank and world without ``bind``: one rank here; TitanDataModule asks its Trainer."""
        return 0, 1

    @property
    def data_rank(self) -> int:
        return self._require_layout()[0]

    @property
    def data_world(self) -> int:
        return self._require_layout()[1]

    @property
    def local_batch_size(self) -> int:
        return local_batch_size(self.global_batch_size, self.data_world)

    def _require_layout(self) -> tuple[int, int]:
        if self._layout is None:
            raise RuntimeError("the data layout is known after setup()")
        return self._layout

    def _require_corpus(self) -> PackedCorpus:
        if self.corpus is None:
            raise RuntimeError("the prepared corpus is loaded by setup() (map-style only)")
        return self.corpus

    # -- tokenizer and model --------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return resolve_tokenizer(self.tokenizer_spec, self.model_folder)

    def use_model_folder(self, folder: str | None) -> None:
        """The Hugging Face folder the model starts from (TitanLM calls this with ``init_from`` before
        the data is checked or prepared): tokenizer="auto" then takes its tokenizer."""
        self.model_folder = folder
        self.__dict__.pop("tokenizer", None)  # resolved again

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_name)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def check_model(self, vocab_size: int, seq_len: int) -> None:
        """Raise unless a model with this vocabulary and context can take these batches."""
        check_model_fits(self.tokenizer_name, self.vocab_size, self.seq_len, vocab_size, seq_len)

    # -- the steps of a run (Lightning's hook names) -------------------------------------------
    def prepare_data(self) -> None:
        """Tokenise and pack the corpus into the cache (map-style; once per machine under Lightning)."""
        if not self.streaming:
            self._prepare()

    def setup(self, stage: str | None = None) -> None:
        """Fix the data layout, and load the prepared corpus (map-style) or check this rank's share of
        the stream."""
        self._layout = self._bound or self._unbound_layout()
        local_batch_size(self.global_batch_size, self.data_world)
        if self.streaming:
            documents, rank = self._documents(), (self.data_rank, self.data_world)
            check_rank_shard(self._make_stream(0), self.src, documents, self.val_fraction, *rank)
        else:
            tok, cache = self.tokenizer, self.cache_dir
            args = (self.src, tok, self.seq_len, self.val_fraction, cache, self.num_proc)
            self.corpus = prepare_and_load(*args)
            check_split_sizes(self.corpus, self.global_batch_size, self.val_fraction)

    def train_dataloader(self) -> DataLoader:
        if self.streaming:
            self._train_stream = self._stream(validation=False)
            if self._pending is not None:
                self._train_stream.load_state_dict(self._own_stream_state(self._pending))
            return self._loader(self._train_stream, resumable=True)
        epoch, start = self._map_position(self._pending) if self._pending else (0, 0)
        self._train_sampler = LayoutFreeSampler(
            len(self._require_corpus().train),
            self.global_batch_size,
            self.data_rank,
            self.data_world,
            seed=self.seed,
            epoch=epoch,
            start_batch=start,
        )
        return self._loader(
            PackedSequences(self._require_corpus().train), self._train_sampler, resumable=True
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_fraction == 0:
            return []
        if self.streaming:
            return self._loader(self._stream(validation=True))
        n = len(self._require_corpus().validation)
        sampler = LayoutFreeSampler(
            n,
            self.global_batch_size,
            self.data_rank,
            self.data_world,
            seed=self.seed,
            shuffle=False,
        )
        return self._loader(PackedSequences(self._require_corpus().validation), sampler)

    def test_dataloader(self) -> DataLoader | list:
        """``titan test``: the held-out documents, as validation sees them (the corpus has one held-out
        split; Trainer ``limit_test_batches`` caps it)."""
        return self.val_dataloader()

    # -- resumable position ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data position; Lightning puts it in checkpoints. Map-style it is the same on every rank."""
        if self._layout is None:
            return {}
        state = {"mode": self._mode, "global_batch_size": self.global_batch_size, "seed": self.seed}
        total = self._consumed()
        if not self.streaming:
            # the position is `batches`; the epoch and batch in it are derived (and read by older ones)
            epoch, in_epoch = divmod(total, self._batches_per_epoch())
            state.update(
                batches=total,
                epoch=epoch,
                batches_in_epoch=in_epoch,
                num_sequences=len(self._require_corpus().train),
            )
            return state
        stream = self._train_stream
        own = stream.state_dict(total) if stream is not None else {"batches": 0, "position": {}}
        streams = {self.data_rank: own}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank dumps the checkpoint together, rank 0 writes it: it must hold every rank's stream
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.data_rank, own))
            streams = dict(gathered)
        state.update(data_world=self.data_world, batches=total, streams=streams)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            check_resume(state, self._mode, self.global_batch_size, self.seed)
            self._pending = dict(state)

    def _consumed(self) -> int:
        """Global batches training has consumed since it began, over every epoch: the data position
        (what the loader has served, exact with num_workers=0). TitanDataModule reads its fitting
        Trainer's loop instead."""
        if self.streaming:
            return self._train_stream.batches_served if self._train_stream is not None else 0
        if self._train_sampler is None:
            if not self._pending:
                return 0
            epoch, start = self._map_position(self._pending)
            return epoch * self._batches_per_epoch() + start
        epoch, in_epoch = self._train_sampler.served
        return epoch * self._train_sampler.num_batches + in_epoch

    def _batches_per_epoch(self) -> int:
        return len(self._require_corpus().train) // self.global_batch_size

    def _map_position(self, state: dict) -> tuple[int, int]:
        """(data epoch, batch in it) to serve next from a saved map-style state."""
        train = self._require_corpus().train
        if state["num_sequences"] != len(train):
            raise ValueError(
                f"the data state was saved for a corpus of {state['num_sequences']} training sequences, this "
                f"one has {len(train)}; resume with the same source, tokenizer, seq_len and cap"
            )
        per_epoch = self._batches_per_epoch()
        batches = state.get("batches", state["epoch"] * per_epoch + state["batches_in_epoch"])
        return divmod(int(batches), per_epoch)

    def _resume_train(self, batches: int) -> None:
        """The train loader's position as Lightning gives it back (``ResumableLoader``): serve from
        there. The data module's own state, restored before the loader was built, holds the same."""
        if self.streaming:
            served = self._train_stream.batches_served if self._train_stream is not None else 0
            if served != batches:  # the stream's place is per rank, in the data module's state
                raise ValueError(
                    f"the checkpoint's loop consumed {batches} batches, its data state {served}: "
                    "resume from a checkpoint this tool wrote whole (the data module's state included)"
                )
        elif self._train_sampler is not None:
            self._train_sampler.resume(*divmod(batches, self._train_sampler.num_batches))

    def _own_stream_state(self, state: dict) -> dict:
        if state["data_world"] != self.data_world:
            raise ValueError(
                f"the streaming state was saved with {state['data_world']} data ranks (dp*ep), this run has "
                f"{self.data_world}; streaming batches depend on the layout: resume with the same dp*ep, "
                "or train in map-style mode (streaming=False) to change the layout"
            )
        return state["streams"][self.data_rank]

    # -- building blocks ------------------------------------------------------------------------
    @property
    def _mode(self) -> str:
        return "streaming" if self.streaming else "map"

    def _prepare(self) -> Path:
        tok, cache = self.tokenizer, self.cache_dir
        return prepare(self.src, tok, self.seq_len, self.val_fraction, cache, self.num_proc)

    def _loader(
        self, dataset: Dataset, sampler: LayoutFreeSampler | None = None, resumable: bool = False
    ) -> DataLoader:
        workers = 0 if self.streaming else self.num_workers
        collate: Callable = collate_windows
        text = (
            self._stream_format == "text"
            if self.streaming
            else "format" not in self._require_corpus().meta
        )
        if self.src.pack and text:  # plain text cut into documents at its end ids
            collate = functools.partial(collate_windows, text_eod_id=self.tokenizer.eod_id)
        kwargs: dict[str, Any] = dict(
            batch_size=self.local_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=workers,
            collate_fn=collate,
            persistent_workers=workers > 0,
        )
        if resumable:  # the train loader: Lightning saves and restores its position
            return ResumableLoader(
                dataset, position=self._consumed, resume=self._resume_train, **kwargs
            )
        return DataLoader(dataset, **kwargs)

    def _stream(self, validation: bool) -> StreamingWindows:
        return StreamingWindows(
            make_stream=self._make_stream,
            documents=self._documents(),
            seq_len=self.seq_len,
            local_batch_size=self.local_batch_size,
            validation=validation,
            val_fraction=self.val_fraction,
            seed=self.seed,
            data_rank=self.data_rank,
            shuffle_buffer=self.shuffle_buffer,
            batches_per_iter=self.val_batches if validation else self.steps_per_epoch,
            restart=validation,
            source=self.src,
        )

    def _make_stream(self, epoch: int) -> datasets.IterableDataset:
        texts = self._default_texts if self.src.source is None else None
        args = (self.src, self.cache_dir, self._stream_format, texts, self.data_world)
        return rank_stream(source_stream(*args), self.seed + epoch, self.data_rank, self.data_world)

    def _documents(self) -> Documents:
        window = self.seq_len + 1
        return stream_documents(self.src, self._stream_format, self.tokenizer, window)

    @functools.cached_property
    def _stream_format(self) -> str:
        return resolve_format(self.src, self.cache_dir, streaming=True)

    @functools.cached_property
    def _default_texts(self) -> list[str]:
        return default_corpus_texts(self.src.default_corpus_bytes)
