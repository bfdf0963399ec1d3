"""Where documents come from: the embedded default corpus, local files, or a Hugging Face dataset name."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets

from lightning_titan.data.readable import READ_ERRORS, unreadable

DEFAULT_CORPUS_BYTES = 4_000_000  # a few MB of real text: prepares in seconds on 2 cores
BUILDERS = {  # suffix -> the `datasets` builder that reads it
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class Source:
    """What to read. ``source=None`` is the default corpus: this Python's standard library sources."""

    source: str | list[str] | None = None
    text_column: str = "text"
    config: str | None = None
    split: str = "train"
    max_bytes: int | None = None
    data_format: str = "auto"  # auto | text | chat | prompt_completion (data/chat.py)
    train_on: str = (
        "responses"  # responses | all: the targets of chat and prompt/completion records
    )
    # several documents a sequence, each attending to itself only (None: the format's default,
    # packed for chat and prompt/completion records, not for text; data/records.py)
    pack: bool | None = None

    @property
    def byte_cap(self) -> int | None:
        return self.default_corpus_bytes if self.source is None else self.max_bytes

    @property
    def default_corpus_bytes(self) -> int:
        """How much of the default corpus to read (``source=None``): ``max_bytes`` or the default."""
        return DEFAULT_CORPUS_BYTES if self.max_bytes is None else self.max_bytes

    @property
    def column(self) -> str:
        return "text" if self.source is None else self.text_column

    def describe(self) -> dict:
        """Everything the prepared cache depends on (files by size and mtime, so edits invalidate it)."""
        if self.source is None:
            return {"default": sys.version, "stdlib": _stdlib_root()}
        files = local_files(self.source)
        if files is None:
            return {"hub": self.source, "config": self.config, "split": self.split}
        return {"files": [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]}


def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def default_corpus_files() -> list[Path]:
    """The standard library's .py files in sorted order (tests and vendored packages left out)."""
    root = Path(_stdlib_root())
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def default_corpus_texts(max_bytes: int) -> list[str]:
    """Whole files in sorted order until ``max_bytes`` of text; the same list on every machine with this Python."""
    texts, total = [], 0
    for path in default_corpus_files():
        if total >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode("utf-8"))
    if not texts:
        raise ValueError(
            f"found no .py files under {_stdlib_root()} for the default corpus; pass source= a dataset or files"
        )
    return texts


def local_files(source: str | list[str]) -> list[str] | None:
    """Sorted local files a source names (files, folders, globs); None when it names none (a hub dataset)."""
    items = [source] if isinstance(source, str) else list(source)
    files: list[str] = []
    for item in items:
        if os.path.isdir(item):
            for dirpath, _, names in os.walk(item):
                files.extend(os.path.join(dirpath, n) for n in names if _suffix(n) in BUILDERS)
        elif os.path.isfile(item):
            files.append(item)
        elif glob.has_magic(item):
            matched = sorted(glob.glob(item, recursive=True))
            if not matched:
                raise ValueError(f"source glob {item!r} matches no files; check the path")
            files.extend(matched)
        elif isinstance(source, list) or not _looks_like_hub_name(item):
            raise ValueError(
                f"source path {item!r} does not exist; give existing files, a folder or a glob"
            )
        else:
            return None
    return sorted({os.path.abspath(f) for f in files})


def _looks_like_hub_name(item: str) -> bool:
    """'name' or 'owner/name': anything else (a suffix, '..', an absolute path) is a missing local path."""
    return (
        item.count("/") <= 1
        and not item.startswith((".", "/", "~"))
        and _suffix(item) not in BUILDERS
    )


def _suffix(name: str) -> str:
    return Path(name).suffix.lower()


def builder_for(files: list[str]) -> str:
    suffixes = {_suffix(f) for f in files}
    kinds = {BUILDERS.get(s) for s in suffixes}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"source files must all be one of {sorted(BUILDERS)} (text / json / jsonl / parquet); got "
            f"{sorted(suffixes)}; pass files of one kind"
        )
    return BUILDERS[suffixes.pop()]


def load_documents(
    src: Source,
    cache_dir: str,
    *,
    streaming: bool = False,
    texts: list[str] | None = None,
    data_world: int = 1,
) -> datasets.Dataset | datasets.IterableDataset:
    """The raw documents (a text column and whatever else the source has), not yet tokenised."""
    if src.source is None:
        texts = texts if texts is not None else default_corpus_texts(src.default_corpus_bytes)
        ds = datasets.Dataset.from_dict({"text": texts})
        if not streaming:
            return ds
        # about one document per shard, a multiple of data_world: split_dataset_by_node then hands each
        # rank whole shards instead of making every rank read every document and skip the others'
        shards = len(texts) // data_world * data_world or len(texts)
        return ds.to_iterable_dataset(num_shards=shards)
    files = local_files(src.source)
    hf_cache = os.path.join(cache_dir, "hf")
    if files is None:
        try:
            return datasets.load_dataset(
                src.source, src.config, split=src.split, streaming=streaming, cache_dir=hf_cache
            )
        except (
            Exception
        ) as err:  # offline, unknown name, wrong config or split: say which, and what to do
            raise ValueError(
                f"could not load the Hugging Face dataset source={src.source!r} (config={src.config!r}, "
                f"split={src.split!r}): {type(err).__name__}: {err}; check the name, config, split and the "
                "network, or give local files (source=None uses the built-in corpus)"
            ) from err
    if not files:
        raise ValueError(f"source {src.source!r} names no files of a known kind {sorted(BUILDERS)}")
    builder = builder_for(files)
    empty = ValueError(
        f"source {src.source!r} has no documents (its {len(files)} file(s) hold none); give non-empty files"
    )
    if all(os.path.getsize(f) == 0 for f in files):
        raise empty
    # text files: a blank line ends a document (one line per document cuts code and prose apart)
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        with reading(src):
            return datasets.load_dataset(
                builder,
                data_files=files,
                split="train",
                streaming=streaming,
                cache_dir=hf_cache,
                **extra,
            )
    except StopIteration as err:  # the json builder's "no row to infer a schema from"
        raise empty from err
    except ValueError as err:
        if "corresponds to no data" in str(err):
            raise empty from err
        raise


@contextlib.contextmanager
def reading(src: Source) -> Iterator[None]:
    """Read errors of local files (`datasets` names no file) become a ValueError naming the file and
    the fix; the files are examined only once something failed."""
    try:
        yield
    except READ_ERRORS as err:
        files = local_files(src.source) if src.source is not None else None
        if not files:
            raise
        kinds = {BUILDERS.get(_suffix(f)) for f in files}
        builder = kinds.pop() if len(kinds) == 1 else None
        raise unreadable(src.source, files, builder, err) from err


def check_text_column(column_names: list[str] | None, column: str, source: object) -> None:
    if column_names is not None and column not in column_names:
        raise ValueError(
            f"text_column={column!r} is not a column of source {source!r}; its columns are "
            f"{sorted(column_names)}: set text_column to one of them"
        )


def is_validation(text: str, val_fraction: float) -> bool:
    """Held-out by a hash of the document's text: the same documents whatever the order, layout or mode."""
    return zlib.crc32(text.encode("utf-8")) < val_fraction * 2**32
