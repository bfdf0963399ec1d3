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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_titan.runtime.orphans import watch_launcher

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
STORE_FD = "TITAN_STORE_FD"  # a forking launcher's listening socket, inherited by its ranks
STORE_LAUNCHER = "TITAN_STORE_LAUNCHER"  # the pid of that launcher
RESTART_ENV = "TITAN_RESTART_COUNT"  # set by the restarting launcher (lightning/restarts.py)


def restart_count() -> int:
    """How many times this job's ranks were started again after one died: by our restarting launcher
    or by torchrun's agent (0: the first launch)."""
    return int(os.environ.get(RESTART_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


_SERVING: list[dist.TCPStore] = []  # hosted stores this process's world group still uses


def free_port() -> int:
    """A port for a rendezvous, free now and below the kernel's ephemeral range: a port from
    ``bind(0)`` comes from that range, and the kernel may hand it to any outgoing connection (gloo
    opens many) before the port is bound again."""
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


@contextmanager
def hosted_rendezvous(
    port: int | None = None, *, serve: bool = True, forks: bool = False
) -> Iterator[int]:
    """Hold the rendezvous port in the launcher, from before any rank starts until they are done.

    A port picked, then bound seconds later by rank 0's store, may be taken in between (CI saw
    EADDRINUSE). Here it is bound at once (``port=None``: a free one, retried on a clash). One store
    per launch: its keys outlive a launch, and a second launch on it could read the first one's gloo
    addresses. ``serve=False``: another launcher serves it (a node past the first). ``MASTER_PORT``
    and the variables below are set for the ranks while this holds, and restored after.

    - Ranks started fresh (popen, spawn) connect to a store this process serves, as clients: torch's
      agent-store mode (``TORCHELASTIC_USE_AGENT_STORE``), as torchrun's agent does.
    - Ranks forked from this process (``forks``) must not inherit a store: it serves from a thread,
      and a child forked while that thread holds a lock deadlocks in its own first TCPStore (a probe:
      6 of 16 launches of 8 forked ranks hung there; CI's 8-rank fork jobs hung at times). Only the
      listening socket is bound here, no thread runs, and rank 0 serves the store on it
      (``rank_store``; 0 of 30 hung)."""
    bound: dist.TCPStore | socket.socket | None = None
    for _ in range(1 if port is not None or not serve else 8):
        chosen = free_port() if port is None else port
        if not serve:
            break
        try:
            bound = (
                _listen(chosen)
                if forks
                else dist.TCPStore("127.0.0.1", chosen, is_master=True, wait_for_workers=False)
            )
            break
        except (OSError, dist.DistNetworkError) as err:
            if port is not None:
                raise RuntimeError(
                    f"MASTER_PORT={port} is taken by another process (EADDRINUSE): unset MASTER_PORT"
                    " to let titan pick a free port, or choose a free one"
                ) from err
    if serve and bound is None:
        raise RuntimeError("no free port for the rendezvous after 8 tries (EADDRINUSE)")
    names = ("MASTER_PORT", AGENT_STORE, STORE_FD, STORE_LAUNCHER)
    previous = {k: os.environ.get(k) for k in names}
    os.environ["MASTER_PORT"] = str(chosen)
    if isinstance(bound, socket.socket):
        os.environ.update({STORE_FD: str(bound.fileno()), STORE_LAUNCHER: str(os.getpid())})
    else:
        os.environ[AGENT_STORE] = "True"
    try:
        yield chosen
    finally:
        if isinstance(bound, socket.socket):
            bound.close()
        elif bound is not None and dist.is_initialized():
            # this process joined the world group through the store (rank 0 of a script launch, or
            # one process): the group keeps using it (new_group's rendezvous), also for the next
            # trainer.fit/validate/test in this process, so it lives as long as the process does
            _SERVING.append(bound)
        del bound
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own socket
        sock.bind(("0.0.0.0", port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def restart_store(timeout: timedelta) -> dist.Store | None:
    """In a restarted rank under torchrun's agent store: the store with this attempt's keys apart.
    torchrun's static rendezvous (``--master_port``) keeps one store for every restart, and torch
    prefixes nothing, so the new ranks would read the dead launch's gloo addresses and hang."""
    if not restart_count() or os.environ.get(AGENT_STORE) != "True":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/titan/restart_{restart_count()}", store)


def rank_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """In a rank its launcher forked (``hosted_rendezvous(forks=True)``): the rendezvous store for
    ``init_process_group(store=...)``, served by rank 0 on the launcher's socket, the others its
    clients. None in any other process (a grandchild inherits the variables, not the launcher)."""
    fd, launcher = os.environ.get(STORE_FD), os.environ.get(STORE_LAUNCHER)
    if fd is None or launcher is None or int(launcher) != os.getppid():
        return None
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    if rank == 0:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            master_listen_fd=int(fd),
            timeout=timeout,
            wait_for_workers=False,
        )
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


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


def _entry(
    rank: int,
    world_size: int,
    timeout_s: float,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: SimpleQueue[tuple[int, bool, bytes | str]],
    forked: bool,
) -> None:
    # a launcher killed (kill -9, a test runner's timeout) must not leave its ranks waiting in a
    # collective for timeout_s: each leaves within seconds (orphans.watch_launcher)
    watch_launcher()
    # the launcher's MASTER_ADDR, else this machine; MASTER_PORT and the agent-store flag:
    # hosted_rendezvous
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(cpu_threads_per_rank(world_size, forked=forked))
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        timeout = timedelta(seconds=timeout_s)
        store = rank_store(rank, world_size, timeout)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timeout, store=store
        )
        # every rank through gloo's connection handshake before any may leave: a rank whose fn
        # ran no collective could otherwise exit while a slower peer was still connecting to it
        dist.barrier()
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
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, timeout_s, backend, fn, args, queue, start_method == "fork"),
            daemon=True,
        )
        for r in range(world_size)
    ]
    with hosted_rendezvous(forks=start_method == "fork"):
        return _collect(procs, queue, world_size, timeout_s)


def _collect(procs: list[Any], queue: Any, world_size: int, timeout_s: float) -> list[Any]:
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
