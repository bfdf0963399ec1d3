"""Rank death without our launcher: under torchrun or srun, the ranks watch each other.

torchrun's agent sees only its own node's workers, srun only its own tasks, and NCCL does not notice
a dead peer: the other nodes' ranks would wait in their collective for ``timeout_minutes``. So each
rank runs a ``PeerWatch`` thread that, every ``INTERVAL_S``, over a connection of its own to the job's
rendezvous store (``MASTER_ADDR:MASTER_PORT``):

- looks at the peers on its own host (/proc: dead, or stopped by SIGSTOP) and at the heartbeat of the
  next rank on another host (a node lost whole leaves nobody on it to look): silent for ``SILENT_S``
  is gone;
- announces what it found in the store (the first finding stands) and reads any rank's announcement:
  every rank of every node then leaves, naming the dead rank, its pid and host;
- takes a store it cannot reach for ``SILENT_S`` as its host gone (node 0's agent, or rank 0).

A rank that ends its Trainer call normally says so first (``stop(finished=True)``), so that a peer
that leaves at the end is not taken for dead. The keys are per launch and per call (a restart by
torchrun keeps the store).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from lightning_titan.runtime.launch import restart_count
from lightning_titan.runtime.peers import dead_peers, stopped_peers

INTERVAL_S = 0.5  # how often a rank looks at its peers and the store
SILENT_S = 20.0  # a peer on another host unheard for this long (or the store) is gone
HEARD_S = 5.0  # how long the rank that announces a death waits for the others to read it
UNREACHABLE_INTERVAL_S = 5.0  # between tries of a store that did not answer (each one logs)
_calls = itertools.count()  # the Trainer calls of this process: each watch has keys of its own


def next_remote(peers: Sequence[tuple[str, int]], rank: int) -> int | None:
    """The next rank after ``rank`` (in a ring) on another host than its own; None on one host."""
    world = len(peers)
    after = ((rank + i) % world for i in range(1, world))
    return next((r for r in after if peers[r][0] != peers[rank][0]), None)


def describe(peers: Sequence[tuple[str, int]], ranks: Sequence[tuple[int, int]], state: str) -> str:
    names = ", ".join(f"rank {r} (pid {pid}, host {peers[r][0]})" for r, pid in ranks)
    return f"{names} {'is' if len(ranks) == 1 else 'are'} {state}"


class PeerWatch(threading.Thread):
    """Calls ``on_gone(reason)`` once a peer of ``rank`` is found dead, stopped or silent."""

    def __init__(
        self,
        peers: Sequence[tuple[str, int]],
        rank: int,
        on_gone: Callable[[str], None],
        *,
        interval_s: float = INTERVAL_S,
        silent_s: float = SILENT_S,
    ) -> None:
        super().__init__(daemon=True, name="titan-peer-watch")
        self.peers, self.rank, self.on_gone = list(peers), rank, on_gone
        self.interval_s, self.silent_s = interval_s, silent_s
        self.address = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))
        self.prefix = f"/titan/watch/{restart_count()}/{next(_calls)}/"
        self.store: dist.Store | None = None
        self.stopped = threading.Event()
        self.neighbour = next_remote(self.peers, rank)
        self._beat, self._heard = -1, time.monotonic()
        self._heard_it = False

    def _count(self, key: str, by: int = 0) -> int:
        assert self.store is not None
        return int(self.store.add(self.prefix + key, by))

    def announce(self, reason: str, gone: int = 1) -> str:
        """Make ``reason`` (about ``gone`` ranks) every rank's, unless a rank announced first (then
        that one's, returned); the first waits up to ``HEARD_S`` for the others to have read it (its
        node's agent may end the node, and the store with it, once this rank leaves)."""
        if self._count("gone", 1) != 1:
            return self.announced() or reason
        assert self.store is not None
        self.store.set(self.prefix + "reason", reason)
        deadline = time.monotonic() + HEARD_S
        while self._count("heard") < len(self.peers) - 1 - gone and time.monotonic() < deadline:
            time.sleep(0.05)
        return reason

    def announced(self) -> str | None:
        """What a rank announced, if any (read: counted as heard)."""
        if self.store is None or not self._count("gone"):
            return None
        reason = bytes(self.store.get(self.prefix + "reason")).decode()
        if not self._heard_it:
            self._heard_it = True
            self._count("heard", 1)
        return reason

    def stop(self, finished: bool) -> None:
        """``finished``: this rank's call ended normally; its peers stop watching too."""
        if finished and self.store is not None:
            with contextlib.suppress(Exception):
                self._count("finished", 1)
        self.stopped.set()

    def _local(self) -> tuple[str, int] | None:
        """The peers on this host that are dead or stopped: (``describe``'s words, how many)."""
        dead = [(r, pid) for r, pid in dead_peers(self.peers) if r != self.rank]
        if dead:
            return describe(self.peers, dead, "no longer running"), len(dead)
        stalled = [(r, pid) for r, pid in stopped_peers(self.peers) if r != self.rank]
        return (
            (describe(self.peers, stalled, "stopped (SIGSTOP)"), len(stalled)) if stalled else None
        )

    def _silent(self) -> tuple[str, int] | None:
        """The next rank on another host, when its heartbeat has not moved for ``silent_s``."""
        n = self.neighbour
        if n is None:
            return None
        beat, now = self._count(f"beat/{n}"), time.monotonic()
        if beat != self._beat:
            self._beat, self._heard = beat, now
        elif now - self._heard > self.silent_s:
            return describe(
                self.peers, [(n, self.peers[n][1])], f"silent for {self.silent_s:g} s"
            ), 1
        return None

    def share(self, wait_s: float = 0.0) -> str | None:
        """For a failing rank's report: what a rank announced, or this host's dead or stopped peers
        (announced now, for the other nodes), waiting up to ``wait_s`` for either."""
        deadline = time.monotonic() + wait_s
        while self.store is not None:
            reason = self.announced()
            if reason is None and (found := self._local()) is not None:
                reason = self.announce(*found)
            if reason is not None or time.monotonic() >= deadline:
                return reason
            time.sleep(0.1)
        return None

    def _check(self) -> str | None:
        self._count(f"beat/{self.rank}", 1)
        announced = self.announced()
        if announced is not None:
            return announced
        found = self._local() or self._silent()
        if found is None or self._count("finished"):  # a peer that finished, then left
            return None
        return self.announce(*found)

    def run(self) -> None:
        host, port = self.address
        timeout = timedelta(seconds=self.silent_s)
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except Exception:  # noqa: BLE001 - no store, no watch: the collective timeout remains
            return
        unreachable_since: float | None = None
        while not self.stopped.wait(
            self.interval_s if unreachable_since is None else UNREACHABLE_INTERVAL_S
        ):
            try:
                if self._count("finished"):
                    return
                reason = self._check()
                unreachable_since = None
            except Exception:  # noqa: BLE001 - the store's host is gone, or going
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since < self.silent_s:
                    continue
                reason = (
                    f"the job's store at {host}:{port} has not answered for {self.silent_s:g} s "
                    "(the host serving it is gone: node 0's torchrun agent, or rank 0)"
                )
            if reason is not None and not self.stopped.is_set():
                self.on_gone(reason)
                return
