"""A saved tensor read straight into the caller's tensor: its bytes are held once.

DCP's reader ``torch.load``-s each saved record into a new tensor, then copies it into the
destination: a read holds the tensor twice. Each record DCP writes is a ``torch.save`` zip archive
at an offset of a shard file (``.metadata``'s storage_data gives file, offset and length): a
``data.pkl`` that says dtype, shape, stride and which storage, and the storage's bytes stored
uncompressed. Here the zip's directory and ``data.pkl`` (through an allow-list: nothing in it can
run code) say where the bytes are, and they are read from the file into the destination's memory.

A record of any other form (compressed, transformed, a view into a larger storage, a non-contiguous
stride, a storage other than the tensor's) returns False, and the caller reads it through DCP.
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

# "FloatStorage" -> torch.float32: the names data.pkl gives its storages' types
_STORAGE_DTYPES = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


class _Slice(io.RawIOBase):
    """The bytes ``[start, start + length)`` of an open file, as a file of their own."""

    def __init__(self, file: io.RawIOBase, start: int, length: int) -> None:
        self.file, self.start, self.length, self.pos = file, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.length}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        self.file.seek(self.start + self.pos)
        got = self.file.readinto(view[:n]) or 0
        self.pos += got
        return got


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuilt:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _NotPlain(Exception):
    """The record is not a plain tensor of one storage: read it the general way."""


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Rebuilt:
    if not isinstance(storage, _Storage):
        raise _NotPlain("no storage")
    return _Rebuilt(storage, int(offset), tuple(size), tuple(stride))


class _TensorUnpickler(pickle.Unpickler):
    """``data.pkl`` of ``torch.save(tensor)``: what it names, never constructed."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain("persistent id")
        _, dtype, key, _, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise _NotPlain("storage type")
        return _Storage(dtype, str(key), int(numel))


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(size):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _bytes_at(
    file: io.RawIOBase, start: int, length: int, dtype: torch.dtype, size: tuple[int, ...]
) -> int:
    """Where, in ``file``, the bytes of the plain tensor saved in ``[start, start + length)`` begin;
    raises _NotPlain unless it is one contiguous ``dtype`` tensor of ``size``, stored uncompressed."""
    with zipfile.ZipFile(_Slice(file, start, length)) as archive:
        entries = {info.filename: info for info in archive.infolist()}
        pkl = next((n for n in entries if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise _NotPlain("no data.pkl")
        root = pkl[: -len("data.pkl")]
        order = archive.read(root + "byteorder") if root + "byteorder" in entries else b"little"
        if order.decode() != sys.byteorder:
            raise _NotPlain("byte order")
        record = _TensorUnpickler(io.BytesIO(archive.read(pkl))).load()
    if not isinstance(record, _Rebuilt):
        raise _NotPlain("not a tensor")
    storage = record.storage
    numel = math.prod(size)
    if (
        storage.dtype != dtype
        or record.size != size
        or record.offset != 0
        or storage.numel != numel
        or (numel > 1 and record.stride != _contiguous_stride(size))
    ):
        raise _NotPlain("layout")
    data = entries.get(f"{root}data/{storage.key}")
    nbytes = numel * dtype.itemsize
    if data is None or data.compress_type != zipfile.ZIP_STORED or data.file_size != nbytes:
        raise _NotPlain("storage entry")
    file.seek(start + data.header_offset)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise _NotPlain("local header")
    begin = data.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if begin + nbytes > length:
        raise _NotPlain("past the record")
    return start + begin


def memory_of(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (any dtype, bf16 included);
    valid while ``tensor`` lives."""
    if not (tensor.is_contiguous() and tensor.device.type == "cpu"):
        raise ValueError(
            f"memory_of takes a contiguous CPU tensor, not {tensor.device} strides {tensor.stride()}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _fill(file: io.RawIOBase, at: int, out: Tensor) -> None:
    """Read ``out``'s bytes (contiguous) from ``file`` at ``at``, straight into its memory."""
    nbytes = out.numel() * out.element_size()
    view = memory_of(out)
    file.seek(at)
    done = 0
    while done < nbytes:
        got = file.readinto(view[done:])
        if not got:
            raise _NotPlain("short read")
        done += got


def read_into(path: Path, metadata: Metadata, key: str, out: Tensor) -> bool:
    """Fill ``out`` (contiguous, the saved shape and dtype) with the saved tensor ``key`` of the
    checkpoint at ``path``, each saved chunk's bytes read into ``out``'s memory; False (``out``
    partly written) when a chunk is not a plain record or not a contiguous slab of ``out``: read it
    through DCP then."""
    saved = metadata.state_dict_metadata[key]
    assert isinstance(saved, TensorStorageMetadata) and out.is_contiguous()
    assert tuple(out.shape) == tuple(saved.size) and out.dtype == saved.properties.dtype
    for chunk in saved.chunks:
        info = (metadata.storage_data or {}).get(MetadataIndex(key, chunk.offsets))
        if (
            info is None
            or info.transform_descriptors
            or Path(info.relative_path).name != info.relative_path  # a file of this directory
        ):
            return False
        # a chunk of whole rows is a contiguous slab of out; anything else is read through DCP
        if any(o != 0 for o in chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(out.shape[1:]):
            return False
        region = out.narrow(0, chunk.offsets[0], chunk.sizes[0]) if out.dim() else out
        if region.numel() == 0:
            continue
        try:
            with open(path / info.relative_path, "rb", buffering=0) as file:
                at = _bytes_at(file, info.offset, info.length, out.dtype, tuple(chunk.sizes))
                _fill(file, at, region)
        except Exception:  # noqa: BLE001 - whatever the bytes are, DCP reads them and names the file
            return False
    return True
