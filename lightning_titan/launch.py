"""Run a function on N CPU ranks over gloo, with a deadline: the launcher tests and benchmarks use.

Lightning launches training itself; this is for engine-level code that has no Trainer.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port for a rendezvous, free now and below the kernel's ephemeral range: a port from
    ``bind(0)`` comes from that range, and between our check and the store's listen the kernel may
    hand it to any outgoing connection (gloo opens many), which failed launches with EADDRINUSE."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(low // 2, low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all 64 taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the range is similar


def cpu_threads_per_rank(local_world_size: int, *, forked: bool = False) -> int:
    """Split the cores between the ranks on this machine so they do not oversubscribe them.

    A forked rank gets one thread: GNU OpenMP (torch's CPU thread pool) is not fork-safe, and a child
    that runs a parallel region with more than one thread after its parent ran one hangs for good
    (seen with torch 2.13: a notebook that computed anything before a fork launch)."""
    return 1 if forked else max(1, (os.cpu_count() or 1) // local_world_size)


def _entry(rank, world_size, port, timeout_s, backend, fn, args, queue, forked):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cpu_threads_per_rank(world_size, forked=forked))
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        # plain pickle bytes: torch's queue pickler would share tensors through file descriptors that
        # vanish when this process exits, before the parent reads them
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report anything to the parent, then fail this rank
        queue.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return each rank's result.

    ``backend`` is passed to ``init_process_group`` (e.g. ``"cpu:gloo,cuda:nccl"`` on GPUs, where rank r
    uses ``cuda:r % device_count``).
    ``start_method="fork"`` runs functions defined in a notebook (no import needed); with ``"spawn"``
    ``fn`` must be importable (a module-level function). Raises if any rank fails or the deadline passes;
    the survivors are killed either way, so nothing is left hanging.
    """
    ctx: Any = mp.get_context(start_method)  # a start method's context has Process
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, timeout_s, backend, fn, args, queue, start_method == "fork"),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failure = None
    try:
        while len(results) < world_size and failure is None:
            if not queue.empty():
                rank, ok, value = queue.get()
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    failure = f"rank {rank} failed:\n{value}"
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                failure = f"ranks {missing} did not finish within {timeout_s:.0f} s"
            elif any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.2)  # let a failing rank's report arrive before naming it
                if queue.empty():
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    failure = f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
            else:
                time.sleep(0.01)
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.kill()
            p.join(timeout=30)
    if failure is not None:
        raise RuntimeError(failure)
    return [results[r] for r in range(world_size)]
