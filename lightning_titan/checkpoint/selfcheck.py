"""A background save checked against a synchronous one, for a first run on new hardware.

``background_round_trip`` saves the live state twice, once written at once and once staged to host
memory and written by the writer thread, compares the two directories byte for byte, and reports
where the staged tensors lived and which device the writer worked on. From a TitanStrategy after a
training step (every rank, e.g. in a callback's ``on_train_batch_end``)::

    report = background_round_trip(
        strategy.module, strategy.optimizers, tmp_dir, zero_shards=strategy.zero_shards
    )
    assert report["ok"], report["problems"]
"""

from __future__ import annotations

import filecmp
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_titan.checkpoint import files
from lightning_titan.checkpoint.background import WRITER_THREAD, BackgroundSaves, Staged
from lightning_titan.checkpoint.devices import DeviceHooks, Fence, contexts, hooks_for
from lightning_titan.checkpoint.sharded import save_sharded
from lightning_titan.parallel.dp.zero import NO_SHARDS, ZeroShards
from lightning_titan.runtime.agreement import agree, distributed


def _current_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else "cpu"


class _WatchedFence:
    def __init__(self, fence: Fence, seen: list[tuple[str, str]]) -> None:
        self._fence, self._seen = fence, seen

    def synchronize(self) -> None:
        self._fence.synchronize()
        self._seen.append((threading.current_thread().name, _current_device()))


class _WatchedHooks(DeviceHooks):
    """``base``, and the device current on the thread that waits for each fence (the writer)."""

    def __init__(self, base: DeviceHooks, seen: list[tuple[str, str]]) -> None:
        self._base, self._seen = base, seen
        self.pin_memory, self.device = base.pin_memory, base.device

    def set_device(self) -> None:
        self._base.set_device()

    def record_fence(self) -> Fence:
        return _WatchedFence(self._base.record_fence(), self._seen)


class _WatchedSaves(BackgroundSaves):
    """Keeps (device type, pinned) of every tensor it staged."""

    def __init__(self, hooks: DeviceHooks, staged: list[tuple[str, bool]]) -> None:
        super().__init__(hooks)
        self._staged = staged

    def stage(self, state: dict[str, Any]) -> Staged:
        staged = super().stage(state)
        for value in staged.state.values():
            if isinstance(value, Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                self._staged.append((local.device.type, local.is_pinned()))
        return staged


def background_round_trip(
    model: nn.Module,
    optimizers: list[Optimizer],
    tmp_dir: str | Path,
    *,
    zero_shards: ZeroShards = NO_SHARDS,
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective (every rank, the same ``tmp_dir`` on a file system they share): save ``model``
    and ``optimizers`` (``zero_shards``: as for ``save_sharded``) into ``tmp_dir/sync.ckpt`` and,
    in the background, ``tmp_dir/background.ckpt``; compare their shard files and ``meta.pt`` byte
    for byte (rank 0; DCP's ``.metadata`` names the save and differs). Both are removed after.

    Returns, the same on every rank:

    - ``ok``: every check below passed; ``problems``: one line per failed check;
    - ``identical``: the files compared are equal (the live state held NaN while the background
      write ran: a write that read it rather than the staged copies differs); ``compared``: their
      names;
    - ``ranks``: per rank, ``device`` (its parameters'), ``staged`` (device types the staged tensors
      were on: ``["cpu"]``), ``pinned`` (all staged tensors pinned; expected where CUDA is),
      ``writer`` (the device current on the writer thread when it wrote: the rank's own),
      ``contexts`` (CUDA devices this process holds a context on: only its own), ``call_ms`` and
      ``write_ms`` (the background save's call, which training waits for, and its write).
    """
    tmp_dir = Path(tmp_dir)
    sync, background = tmp_dir / "sync.ckpt", tmp_dir / "background.ckpt"
    layout = layout or {}
    staged: list[tuple[str, bool]] = []
    waits: list[tuple[str, str]] = []
    hooks = _WatchedHooks(hooks_for(p.detach() for p in model.parameters()), waits)
    saves = _WatchedSaves(hooks, staged)
    save_sharded(sync, model, optimizers, {}, layout=layout, zero_shards=zero_shards)
    start = time.perf_counter()
    save_sharded(
        background, model, optimizers, {}, layout=layout, background=saves, zero_shards=zero_shards
    )
    call_s = time.perf_counter() - start
    with _overwritten(model, optimizers):  # training goes on while the writer writes
        saves.wait()
    device = next((str(p.device) for p in model.parameters()), "cpu")
    mine = {
        "device": device,
        "staged": sorted({kind for kind, _ in staged}),
        "pinned": bool(staged) and all(pinned for _, pinned in staged),
        "writer": sorted({where for thread, where in waits if thread == WRITER_THREAD}),
        "contexts": contexts(),
        "call_ms": call_s * 1e3,
        "write_ms": saves.seconds * 1e3,
    }
    compared, differing = [], []
    if not distributed() or dist.get_rank() == 0:
        for file in sorted(sync.iterdir()):
            if file.name in (files.MARKER, files.DCP_METADATA):
                continue
            compared.append(file.name)
            other = background / file.name
            if not other.is_file() or not filecmp.cmp(file, other, shallow=False):
                differing.append(file.name)
    ranks = agree(None, (mine, compared, differing))
    compared, differing = ranks[0][1], ranks[0][2]
    if not distributed() or dist.get_rank() == 0:
        files.remove(sync)
        files.remove(background)
    agree(None)  # nobody reuses tmp_dir before rank 0 cleared it
    return _report([r[0] for r in ranks], compared, differing)


@contextmanager
def _overwritten(model: nn.Module, optimizers: list[Optimizer]) -> Iterator[None]:
    """The parameters and optimizer state hold NaN inside the block and their values again after:
    a write that read the live tensors rather than the staged copies then differs from the
    synchronous save."""
    live = [p.detach() for p in model.parameters()]
    for optimizer in optimizers:
        live += [
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        ]
    live = [t for t in live if t.is_floating_point()]
    kept = [t.clone() for t in live]
    with torch.no_grad():
        for t in live:
            t.fill_(float("nan"))
    try:
        yield
    finally:
        with torch.no_grad():
            for t, k in zip(live, kept, strict=True):
                t.copy_(k)


def _report(ranks: list[dict[str, Any]], compared: list[str], differing: list[str]) -> dict:
    problems = []
    if differing or not compared:
        problems.append(f"background and synchronous saves differ in {differing or 'no files'}")
    for rank, r in enumerate(ranks):
        own = r["device"] if r["device"].startswith("cuda") else "cpu"
        if r["staged"] != ["cpu"]:
            problems.append(f"rank {rank}: staged tensors on {r['staged']}, not host memory")
        if own != "cpu" and not r["pinned"]:
            problems.append(f"rank {rank}: staged host tensors are not pinned")
        if r["writer"] != [own]:
            problems.append(f"rank {rank} on {own}: the writer thread wrote on {r['writer']}")
        others = [i for i in r["contexts"] if f"cuda:{i}" != own]
        if others:
            problems.append(f"rank {rank} on {own}: CUDA contexts on other devices {others}")
    return {
        "ok": not problems,
        "problems": problems,
        "identical": not differing and bool(compared),
        "compared": compared,
        "ranks": ranks,
    }
