"""Map-style preparation: tokenise, split, pack and save once; every later run memory-maps the cache.

Safe when many ranks start at once: one process prepares under a file lock into a temporary folder and
renames it into place (atomic), the others wait on the lock and then load the finished folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from filelock import FileLock

from lightning_titan.data.corpus import Source, check_text_column, is_validation, load_documents
from lightning_titan.data.packing import Packer
from lightning_titan.data.readable import as_text, check_text_feature
from lightning_titan.data.records import build_records, records_packed, resolve_format
from lightning_titan.data.tokenizer import Tokenizer, token_dtype

FORMAT_VERSION = 1
SPLITS = ("train", "validation")


def default_cache_dir() -> str:
    """``$LIGHTNING_TITAN_CACHE``, else ``~/.cache/lightning_titan``."""
    env = os.environ.get("LIGHTNING_TITAN_CACHE")
    return env or os.path.join(os.path.expanduser("~"), ".cache", "lightning_titan")


@dataclass(frozen=True)
class PackedCorpus:
    """The prepared splits: rows are windows of S+1 token ids, row index = sequence id."""

    path: Path
    train: datasets.Dataset
    validation: datasets.Dataset
    meta: dict


def cache_key(src: Source, tokenizer: Tokenizer, seq_len: int, val_fraction: float) -> str:
    spec = {
        "format": FORMAT_VERSION,
        "source": src.describe(),
        "column": src.column,
        "max_bytes": src.byte_cap,
        "tokenizer": [tokenizer.name, tokenizer.vocab_size, tokenizer.eod_id],
        "seq_len": seq_len,
        "val_fraction": val_fraction,
    }
    if (src.data_format, src.train_on) != (
        "auto",
        "responses",
    ):  # auto: the files decide the format
        spec["records"] = [src.data_format, src.train_on]
    if src.pack is not None:
        spec["pack"] = src.pack
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def prepare(
    src: Source,
    tokenizer: Tokenizer,
    seq_len: int,
    val_fraction: float,
    cache_dir: str,
    num_proc: int | None = None,
) -> Path:
    """Build the packed corpus unless it is cached; return its folder. Every caller may call this."""
    root = Path(cache_dir) / "packed"
    root.mkdir(parents=True, exist_ok=True)
    final = root / cache_key(src, tokenizer, seq_len, val_fraction)
    if final.exists():
        return final
    with FileLock(str(final) + ".lock"):
        if final.exists():  # another rank finished it while we waited
            return final
        _build_into(final, src, tokenizer, seq_len, val_fraction, cache_dir, num_proc)
    return final


def prepare_and_load(
    src: Source,
    tokenizer: Tokenizer,
    seq_len: int,
    val_fraction: float,
    cache_dir: str,
    num_proc: int | None = None,
) -> PackedCorpus:
    """``load_packed(prepare(...))``, and a damaged cache (a truncated or missing file: a full disk, a
    copy cut short) is rebuilt once, under the lock, instead of failing every later run."""
    args = (src, tokenizer, seq_len, val_fraction, cache_dir, num_proc)
    final = prepare(*args)
    try:
        return load_packed(final)
    except DamagedCache as err:
        damage = err
    with FileLock(str(final) + ".lock"):
        try:  # another rank may have rebuilt it while we waited
            return load_packed(final)
        except DamagedCache:
            pass
        print(
            f"the prepared data cache {final} is damaged ({damage.why}): rebuilding it",
            file=sys.stderr,
        )
        aside = final.with_name(f".{final.name}.damaged-{os.getpid()}")
        os.rename(final, aside)  # ranks that hold it open keep reading the old files
        shutil.rmtree(aside, ignore_errors=True)
        _build_into(final, *args)
    try:
        return load_packed(final)
    except DamagedCache as err:
        raise ValueError(f"{err} (rebuilding it here failed too: check the disk)") from err


class DamagedCache(ValueError):
    """A prepared corpus folder that cannot be read back whole: names it, why, and the fix."""

    def __init__(self, path: Path, why: str) -> None:
        self.why = why
        super().__init__(
            f"the prepared data cache {path} is damaged ({why}); delete it (rm -r {path}) and it is "
            "rebuilt on the next run"
        )


def load_packed(path: Path) -> PackedCorpus:
    """The prepared corpus at ``path``; DamagedCache (naming the folder and the fix) if it is not whole."""
    try:
        splits = datasets.load_from_disk(str(path))
        meta = json.loads((path / "meta.json").read_text())
        corpus = PackedCorpus(path, splits["train"], splits["validation"], meta)
        rows = {split: len(getattr(corpus, split)) for split in SPLITS}
        want = {split: meta[split]["sequences"] or 0 for split in SPLITS}
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as err:
        raise DamagedCache(path, f"{type(err).__name__}: {str(err)[:200]}") from err
    if rows != want:  # an Arrow stream cut at a batch boundary still loads, short
        raise DamagedCache(path, f"it holds {rows} sequences, its meta.json says {want}")
    if "format" in meta and "packed" not in meta:  # records prepared before they could be packed
        raise DamagedCache(path, "its records were prepared one a sequence, before packing")
    return corpus


def _build_into(
    final: Path,
    src: Source,
    tokenizer: Tokenizer,
    seq_len: int,
    val_fraction: float,
    cache_dir: str,
    num_proc: int | None,
) -> None:
    """Build in a temporary folder next to ``final`` and rename it into place (the caller holds the lock)."""
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        _build(src, tokenizer, seq_len, val_fraction, cache_dir, num_proc, work)
        os.rename(work / "dataset", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build(
    src: Source,
    tokenizer: Tokenizer,
    seq_len: int,
    val_fraction: float,
    cache_dir: str,
    num_proc: int | None,
    work: Path,
) -> None:
    data_format = resolve_format(src, cache_dir)
    if data_format != "text":
        pack = records_packed(src.pack)
        stats = build_records(
            src, data_format, tokenizer, seq_len, val_fraction, cache_dir, work, pack=pack
        )
        records = {
            split: datasets.Dataset.from_file(str(work / f"{split}.arrow")) for split in SPLITS
        }
        about = {"format": data_format, "train_on": src.train_on, "seq_len": seq_len}
        about["packed"] = pack
        vocab = {"vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}
        _save(records, {**about, **vocab, **stats}, work)
        return
    raw = load_documents(src, cache_dir)
    check_text_column(raw.column_names, src.column, src.source)
    check_text_feature(raw.features, src.column, src.source)
    if len(raw) == 0:
        raise ValueError(
            f"source {src.source!r} has no documents; point source at a non-empty dataset"
        )
    raw = raw.select_columns([src.column])
    if src.source is not None and src.byte_cap is not None:
        raw = raw.select(range(_docs_within(raw, src.column, src.byte_cap)))
    dtype = token_dtype(tokenizer.vocab_size)
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value(dtype.name)), "val": datasets.Value("bool")}
    )
    cores = os.cpu_count() or 1
    tokens = raw.map(
        _tokenize,
        batched=True,
        batch_size=256,
        num_proc=num_proc or min(cores, max(1, len(raw) // 5000)),
        fn_kwargs={
            "tokenizer": tokenizer,
            "column": src.column,
            "source": src.source,
            "val_fraction": val_fraction,
            "dtype": dtype,
        },
        remove_columns=[src.column],
        features=features,
        cache_file_name=str(work / "tokens.arrow"),
        desc="tokenising",
    )
    meta: dict[str, Any] = {
        "seq_len": seq_len,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
    }
    splits = {}
    for split in SPLITS:
        splits[split], meta[split] = _pack(tokens, split == "validation", seq_len + 1, dtype, work)
    _save(splits, meta, work)


def _save(splits: dict[str, datasets.Dataset], meta: dict, work: Path) -> None:
    # an empty split saved as zero shards cannot be loaded again (datasets 5.2): keep one
    empty = {name: 1 for name, ds in splits.items() if len(ds) == 0}
    with no_progress_bars():  # a copy of what the tokenising bar showed: seconds, no news
        datasets.DatasetDict(splits).save_to_disk(str(work / "dataset"), num_shards=empty or None)
    (work / "dataset" / "meta.json").write_text(json.dumps(meta, indent=1))


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """datasets' progress bars off inside, as the caller had them after (the switch is global)."""
    was_off = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.utils.enable_progress_bars()


def _docs_within(raw: datasets.Dataset, column: str, max_bytes: int) -> int:
    """Whole documents in order until max_bytes (the one that crosses the cap is kept)."""
    sizes = pc.binary_length(raw.data.column(column)).to_numpy(zero_copy_only=False)
    cumulative = np.cumsum(np.nan_to_num(sizes.astype(np.float64)))
    return min(len(sizes), int(np.searchsorted(cumulative, max_bytes, side="left")) + 1)


def _tokenize(
    batch: dict,
    tokenizer: Tokenizer,
    column: str,
    source: str | list[str] | None,
    val_fraction: float,
    dtype: np.dtype,
) -> dict:
    ids, val = [], []
    for value in batch[column]:
        text = as_text(value, column, source)
        body = tokenizer.encode_array(text)
        doc = np.empty(len(body) + 1, dtype=dtype)
        doc[:-1] = body
        doc[-1] = tokenizer.eod_id
        ids.append(doc)
        val.append(is_validation(text, val_fraction))
    return {"input_ids": ids, "val": val}


def _pack(
    tokens: datasets.Dataset, want_val: bool, window: int, dtype: np.dtype, work: Path
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Stream the tokenised documents of one split through a Packer into an Arrow file of windows."""
    schema = pa.schema([("input_ids", pa.list_(pa.from_numpy_dtype(dtype), window))])
    path = work / f"{'validation' if want_val else 'train'}.arrow"
    packer = Packer(window, eod_id=-1)
    documents = total = sequences = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for table in tokens.with_format("arrow").iter(batch_size=4096):
            mask = pc.equal(table.column("val"), want_val)
            docs = pc.filter(table.column("input_ids"), mask).combine_chunks()
            flat = docs.flatten().to_numpy(zero_copy_only=False)
            documents += len(docs)
            total += len(flat)
            packer.add_tokens(flat)
            windows = packer.take()
            sequences += len(windows)
            if len(windows):
                values = pa.array(windows.astype(dtype).ravel())
                writer.write_batch(
                    pa.record_batch([pa.FixedSizeListArray.from_arrays(values, window)], schema)
                )
        if sequences == 0:  # a table with no batch at all cannot be memory-mapped
            writer.write_batch(pa.record_batch([pa.array([], type=schema.field(0).type)], schema))
    stats = {
        "documents": documents,
        "tokens": total,
        "sequences": sequences,
        "tail": len(packer.leftover),
    }
    return datasets.Dataset.from_file(str(path)), stats
