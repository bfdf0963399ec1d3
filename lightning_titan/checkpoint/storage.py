"""DCP storage for our checkpoints: reading never runs code from the files; writing keeps its OS errors.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its default planner
reads non-tensor values with ``torch.load(weights_only=False)``: a crafted file would run code on
resume, validation or export. Here ``.metadata`` goes through an allow-list unpickler (DCP's metadata
classes, ``torch.Size``, dtypes, paths, containers) and non-tensor values through a weights-only load.
A shard file that does not hold what the index says (replaced, crafted, damaged where no checksum
caught it) fails naming the file, not with DCP's per-rank traceback and torch's weights-only advice.

Writing: torch's zip writer turns a failed ``write`` (disk full, file-size limit) into "unexpected
pos 704 vs 598"; the writer here keeps the ``OSError`` so the save can name it.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import pickle
import resource
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytearray", "complex", "slice"},
}  # fmt: skip


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file refers to something that can run code; it was not loaded."""


class BadShardError(ValueError):
    """A shard file does not hold what the checkpoint's index says it holds."""


def refers_to_code(error: BaseException) -> bool:
    """Whether a weights-only load refused a named global (an object whose loading could run code),
    rather than bytes that are not a pickle torch wrote at all."""
    return isinstance(error, pickle.UnpicklingError) and "GLOBAL" in str(error)


def short_cause(error: BaseException) -> str:
    """One line of why a file could not be read: torch's weights-only errors bury it in advice."""
    if isinstance(error, pickle.UnpicklingError):
        return why_refused(error)
    line = (str(error).strip().splitlines() or [""])[0]
    line = line if len(line) <= 160 else line[:157] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def not_written_here(path: Path, name: str, error: BaseException, what: str = "file") -> str:
    """For a file of checkpoint ``path`` that holds what its save never wrote."""
    return (
        f"checkpoint {path}: {name} is not a {what} this tool wrote ({short_cause(error)}); it was "
        "replaced or damaged after the save. Use another checkpoint (an earlier one, or a copy)"
    )


def why_refused(error: BaseException) -> str:
    """The line of torch's weights-only error that names what was refused (e.g. ``GLOBAL posix.system``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or ["not a weights-only object"])[0].rstrip(".")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{module}.{name} is not a checkpoint metadata class")


def load_metadata(file: Path) -> Metadata:
    """DCP's ``.metadata`` through the allow-list; anything else in it raises UnsafeCheckpointError."""
    with open(file, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as e:
            raise UnsafeCheckpointError(
                f"refused to load {file}: it refers to {str(e).split(' is not')[0]}, which a "
                "checkpoint index never holds (the file could run code); it was tampered with or "
                "not written by torch.distributed.checkpoint, do not use this checkpoint"
            ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one shard file at a time, so that a file it cannot read is named."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        done: Future[None] = Future()
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except (UnsafeCheckpointError, OSError):
                raise  # already says what it is
            except Exception as e:  # noqa: BLE001 - whatever the bytes made torch raise
                # from None: torch's error advises weights_only=False, wrong for bytes that are
                # not a checkpoint's
                raise BadShardError(
                    not_written_here(Path(self.path), name, e, "checkpoint shard")
                ) from None
        done.set_result(None)
        return done


class SafePlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer scalars, ...) read weights-only, unless the caller trusts the files."""

    def __init__(self, path: Path, weights_only: bool = True) -> None:
        super().__init__()
        self.path, self.weights_only = path, weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=self.weights_only)
        except pickle.UnpicklingError as e:
            if not refers_to_code(e):
                raise  # not a pickle we wrote: SafeReader.read_data names the file
            raise UnsafeCheckpointError(
                f"refused to load {fqn!r} from checkpoint {self.path}: {why_refused(e)} (loading it "
                "could run code); if you wrote this checkpoint and trust it, load it with "
                "weights_only=False"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(
    state: dict[str, Any], path: Path, *, no_dist: bool, weights_only: bool | None = None
) -> None:
    """``dcp.load`` that runs no code from the files (``weights_only=False``: the caller trusts them)."""
    try:
        dcp.load(
            state,
            storage_reader=SafeReader(path),
            planner=SafePlanner(path, weights_only is not False),
            checkpoint_id=path,
            no_dist=no_dist,
        )
    except CheckpointException as e:
        cause = unwrap(e, path)
        if isinstance(cause, (UnsafeCheckpointError, BadShardError)):
            raise cause from None  # it names the file and the fix; DCP's traceback adds nothing
        raise cause from e


def unwrap(error: CheckpointException, path: Path) -> Exception:
    """The real cause in DCP's CheckpointException, which holds each failed rank's exception. Every
    rank gets the same dict, so every rank raises the same error."""
    failures = [(r, e[0] if isinstance(e, tuple) else e) for r, e in sorted(error.failures.items())]
    for _, failure in failures:
        if isinstance(failure, (UnsafeCheckpointError, BadShardError)):
            return type(failure)(str(failure))
    if not failures:
        return ValueError(f"loading checkpoint {path} failed: {short_cause(error)}")
    rank, failure = failures[0]
    return ValueError(f"loading checkpoint {path} failed on rank {rank}: {short_cause(failure)}")


class _Stream:
    """A file object that remembers the first OSError of a write (torch's zip writer hides it)."""

    def __init__(self, stream: Any, errors: list[tuple[str, OSError]], name: str) -> None:
        self._stream, self._errors, self._name = stream, errors, name

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as e:
            self._errors.append((self._name, e))
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RecordingFileSystem(FileSystem):
    def __init__(self, errors: list[tuple[str, OSError]]) -> None:
        super().__init__()
        self.errors: list[tuple[str, OSError]] = errors
        self.written: list[str] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" in mode:
            self.written.append(Path(path).name)
        try:
            with super().create_stream(path, mode) as stream:
                yield _Stream(stream, self.errors, Path(path).name) if "w" in mode else stream
        except OSError as e:  # open or the closing flush
            self.errors.append((Path(path).name, e))
            raise


class RecordingWriter(FileSystemWriter):
    """``FileSystemWriter`` that keeps (file name, OSError) of every failed write in ``errors`` and
    the names of the shard files this rank wrote in ``shards``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.errors: list[tuple[str, OSError]] = []
        self.fs: _RecordingFileSystem = _RecordingFileSystem(self.errors)

    @property
    def shards(self) -> list[str]:
        return [name for name in self.fs.written if name.endswith(".distcp")]


def _os_errors(error: BaseException) -> list[OSError]:
    """OSErrors in ``error`` or, for DCP's CheckpointException, in any rank's failure."""
    found = [error] if isinstance(error, OSError) else []
    for failure in (getattr(error, "failures", None) or {}).values():
        failure = failure[0] if isinstance(failure, tuple) else failure
        found += [failure] if isinstance(failure, OSError) else []
    return found


def explain_write_error(
    error: BaseException, path: Path, writer: RecordingWriter | None = None
) -> OSError | None:
    """An OSError naming what the file system refused (ENOSPC, EDQUOT, EFBIG), or None if not that.

    torch's zip writer reports a refused write as "unexpected pos ..."; DCP gathers every rank's
    failure, so a rank whose own writes went through still learns that another rank's did not."""
    found = list(writer.errors if writer else []) + [("", e) for e in _os_errors(error)]
    short = "unexpected pos" in str(error) or any(
        "unexpected pos" in str(f[0] if isinstance(f, tuple) else f)
        for f in (getattr(error, "failures", None) or {}).values()
    )
    if not found and not short:
        return None
    name, cause = found[0] if found else ("", None)
    number = cause.errno if cause is not None and cause.errno else None
    code = errno.errorcode.get(number, "") if number else ""
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    if code == "EFBIG":
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        what, fix = f"file too large (EFBIG, ulimit -f is {limit} bytes)", "Raise ulimit -f"
    elif code in ("ENOSPC", "EDQUOT", ""):
        what = {
            "ENOSPC": "no space left on device (ENOSPC)",
            "EDQUOT": "disk quota exceeded (EDQUOT)",
            "": "the file system took fewer bytes than written (disk full: ENOSPC?)",
        }[code]
        fix = "Free space (or keep fewer checkpoints: save_top_k) or save to a larger disk"
    else:
        assert number is not None  # a code other than "" comes from an errno
        what, fix = f"{code}: {os.strerror(number)}", "Check the checkpoint directory"
    kept = "still holds the previous checkpoint" if path.exists() else "was not written"
    file = f" while writing {name}" if name else ""
    return OSError(
        number or errno.ENOSPC,
        f"saving checkpoint {path} failed{file}: {what}; {free} bytes free on the file system of "
        f"{path.parent}. {fix}; {path} {kept}",
    )
