"""Our tensors as a Hugging Face family's safetensors files, a few tensors at a time.

A ``Group`` is a few of our tensors (one parameter, one expert's row, or a layer's experts where the
family fuses them) and how they become the family's tensors. ``write_shards`` reads one group at a
time through a ``Read`` (a sharded checkpoint's entries, or a model in memory), casts it to the
export's dtype and cuts the output into files of at most ``max_shard_size`` bytes, as transformers'
``save_pretrained`` does: ``model.safetensors`` when everything fits in one, else
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``. Host memory holds one
shard and one group, never the whole model.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

from lightning_titan.checkpoint import records
from lightning_titan.hf.arch import hf_names
from lightning_titan.hf.family import Family

# our tensor's name, and for a row of a stacked expert tensor its global expert
Key = tuple[str, int | None]
Read = Callable[[list[Key]], list[Tensor]]

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# transformers' units: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name.lower() not in DTYPES:
        raise ValueError(
            f"--dtype {name!r} is not one the export writes; give one of {sorted(DTYPES)} "
            "(bf16: the families' published dtype)"
        )
    return DTYPES[name.lower()]


def size_of(text: str | int) -> int:
    """Bytes in ``"5GB"``, ``"500MB"``, ``"2GiB"`` or a plain number."""
    if isinstance(text, int):
        number, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        if match is None or match.group(2).upper() not in UNITS:
            raise ValueError(
                f"--max-shard-size {text!r} is not a size; give a number with a unit, e.g. 5GB, "
                "500MB or 2GiB"
            )
        number, unit = float(match.group(1)), match.group(2).upper()
    size = int(number * UNITS[unit])
    if size <= 0:
        raise ValueError(f"--max-shard-size {text!r} is not positive; give e.g. 5GB")
    return size


@dataclass(frozen=True)
class Group:
    """The family tensors ``make`` builds from our tensors ``sources`` (``shapes``: theirs, as meta
    tensors, so that the output's names and sizes are known before anything is read)."""

    sources: tuple[Key, ...]
    shapes: tuple[Tensor, ...]
    make: Callable[[list[Tensor]], dict[str, Tensor]]


def is_stacked_experts(name: str) -> bool:
    """Our expert tensors are [n_local, ...]: Hugging Face holds each row, transposed, apart."""
    return ".moe.experts." in name


def _as_is(hf_name: str, tensors: list[Tensor]) -> dict[str, Tensor]:
    return {hf_name: tensors[0]}


def _transposed(hf_name: str, tensors: list[Tensor]) -> dict[str, Tensor]:
    """An expert's row: Hugging Face keeps it as an ``nn.Linear`` weight, ours is ``x @ w``."""
    return {hf_name: tensors[0].t()}


def _fused(
    family: Family, layer: str, shorts: list[str], n: int, tensors: list[Tensor]
) -> dict[str, Tensor]:
    """A layer's expert rows (``n`` per tensor of ``shorts``, in that order) -> the family's fused
    tensors."""
    stacked = {s: torch.stack(tensors[i * n : (i + 1) * n]) for i, s in enumerate(shorts)}
    fused = family.fuse_experts(stacked)
    return {f"model.layers.{layer}.mlp.experts.{k}": v for k, v in fused.items()}


def groups_of(
    named: list[tuple[str, Tensor]], expert_range: tuple[int, int], family: Family
) -> list[Group]:
    """The groups that make ``family``'s tensors from ours (``named``: ``hf.arch.hf_tensors``, with
    stacked expert tensors holding experts ``expert_range``): a parameter as it is, an expert row
    transposed, or (a family with fused experts) the expert rows one fused tensor of a layer holds."""
    out = []
    # (layer, fused tensor) -> our stacked expert tensors it is made of (gpt-oss's w1 and w3 make
    # gate_up_proj): one group each, so that a layer's experts are read one fused tensor at a time
    fused: dict[tuple[str, str], list[tuple[str, Tensor]]] = {}
    for name, p in named:
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        stacked = is_stacked_experts(name)
        names = hf_names(name, expert_range, family)
        if stacked and family.fused_experts:
            fused.setdefault((name.split(".")[1], names[0]), []).append((name, meta))
            continue
        if not stacked:
            out.append(Group(((name, None),), (meta,), partial(_as_is, names[0])))
            continue
        for row, hf_name in enumerate(names):
            key = (name, expert_range[0] + row)
            out.append(Group((key,), (meta[row],), partial(_transposed, hf_name)))
    n = expert_range[1] - expert_range[0]
    for (layer, _), tensors in fused.items():
        keys = tuple((name, expert_range[0] + r) for name, _ in tensors for r in range(n))
        shapes = tuple(meta[r] for _, meta in tensors for r in range(n))
        shorts = [name.rsplit(".", 1)[-1] for name, _ in tensors]
        out.append(Group(keys, shapes, partial(_fused, family, layer, shorts, n)))
    return out


def _cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``tensor`` in ``dtype`` (floating point only) and contiguous, in one new tensor at most."""
    if dtype is None or not tensor.is_floating_point():
        dtype = tensor.dtype
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    return torch.empty(tensor.shape, dtype=dtype, device=tensor.device).copy_(tensor)


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def cut(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive groups into shards of at most ``max_bytes``; a group larger than that is a shard
    of its own (transformers does the same)."""
    shards: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not shards or used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


# safetensors' names of the dtypes an export writes
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def header(tensors: list[tuple[str, Tensor]]) -> bytes:
    """The start of a safetensors file holding ``tensors`` (their names, dtypes and shapes; meta
    tensors will do) in that order: the JSON header's length (8 bytes, little-endian), then the
    header, padded with spaces to a multiple of 8 bytes as safetensors' own writer does."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        end = offset + _nbytes(t)
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _said(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB"


def write_shards(
    groups: list[Group],
    read: Read,
    out: Path,
    dtype: torch.dtype | None,
    max_shard_size: int,
    progress: TextIO | None = None,
) -> list[str]:
    """Write ``groups`` (each read through ``read``, cast to ``dtype``; None: as read) into
    safetensors files under ``out``; the file names, in order. A line per file on ``progress``."""
    made = [g.make(list(g.shapes)) for g in groups]  # on the meta device: names and sizes only
    sizes = [sum(_nbytes(_cast(t, dtype)) for t in m.values()) for m in made]
    shards = cut(sizes, max_shard_size)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    total, n_tensors = sum(sizes), sum(len(m) for m in made)
    weight_map: dict[str, str] = {}
    written_bytes = written_tensors = 0
    for file, shard in zip(names, shards, strict=True):
        planned = [(k, _cast(v, dtype)) for i in shard for k, v in made[i].items()]
        expected = iter(planned)
        with open(out / file, "wb") as f:
            f.write(header(planned))
            for i in shard:
                # each tensor goes to the file as soon as it is cast: memory holds one group
                tensors = groups[i].make(read(list(groups[i].sources)))
                while tensors:  # popped: each is freed once written
                    k = next(iter(tensors))
                    cast = _cast(tensors.pop(k), dtype)
                    name, want = next(expected)
                    if (k, cast.shape, cast.dtype) != (name, want.shape, want.dtype):
                        raise RuntimeError(
                            f"{file}: {k} {tuple(cast.shape)} {cast.dtype} was read where the "
                            f"header says {name} {tuple(want.shape)} {want.dtype}"
                        )
                    f.write(records.memory_of(cast))
                    weight_map[k] = file
                    written_tensors += 1
                    written_bytes += _nbytes(cast)
                    del cast
        if progress is not None:
            print(
                f"titan export: wrote {file}: {written_tensors}/{n_tensors} tensors, "
                f"{_said(written_bytes)} of {_said(total)}",
                file=progress,
                flush=True,
            )
    if len(names) > 1:
        index: dict[str, Any] = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / INDEX).write_text(json.dumps(index, indent=2))
    return names
