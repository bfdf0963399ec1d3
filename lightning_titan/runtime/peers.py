"""Who is alive, who stalled, and the one line a failing rank prints (``failure_report``).

Read from /proc on this host: a dead peer (its sockets closed), a stopped one (SIGSTOP: alive, its
sockets open, so its peers wait for it until the collective timeout).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_titan.runtime.orphans import process_state, running

HOST_ENV = "TITAN_HOST"  # the host name the ranks compare (a test's two "nodes" on one machine)


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def gather_peers() -> list[tuple[str, int]]:
    """(host, pid) of every rank, from one gather while the group is healthy."""
    peers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (host_name(), os.getpid()))
    return peers


# gloo's words for "the peer's sockets closed": the peer is dying, maybe not yet marked dead
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def dead_peers(
    peers: Sequence[tuple[str, int]] | None, wait_s: float = 0.0
) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks on this host that are no longer running, waiting up to ``wait_s``
    for one (a killed process closes its sockets before the kernel marks it dead)."""
    if not peers:
        return []
    host = host_name()
    deadline = time.monotonic() + wait_s
    while True:
        dead = [(r, pid) for r, (h, pid) in enumerate(peers) if h == host and not running(pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def stopped_peers(peers: Sequence[tuple[str, int]] | None) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks on this host that are stopped (SIGSTOP, a job-control stop): alive,
    their sockets open, so their peers wait for them until the collective timeout."""
    host = host_name()
    ranks = enumerate(peers or ())
    return [(r, pid) for r, (h, pid) in ranks if h == host and process_state(pid) == "T"]


def waiting_in(exception: BaseException) -> str | None:
    """``all_reduce (train/objective.py:global_means)``: the collective a failed call was in
    (the innermost ``torch.distributed`` function) and the innermost caller outside torch."""
    frames = []
    tb = exception.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    c10d = [c.co_name for c in frames if c.co_filename.endswith("distributed_c10d.py")]
    ours = [c for c in frames if os.sep + "torch" + os.sep not in c.co_filename]
    if not c10d and not ours:
        return None
    caller = ""
    if ours:
        parts = ours[-1].co_filename.split(os.sep)
        caller = f"{os.sep.join(parts[-2:])}:{ours[-1].co_name}"
    return f"{c10d[-1]} ({caller})" if c10d else caller


def _names(ranks: list[tuple[int, int]]) -> str:
    return ", ".join(f"rank {r} (pid {pid})" for r, pid in ranks)


def blamed_peers(
    exception: BaseException,
    *,
    rank: int | None = None,
    peers: Sequence[tuple[str, int]] | None = None,
) -> str:
    """``rank 2 (pid 9) is no longer running; ``: the dead or stopped peers (of ``peers``, but
    ``rank``), the likely cause of ``exception``; "" when every peer runs."""
    first_line = (str(exception).strip().splitlines() or [""])[0]
    wait_s = 3.0 if any(words in first_line for words in PEER_GONE) else 0.0
    blamed = ""
    gone = [(r, pid) for r, pid in dead_peers(peers, wait_s) if r != rank]
    if gone:
        blamed += f"{_names(gone)} {'is' if len(gone) == 1 else 'are'} no longer running; "
    stalled = [(r, pid) for r, pid in stopped_peers(peers) if r != rank]
    if stalled:
        verb = "is" if len(stalled) == 1 else "are"
        blamed += f"{_names(stalled)} {verb} stopped (SIGSTOP) and stalled the job; "
    return blamed


def lost_hosts(
    exception: BaseException,
    *,
    rank: int | None = None,
    peers: Sequence[tuple[str, int]] | None = None,
) -> str:
    """``a rank of another host closed its connection, none on this one (node1) died: rank 0, rank 1
    on node0 (a node lost, or its network); ``: the blame for a closed connection when no peer on
    this host is dead or stopped and no rank announced one (``blamed_peers`` found nothing): the
    peer that closed it ran on another host, and when one node is lost whole nobody is left there to
    say which rank, so the other hosts' ranks are named. "" for any other error, or on one host."""
    first_line = (str(exception).strip().splitlines() or [""])[0]
    if not peers or not any(words in first_line for words in PEER_GONE):
        return ""
    host = host_name() if rank is None else peers[rank][0]
    others: dict[str, list[int]] = {}
    for r, (h, _) in enumerate(peers):
        if h != host:
            others.setdefault(h, []).append(r)
    if not others:
        return ""
    where = "; ".join(
        f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))} on {h}"
        for h, rs in others.items()
    )
    return (
        f"a rank of another host closed its connection, none on this one ({host}) died: {where} "
        "(a node lost, or its network); "
    )


def failure_report(
    exception: BaseException,
    *,
    who: str,
    rank: int | None = None,
    peers: Sequence[tuple[str, int]] | None = None,
    blamed: str | None = None,
) -> str:
    """``[titan] rank 1/4 (dp=0 pp=0 ep=1, global_step=3) failed: [rank 2 (pid 9) is no longer
    running; ]ValueError: ...``: the dead or stopped peers first (``blamed``, or ``blamed_peers``
    of ``peers``), the likely cause; for a collective that failed or timed out, what this rank was
    waiting in."""
    first_line = (str(exception).strip().splitlines() or [""])[0]
    if blamed is None:
        blamed = blamed_peers(exception, rank=rank, peers=peers)
    line = f"[titan] {who} failed: {blamed}"
    where = waiting_in(exception) if blamed or "imed out" in first_line else None
    if where:
        line += f"this rank was waiting in {where}; "
    return line + f"{type(exception).__name__}: {first_line}"
