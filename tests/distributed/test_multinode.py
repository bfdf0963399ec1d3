"""Rank death without our launcher: two torchrun "nodes" on this machine (2 x 2 ranks, each node
with a host name of its own, ``TITAN_HOST``, so that no rank sees the other node's processes), one
rank of node 0 dies mid-step (or node 0 whole: node 1 names its ranks). torchrun's agent sees only
its own workers; node 1 learns of the death from the ranks themselves (``runtime/peer_watch.py``):
every process of both nodes is gone within seconds, not ``timeout_minutes``, and ``--ckpt_path
last`` continues the uninterrupted curve.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_reliability import (  # noqa: F401 - reference, work: fixtures
    SCRIPTS,
    STEPS,
    _global_step,
    launch,
    logged_steps,
    losses,
    reference,
    work,
    write_config,
)

from lightning_titan.runtime.launch import free_port
from lightning_titan.runtime.peer_watch import PeerWatch, next_remote
from lightning_titan.runtime.peers import HOST_ENV

DP2_PP2 = {"dp": 2, "pp": 2, "ep": 1}  # 4 ranks; the reference (pp=2) within float tolerance
DOWN_WITHIN_S = 60.0  # death to the last process of both nodes gone


def two_nodes(*tail: str) -> list[str]:
    """Two torchrun agents of 2 ranks each running ``tail`` (a module or a script and its
    arguments), in one shell whose exit code is node 0's, else node 1's."""
    port = free_port()
    agents = [
        f"TITAN_HOST=node{node} " + shlex.join([
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
            "2", "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port",
            str(port), *tail,
        ])
        for node in (0, 1)
    ]  # fmt: skip
    script = f"{agents[0]} & a=$!; {agents[1]} & b=$!; wait $a; ra=$?; wait $b; rb=$?; "
    return ["bash", "-c", script + "exit $(( ra ? ra : rb ))"]


def said(job) -> str:
    """The job's own lines (torchrun's reports bury them at the end of stderr)."""
    return "\n".join(line for line in job.stderr.splitlines() if "titan" in line or "rank" in line)


def named_on_node_1(stderr: str, rank: int, state: str) -> bool:
    """A rank of node 1 (2 or 3) said that ``rank`` of node 0 is ``state``."""
    pattern = rf"\[titan\] rank [23]/4\b.*rank {rank} \(pid \d+, host node0\) is {state}"
    return re.search(pattern, stderr) is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_rank_takes_both_nodes_down_while_the_others_wait_in_what_never_fails(tmp_path):
    """tests/support/scripts/dead_rank.py stuck on 2 nodes: rank 1 exits with code 7 at step 3, the
    other three wait in something that never fails (as NCCL does not notice a dead peer). Node 0's
    agent ends its node; node 1 has no one to tell it but the ranks' watch."""
    out = tmp_path / "stuck"
    cmd = two_nodes(str(SCRIPTS / "dead_rank.py"), "stuck", str(out), "2")
    job = launch(cmd, tmp_path, tmp_path / "cache", out, timeout=240)
    ended = time.time()  # launch() returned: every process of both nodes is gone
    assert job.returncode != 0, job.stderr[-3000:]
    failed = re.search(r"rank 1 reached the failure step at ([\d.]+)", job.stderr)
    assert failed, job.stderr[-3000:]
    down = ended - float(failed[1])
    print(f"rank 1's exit to every process of both nodes gone: {down:.1f} s")
    assert down < DOWN_WITHIN_S, f"both nodes took {down:.1f} s to come down:\n{job.stderr[-3000:]}"
    assert named_on_node_1(job.stderr, 1, "no longer running"), said(job)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_under_torchrun_takes_both_nodes_down_and_last_resumes(
    work,  # noqa: F811 - the fixtures of test_reliability
    reference,  # noqa: F811
):
    """kill -9 of rank 1 (node 0) in step 2's forward: both nodes are down within 60 s, a rank of
    node 1 names rank 1 (or node 0's ranks, where gloo's closed connection came first), and the same
    two torchrun commands with ``--ckpt_path=last`` continue the uninterrupted curve (reference:
    pp=2 on 2 ranks; here dp=2 x pp=2, within rel 1e-5)."""
    root, cache = work
    run = "two_nodes"
    config = write_config(root, run, DP2_PP2, async_save=False)  # `last` of step 2 complete
    fit = ["-m", "lightning_titan", "fit", "--config", str(config), "--trainer.num_nodes=2"]
    job = launch(two_nodes(*fit), root, cache, config, timeout=240,
                 fault="rank=1,step=2,phase=forward,action=kill")  # fmt: skip
    assert job.fault_at is not None, job.stderr[-3000:]
    assert job.returncode != 0, job.stderr[-3000:]
    down = job.seconds - job.fault_at
    print(f"kill -9 to every process of both nodes gone: {down:.1f} s")
    assert down < DOWN_WITHIN_S, f"both nodes took {down:.1f} s to come down:\n{job.stderr[-3000:]}"
    # node 1 learns it from the watch, or first from gloo's own error on a collective with node 0
    # (a closed connection: gloo notices a dead peer, NCCL would not; the test above is that case),
    # which names node 0's ranks when nobody announced which one died
    gloo_first = re.search(
        r"\[titan\] rank [23]/4\b.*failed: a rank of another host closed its connection, none on "
        r"this one \(node1\) died: ranks 0, 1 on node0 \(a node lost, or its network\); "
        r".*Connection closed by peer",
        job.stderr,
    )
    assert named_on_node_1(job.stderr, 1, "no longer running") or gloo_first, said(job)
    resumes_at = _global_step(root / run / "ckpt" / "last.ckpt")  # saved after steps 0 and 1
    assert resumes_at == 2, resumes_at

    job = launch(two_nodes(*fit, "--ckpt_path=last"), root, cache, config, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    *_, resumed_steps = logged_steps(root, run)  # a resume: nothing before `last` re-ran
    assert resumed_steps == list(range(resumes_at, STEPS)), resumed_steps
    curve = losses(root, run)
    assert sorted(curve) == list(range(STEPS))
    for step, loss in curve.items():
        assert float(loss) == pytest.approx(float(reference[step]), rel=1e-5), step


def _kill_node_0(launcher: subprocess.Popen, line: str) -> None:
    """An ``on_stderr``: once rank 0 holds in its step (TITAN_FAULT's note), SIGKILL every process
    of node 0 (its agent, which serves the store, and its ranks): a node lost whole."""
    if "TITAN_FAULT fired" not in line:
        return
    time.sleep(1.0)  # node 1's ranks in their collective with node 0
    for entry in Path("/proc").iterdir():
        try:
            node_0 = (
                entry.name.isdigit() and b"TITAN_HOST=node0\0" in (entry / "environ").read_bytes()
            )
        except OSError:
            continue
        if node_0 and int(entry.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_lost_whole_is_named_by_the_other_node(
    work,  # noqa: F811 - the fixtures of test_reliability
):
    """Node 0 (its torchrun agent, which serves the store, and both its ranks) is killed at once in
    step 2: nobody is left there to say which rank died, and node 1's ranks see gloo's closed
    connection. A rank of node 1 names node 0's ranks and host; both nodes are down in seconds."""
    root, cache = work
    config = write_config(root, "lost_node", DP2_PP2, async_save=False)
    fit = ["-m", "lightning_titan", "fit", "--config", str(config), "--trainer.num_nodes=2"]
    job = launch(two_nodes(*fit), root, cache, config, timeout=240, on_stderr=_kill_node_0,
                 fault="rank=0,step=2,phase=forward,action=note")  # fmt: skip
    assert job.fault_at is not None, job.stderr[-3000:]
    assert job.returncode != 0, job.stderr[-3000:]
    down = job.seconds - job.fault_at
    print(f"node 0 lost to every process of both nodes gone: {down:.1f} s")
    assert down < DOWN_WITHIN_S, f"both nodes took {down:.1f} s to come down:\n{said(job)}"
    named = (
        r"\[titan\] rank [23]/4\b.*failed: a rank of another host closed its connection, none on "
        r"this one \(node1\) died: ranks 0, 1 on node0 \(a node lost, or its network\)"
    )
    assert re.search(named, job.stderr), said(job)


# -- the watch itself, in this process (a store of its own, peers made up) ------------------------------
@pytest.fixture
def store(monkeypatch):
    """A store on a free port, as MASTER_ADDR:MASTER_PORT; this process on host "a"."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv(HOST_ENV, "a")
    yield server
    del server


def _watch(peers, rank, found, **kwargs) -> PeerWatch:
    """Rank ``rank``'s watch; every watch of a test on the same keys, as the ranks of one call."""
    watch = PeerWatch(peers, rank, found.append, interval_s=0.05, **kwargs)
    watch.prefix = "/test/"
    watch.start()
    return watch


def test_the_watch_announces_a_dead_peer_of_its_host_to_every_rank(store):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    peers = [("a", os.getpid()), ("a", dead.pid), ("b", os.getpid())]
    seen, heard = [], []
    finder = _watch(peers, 0, seen)
    other = _watch([(h, os.getpid() if h == "a" else p) for h, p in peers], 2, heard)  # host "b"
    for w in (finder, other):
        w.join(timeout=30)
    reason = f"rank 1 (pid {dead.pid}, host a) is no longer running"
    assert seen == [reason] and heard == [reason]
    assert next_remote(peers, 0) == 2 and next_remote(peers, 2) == 0
    assert next_remote([("a", 1), ("a", 2)], 0) is None


def test_a_silent_peer_on_another_host_is_gone_and_a_finished_one_is_not(store):
    peers = [("a", os.getpid()), ("b", 1)]  # rank 1 never beats
    seen = []
    _watch(peers, 0, seen, silent_s=0.5).join(timeout=30)
    assert seen == ["rank 1 (pid 1, host b) is silent for 0.5 s"]
    seen.clear()
    store.delete_key("/test/gone")  # a new call: a peer that finishes
    finished = _watch(peers, 1, seen)
    watch = _watch(peers, 0, seen, silent_s=2.0)
    time.sleep(0.5)
    finished.stop(finished=True)
    watch.join(timeout=30)
    assert not watch.is_alive() and seen == []
