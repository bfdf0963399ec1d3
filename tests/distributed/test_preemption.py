"""Preemption, interrupts, orphans and stalls: SIGTERM and Ctrl-C stop every rank after the same step
with ``last`` saved, a stopped rank is named and killed, ranks leave with a launcher killed at any
time, a taken port is named before any rank starts.

The launches, configs and the reference curve are test_reliability's (its helpers and fixtures; this
module gets its own reference run). A separate module so that the suite's two workers share the
reliability launches.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_reliability import (  # noqa: F401 - reference, work: fixtures
    DOWN_WITHIN_S,
    EP2,
    PP2,
    ROOT,
    SCRIPTS,
    STEPS,
    Job,
    _global_step,
    _kill,
    _leftovers,
    launch,
    logged_steps,
    losses,
    reference,
    titan_fit,
    work,
    write_config,
)

from lightning_titan.runtime.orphans import process_state, running


# -- 6. preemption, interrupts, orphans and stalls (issue 13) ---------------------------------------------
def _no_temp_dirs(ckpt: Path) -> None:
    leftovers = [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]
    assert not leftovers, leftovers


def _preempted_at(job: Job, how: str = "preempted", name: str = "SIGTERM") -> int:
    """The global step every rank says it stopped after (the same on both ranks)."""
    steps = re.findall(rf"\[titan\] rank \d/2 {how} \({name}\) after global_step=(\d+)", job.stderr)
    assert len(steps) == 2 and len(set(steps)) == 1, job.stderr[-3000:]
    return int(steps[0])


def _signal_launcher(
    signum: int, sent: list[float], forwarded: bool = False
) -> Callable[[subprocess.Popen, str], None]:
    """An ``on_stderr``: the signal to the launcher (popen: rank 0; fork: the parent), as a scheduler
    or a terminal sends it, when the TITAN_FAULT ``note`` line is printed; ``sent``: when. The noting
    rank waits in its step for SIGUSR1, sent once the signal is out (``forwarded``: once the noting
    rank says it got the parent's SIGTERM), so that no load can run the job past that step first."""
    noting: list[int] = []

    def on_line(launcher: subprocess.Popen, line: str) -> None:
        if fired := re.search(r"TITAN_FAULT fired: rank \d \(pid (\d+)\) note in", line):
            noting.append(int(fired.group(1)))
            sent.append(time.monotonic())
            os.kill(launcher.pid, signum)
            if not forwarded:
                _release(noting[0])
        elif forwarded and noting and f"pid {noting[0]} got SIGTERM" in line:
            _release(noting[0])

    return on_line


def _release(pid: int) -> None:
    """SIGUSR1 to a rank waiting in TITAN_FAULT's ``note``; it may be gone (its launcher stopped it)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_saves_last_and_exits_143_and_an_interrupt_stops_a_fork_run(work, reference):  # noqa: F811 - the fixtures of test_reliability
    """1. popen: SIGTERM to the launcher (rank 0) while rank 1 is in step 2: both ranks finish the
    step they are in, save `last` and exit 143, the launcher after them, within seconds; no temp dir.
    2. fork, resumed from that `last`: the curve continues; an interrupt (SIGINT) of the parent during
    step 4 stops both ranks (they save `last` after the step they are in) instead of returning."""
    root, cache = work
    config = write_config(root, "preempt", PP2)
    ckpt = root / "preempt" / "ckpt"
    sent: list[float] = []
    start = time.monotonic()
    job = titan_fit(config, root, cache, fault="rank=1,step=2,phase=forward,action=note",
                    on_stderr=_signal_launcher(signal.SIGTERM, sent))  # fmt: skip
    assert sent and job.returncode == 143, job.stderr[-3000:]
    first_stop = _preempted_at(job)
    assert first_stop == 3, first_stop  # after step 2: rank 1 waited in it for the signal
    down = start + job.seconds - sent[0]
    assert down < DOWN_WITHIN_S, f"{down:.1f} s from SIGTERM to every rank gone"
    assert job.seconds - job.launcher_s < 10
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".ckpt"))
    assert saved == [f"epoch=0-step={s}.ckpt" for s in range(2, first_stop + 1, 2)] + ["last.ckpt"]
    assert _global_step(ckpt / "last.ckpt") == first_stop
    _no_temp_dirs(ckpt)

    interrupted: list[float] = []
    fork = "--trainer.strategy.init_args.start_method=fork"
    start = time.monotonic()
    job = titan_fit(config, root, cache, "--ckpt_path=last", fork,
                    on_stderr=_signal_launcher(signal.SIGINT, interrupted, forwarded=True),
                    fault="rank=0,step=4,phase=forward,action=note")  # fmt: skip
    assert interrupted and job.returncode != 0, job.stderr[-3000:]
    assert "the launcher got KeyboardInterrupt: stopping every rank" in job.stderr
    assert "the launcher was interrupted: every rank has stopped" in job.stderr
    down = start + job.seconds - interrupted[0]
    assert down < DOWN_WITHIN_S, f"{down:.1f} s from the interrupt to every rank gone"
    stopped_at = _preempted_at(job)
    assert stopped_at == 5, stopped_at  # after step 4: rank 0 waited in it for the parent's SIGTERM
    *_, resumed_steps = logged_steps(root, "preempt")
    assert resumed_steps == list(range(first_stop, stopped_at)), resumed_steps
    curve = losses(root, "preempt")
    for step in range(stopped_at):
        assert float(curve[step]) == pytest.approx(float(reference[step]), rel=1e-5), step
    assert _global_step(ckpt / "last.ckpt") == stopped_at
    _no_temp_dirs(ckpt)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(work):  # noqa: F811 - the fixtures of test_reliability
    """SIGTERM to rank 1 alone (a node agent signalling one process) during step 2: the ranks agree,
    both finish step 2, save `last` (global step 3) and exit 143, the launcher after them."""
    root, cache = work
    config = write_config(root, "preempt_rank", PP2)
    ckpt = root / "preempt_rank" / "ckpt"
    job = titan_fit(config, root, cache, fault="rank=1,step=2,phase=forward,action=term")
    assert job.returncode == 143, job.stderr[-3000:]
    assert _preempted_at(job) == 3
    assert job.seconds - job.fault_at < DOWN_WITHIN_S, job.seconds - job.fault_at
    assert job.seconds - job.launcher_s < 10
    assert _global_step(ckpt / "last.ckpt") == 3
    _no_temp_dirs(ckpt)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_to_the_popen_launcher_stops_every_rank_after_the_step_with_last_saved(
    work,  # noqa: F811 - the fixtures of test_reliability
    reference,  # noqa: F811
):
    """SIGINT (a terminal's Ctrl+C) to the popen launcher while rank 1 is in step 1: like SIGTERM,
    both ranks finish the step, save `last` and exit, with 130 (the shell's code for SIGINT), instead
    of Lightning's KeyboardInterrupt handling (ranks killed wherever they are, nothing saved)."""
    root, cache = work
    config = write_config(root, "ctrl_c", PP2)
    ckpt = root / "ctrl_c" / "ckpt"
    sent: list[float] = []
    start = time.monotonic()
    job = titan_fit(config, root, cache, fault="rank=1,step=1,phase=forward,action=note",
                    on_stderr=_signal_launcher(signal.SIGINT, sent), timeout=150)  # fmt: skip
    assert sent and job.returncode == 130, job.stderr[-3000:]
    assert "got SIGINT: stopping after this step, saving last" in job.stderr
    # the launcher's watcher knows a rank's 130 after the agreement is no failure
    assert not re.search(r"rank \d \(pid \d+\) exited with code", job.stderr), job.stderr[-3000:]
    stopped_at = _preempted_at(job, "interrupted", "SIGINT")
    assert stopped_at == 2, stopped_at  # after step 1: rank 1 waited in it for the signal
    down = start + job.seconds - sent[0]
    assert down < DOWN_WITHIN_S, f"{down:.1f} s from SIGINT to every rank gone"
    assert job.seconds - job.launcher_s < 10
    assert _global_step(ckpt / "last.ckpt") == stopped_at
    _no_temp_dirs(ckpt)
    curve = losses(root, "ctrl_c")
    assert sorted(curve) == list(range(stopped_at)), curve
    for step in range(stopped_at):
        assert float(curve[step]) == pytest.approx(float(reference[step]), rel=1e-5), step


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_to_the_launcher_during_titan_validate_stops_every_rank_with_143(work):  # noqa: F811 - the fixtures of test_reliability
    """Outside training steps there is no step to finish and nothing to save, but a SIGTERM must still
    stop every rank within seconds, with 143 (Lightning's SIGTERMException alone exits with 0)."""
    root, cache = work
    config = write_config(root, "validate", PP2)
    sent: list[float] = []
    cmd = [sys.executable, "-m", "lightning_titan", "validate", "--config", str(config),
           "--trainer.limit_val_batches=200"]  # fmt: skip
    start = time.monotonic()
    job = launch(cmd, root, cache, config, fault="rank=1,step=0,phase=p2p,action=note",
                 on_stderr=_signal_launcher(signal.SIGTERM, sent), timeout=120)  # fmt: skip
    assert sent and job.returncode == 143, job.stderr[-3000:]
    down = start + job.seconds - sent[0]
    assert down < DOWN_WITHIN_S, f"{down:.1f} s from SIGTERM to every rank gone"
    assert job.seconds - job.launcher_s < 10


# the collective timeout of the stalled-save test: 30 s (it bounds the rendezvous too, which a
# loaded 2-core box running other tests beside it has overrun at 15 s)
STALL_MINUTES = 0.5
STALL_GRACE_S = 20.0  # then to every rank gone: the report, leaving, the stopped rank killed


def _signal_on_fault(signum: int | None) -> Callable[[subprocess.Popen, str], None]:
    """An ``on_stderr``: ``signum`` to the launcher once TITAN_FAULT fired (None: nothing)."""
    sent: list[float] = []

    def on_line(launcher: subprocess.Popen, line: str) -> None:
        if signum is not None and "TITAN_FAULT fired" in line and not sent:
            sent.append(time.monotonic())
            os.kill(launcher.pid, signum)

    return on_line


def _seen_at(text: str) -> tuple[list[float], Callable[[subprocess.Popen, str], None]]:
    """An ``on_stderr`` and the list it fills with when ``text`` was first seen, in seconds from
    this call (made just before the launch: on the clock of ``Job.fault_at``)."""
    seen: list[float] = []
    first = time.monotonic()

    def on_line(launcher: subprocess.Popen, line: str) -> None:
        if text in line and not seen:
            seen.append(time.monotonic() - first)

    return seen, on_line


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_rank_stopped_during_a_background_write_is_named_within_the_timeout(work):  # noqa: F811 - the fixtures of test_reliability
    """Rank 1 stops (SIGSTOP) inside the last step's background write (its shards written, the
    ranks' checksum agreement to come), so rank 0's writer waits in a collective of its own group
    and its main thread, at the end of fit, for that write. With a SIGTERM to the launcher once the
    rank is stopped (the stop it asks for cannot be agreed on): within the collective timeout
    (timeout_minutes, as a synchronous save's collectives) the job fails naming the stopped rank,
    which the launcher kills, with 143. Again with max_restarts=1: the attempt ends within the same
    bound, the launcher names the stopped rank (not rank 0, which timed out waiting for it) and the
    restart finishes the run. (A stall with no SIGTERM and no restart fails the job the same way:
    test_a_stopped_rank_is_named_and_killed.)"""
    root, cache = work
    bound_s = STALL_MINUTES * 60
    fault = f"rank=1,step={STEPS - 1},phase=checkpoint_save,action=stop"
    stopped = r"rank 1 \(pid (\d+)\) is stopped \(SIGSTOP\) and stalled the job"
    restarts = "--trainer.strategy.init_args.max_restarts=1"
    for run, signum, extra in (("stall_save_term", signal.SIGTERM, []),
                               ("stall_save_restart", None, [restarts])):  # fmt: skip
        config = write_config(root, run, EP2, timeout_minutes=STALL_MINUTES)
        restarted, on_restart = _seen_at("restarting every rank")
        on_stderr = on_restart if extra else _signal_on_fault(signum)
        job = titan_fit(config, root, cache, *extra, fault=fault, on_stderr=on_stderr,
                        timeout=240 if extra else 120)  # fmt: skip
        assert job.fault_at is not None, job.stderr[-3000:]
        named = re.search(rf"\[titan\] rank 0/2 .*failed: {stopped}", job.stderr)
        assert named, job.stderr[-3000:]
        if extra:  # the stalled attempt's end: the launcher's restart line
            assert restarted, job.stderr[-3000:]
            down = restarted[0] - job.fault_at
            print(f"{run}: {down:.1f} s from the stop to the restart, rc {job.returncode}")
            assert down < bound_s + STALL_GRACE_S, f"{run}: {down:.1f} s to the restart"
            assert job.returncode == 0, job.stderr[-3000:]
            assert job.stderr.count("TITAN_FAULT fired") == 1, job.stderr[-3000:]
            assert re.search(rf"\[titan\] {stopped}: restarting every rank \(1 of 1\) from \S+",
                             job.stderr), job.stderr[-3000:]  # fmt: skip
            assert "[titan] resuming from step" in job.stderr, job.stderr[-3000:]
            continue
        down = job.seconds - job.fault_at
        print(f"{run}: {down:.1f} s from the stop to every rank gone, rc {job.returncode}")
        assert down < bound_s + STALL_GRACE_S, f"{run}: {down:.1f} s to every rank gone"
        assert job.returncode == (1 if signum is None else 143), job.stderr[-3000:]
        assert f"rank 1 (pid {named.group(1)}) is stopped (SIGSTOP): killing it" in job.stderr
        if signum is not None:
            assert "got SIGTERM: stopping after this step, saving last" in job.stderr


def _kill_launcher_once_stopped(launcher: subprocess.Popen, line: str) -> None:
    """An ``on_stderr``: SIGKILL to the launcher once the rank TITAN_FAULT stopped is stopped."""
    fired = re.search(r"TITAN_FAULT fired: rank \d+ \(pid (\d+)\) stop", line)
    if fired:
        deadline = time.monotonic() + 10
        while process_state(int(fired.group(1))) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(launcher.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_stopped_rank_is_gone_soon_after_its_launcher_is_killed(work):  # noqa: F811 - the fixtures of test_reliability
    """Rank 1 of a 2-rank fit stops (SIGSTOP) at step 3, then the launcher (rank 0) is killed with
    SIGKILL: the stopped rank cannot act on the launcher's death signal, and the reaper started with
    the ranks kills it; every rank is gone within seconds (launch() fails on any left behind)."""
    root, cache = work
    config = write_config(root, "stopped_orphan", EP2, async_save=False)
    job = titan_fit(config, root, cache, fault="rank=1,step=3,phase=forward,action=stop",
                    on_stderr=_kill_launcher_once_stopped, timeout=120)  # fmt: skip
    assert job.fault_at is not None, job.stderr[-3000:]
    assert job.returncode == -signal.SIGKILL, job.stderr[-3000:]
    down = job.seconds - job.fault_at
    print(f"stopped_orphan: {down:.1f} s from the stop to every rank gone")
    assert down < 15, f"{down:.1f} s to every rank gone"
    assert re.search(r"\[titan\] rank pid \d+ is stopped \(SIGSTOP\) 7 s after its launcher",
                     job.stderr), job.stderr[-3000:]  # fmt: skip


def _dead_rank_job(tmp_path: Path, mode: str, **kwargs) -> Job:
    out = tmp_path / mode
    cmd = [sys.executable, str(SCRIPTS / "dead_rank.py"), mode, str(out)]
    return launch(cmd, tmp_path, tmp_path / "cache", out, timeout=240, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_and_killed(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at step 3: rank 0 times out (5 s) naming the stopped rank and
    what it waited in, and the launcher kills the stopped rank (it would hold the job forever).
    The report is the whole message: rank 0's gloo timeout traceback only echoes it."""
    job = _dead_rank_job(tmp_path, "stop")
    assert job.returncode != 0
    named = re.search(
        r"\[titan\] rank 0/2 .*failed: rank 1 \(pid (\d+)\) is stopped \(SIGSTOP\) and stalled the "
        r"job; this rank was waiting in \S+",
        job.stderr,
    )
    assert named, job.stderr[-3000:]
    assert f"rank 1 (pid {named.group(1)}) is stopped (SIGSTOP): killing it" in job.stderr
    assert "Traceback" not in job.stderr, job.stderr[-3000:]
    assert job.seconds - job.launcher_s < 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_taken_master_port_is_named_before_any_rank_starts(tmp_path):
    """MASTER_PORT is taken: the launcher, which binds the rendezvous store before it starts a rank,
    fails at once and names the port; no rank is left waiting for a rendezvous that never comes."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        job = _dead_rank_job(tmp_path, "plain", env_extra={"MASTER_PORT": port})
    assert job.returncode != 0
    assert f"MASTER_PORT={port} is taken by another process (EADDRINUSE)" in job.stderr, job.stderr[
        -3000:
    ]
    assert job.seconds - job.launcher_s < 10, f"{job.seconds - job.launcher_s:.1f} s"


# runtime/orphans.py is standard library only: loaded by path, without the package (and torch), in a second
_LOAD_ORPHANS = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("orphans", {str(ROOT / "lightning_titan" / "runtime/orphans.py")!r})
orphans = importlib.util.module_from_spec(spec)
spec.loader.exec_module(orphans)
"""
_KILLED_LAUNCHER = (
    _LOAD_ORPHANS
    + """
import os, subprocess, sys, types

shim = types.SimpleNamespace(subprocess=subprocess)  # as Lightning's launcher module holds it
started = LOAD + "orphans.watch_launcher(); print('ready', flush=True); import time; time.sleep(120)"
env = dict(os.environ, TITAN_LAUNCHER_PID=str(os.getpid()))
with orphans.die_with_launcher(shim):
    starting = shim.subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    started = shim.subprocess.Popen([sys.executable, "-c", started], env=env)
    stopped = shim.subprocess.Popen([sys.executable, "-c", started.args[-1]], env=env)
print(starting.pid, started.pid, stopped.pid, flush=True)
started.wait()
""".replace("LOAD", repr(_LOAD_ORPHANS))
)


@pytest.mark.timeout(120)
def test_ranks_die_with_a_launcher_killed_during_start_up(tmp_path):
    """kill -9 of the launcher: a rank still starting (no code of ours ran yet) ends at once, one that
    watches it (from its first import of lightning_titan) within orphans.GONE_S, and a stopped one
    (SIGSTOP: it cannot act on any signal) is killed by the reaper; all within 10 s."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TITAN_LAUNCHER_PID", None)
    parent = subprocess.Popen(
        [sys.executable, "-c", _KILLED_LAUNCHER], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert [parent.stdout.readline().strip() for _ in range(2)] == ["ready"] * 2
        os.kill(pids[2], signal.SIGSTOP)
        while process_state(pids[2]) != "T":
            time.sleep(0.01)
        parent.kill()
        killed = time.monotonic()
        while any(_leftovers(parent.pid, "no-marker")) and time.monotonic() - killed < 20:
            time.sleep(0.05)
        gone_s = time.monotonic() - killed
        assert not _leftovers(parent.pid, "no-marker"), f"{pids} outlived the launcher by 20 s"
        assert gone_s < 10, gone_s
    finally:
        _kill(_leftovers(parent.pid, "no-marker"))
        parent.kill()
        parent.wait()
    said = parent.stderr.read()
    assert f"the launcher (pid {parent.pid}) is gone" in said
    assert f"rank pid {pids[2]} is stopped (SIGSTOP) 7 s after its launcher" in said, said


_KILLED_RUN_ON_RANKS = """
import os, sys, time
from lightning_titan.runtime.launch import run_on_ranks

def wait_for_ever(rank, world_size, folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    import torch.distributed as dist
    if rank == 1:
        time.sleep(600)
    dist.barrier()  # rank 0 waits here for a peer that never comes

if __name__ == "__main__":
    run_on_ranks(wait_for_ever, 2, sys.argv[1], timeout_s=600, start_method="fork")
"""


@pytest.mark.timeout(120)
def test_ranks_of_run_on_ranks_leave_when_its_process_is_killed(tmp_path):
    """The test and bench launcher (run_on_ranks, fork): kill -9 of the process that started the
    ranks leaves no rank waiting for its 600 s collective timeout; both go within 10 s."""
    folder = tmp_path / "pids"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TITAN_LAUNCHER_PID", None)
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_RUN_ON_RANKS, str(folder)], env=env,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids = [int(p.name) for p in folder.iterdir()]
            time.sleep(0.1)
        assert len(pids) == 2, pids
        time.sleep(1.0)  # rank 0 in its barrier, rank 1 asleep
        parent.kill()
        killed = time.monotonic()
        while any(running(p) for p in pids) and time.monotonic() - killed < 20:
            time.sleep(0.05)
        assert not any(running(p) for p in pids), f"{pids} outlived their launcher by 20 s"
        assert time.monotonic() - killed < 10
    finally:
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)
        parent.kill()
        parent.wait()
    assert f"the launcher (pid {parent.pid}) is gone" in parent.stderr.read()
