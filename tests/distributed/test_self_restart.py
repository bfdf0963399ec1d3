"""Restart by itself: a killed rank's job restarts from its last checkpoint (our launcher's
``max_restarts``, or torchrun's) and continues the uninterrupted curve; a dead rank while the
launcher's own collective cannot fail (NCCL's case) still brings the launcher down with its logs.

The launches, configs and the reference curve are test_reliability's (its helpers and fixtures; this
module gets its own reference run). A separate module so that the suite's two workers share the
reliability launches.
"""

from __future__ import annotations

import csv
import re
import sys
import time
from pathlib import Path

import pytest
from test_reliability import (  # noqa: F401 - reference, work: fixtures
    PP2,
    ROOT,
    SCRIPTS,
    STEPS,
    launch,
    logged_steps,
    losses,
    reference,
    work,
    write_config,
)

from lightning_titan.runtime.launch import free_port

# -- restart by itself ----------------------------------------------------------------------------------
RESTARTERS = {
    "launcher": lambda config: [
        sys.executable, "-m", "lightning_titan", "fit", "--config", str(config),
        "--trainer.strategy.init_args.max_restarts=2",
    ],
    "torchrun": lambda config: [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts",
        "2", "--master_port", str(free_port()), "-m", "lightning_titan", "fit", "--config",
        str(config),
    ],
}  # fmt: skip


# how each restarter's job begins: at the reference's checkpoint of step 2 (an explicit --ckpt_path,
# checkpoints written at once after every step), or anew (every 2 steps, written in the background)
BEGINS_AT = {"launcher": 2, "torchrun": 0}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("restarter", list(RESTARTERS))
def test_a_killed_rank_restarts_by_itself_and_continues_the_curve(work, reference, restarter):  # noqa: F811 - the fixtures of test_reliability
    """kill -9 of rank 1 at step 5: the job restarts every rank by itself (our launcher's
    max_restarts, or torchrun's --max-restarts), resumes from the newest complete checkpoint, and
    ends with rc 0. An explicit `--ckpt_path` begins the first launch only: the restart takes the
    newest of the run's own complete checkpoints (steps 3, 4 and 5 there, saved at once), never
    the given one again. Its one CSV holds every step, the re-run steps equal to the uninterrupted
    run's, and no step's checkpoint was written twice (a `-v1`); launch() fails the test if any
    process outlives the job."""
    root, cache = work
    run = f"restart_{restarter}"
    begins = BEGINS_AT[restarter]
    config = write_config(root, run, PP2, every=1 if begins else 2, async_save=not begins)
    given = root / "reference" / "ckpt" / f"epoch=0-step={begins}.ckpt"
    explicit = [f"--ckpt_path={given}"] if begins else []
    job = launch(RESTARTERS[restarter](config) + explicit, root, cache, config, timeout=500,
                 fault="rank=1,step=5,phase=forward,action=kill")  # fmt: skip
    assert job.fault_at is not None, job.stderr[-3000:]
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stderr.count("TITAN_FAULT fired") == 1  # the restart ran clean
    if restarter == "launcher":
        assert "[titan] rank 1 was killed by SIGKILL: restarting every rank (1 of 2)" in job.stderr
    restored = re.findall(
        r"Restored all states from the checkpoint at (\S+)", job.stdout + job.stderr
    )
    assert restored[: bool(begins)] == ([str(given)] if begins else []), restored
    assert len(restored) == 1 + bool(begins), restored
    assert Path(restored[-1]).parent == root / run / "ckpt", restored
    ckpt = root / run / "ckpt"
    twice = [p.name for p in ckpt.iterdir() if re.search(r"-v\d+\.ckpt$", p.name)]
    assert not twice, f"steps trained again after the restart: {sorted(twice)}"
    (steps,) = logged_steps(root, run)  # one version folder: the logs continued
    if begins:  # saved at once after every step: at the kill the newest complete one is step 5's
        assert steps == [2, 3, 4, 5], steps
    else:  # the saves of one event are written in the background while training goes on, so at
        # the kill the newest complete one is global step 4's (`last` or epoch=0-step=4) or, if
        # their write was still in flight, global step 2's (the save of step 4 waited for those)
        again = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
        assert steps[again] in (2, 4) and steps[again:] == list(range(steps[again], STEPS)), steps
        assert steps[:again] == list(range(again)) and set(steps) == set(range(STEPS)), steps
    curve = losses(root, run)
    assert sorted(curve) == list(range(begins, STEPS)), sorted(curve)
    for step in curve:
        assert float(curve[step]) == pytest.approx(float(reference[step]), rel=1e-5), step


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_killed_before_the_first_checkpoint_restarts_from_step_0_and_says_so(
    work,  # noqa: F811 - the fixtures of test_reliability
    reference,  # noqa: F811
):
    """kill -9 of rank 1 at step 1, before any checkpoint is complete (every 2 steps, the first
    written in the background at step 2): the launcher says the restart starts over from step 0 and
    why, the job ends with rc 0, every step is in the run's CSV (the first attempt's rows kept, the
    restart's appended), and the curve from step 0 is the uninterrupted run's."""
    root, cache = work
    run = "restart_from_nothing"
    config = write_config(root, run, PP2, every=2, async_save=True)
    job = launch(RESTARTERS["launcher"](config), root, cache, config, timeout=300,
                 fault="rank=1,step=1,phase=forward,action=kill")  # fmt: skip
    assert job.fault_at is not None, job.stderr[-3000:]
    assert job.returncode == 0, job.stderr[-3000:]
    assert re.search(r"restarting every rank \(1 of 2\) over from step 0: no complete checkpoint",
                     job.stderr), job.stderr[-3000:]  # fmt: skip
    (steps,) = logged_steps(root, run)
    assert set(steps) == set(range(STEPS)) and steps[-(STEPS):] == list(range(STEPS)), steps
    curve = losses(root, run)
    for step in range(STEPS):
        assert float(curve[step]) == pytest.approx(float(reference[step]), rel=1e-5), step


# -- a dead rank while the launcher's own collective cannot fail (NCCL's case) ---------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_launcher_leaves_by_itself_with_its_logs_when_a_rank_dies(tmp_path):
    """Rank 1 dies at step 3 while rank 0 waits in something that never fails (NCCL does not notice
    a dead peer on the same node): rank 0, the launcher, must leave within seconds, and the CSV
    logger's buffered rows of steps 0-2 must be on disk (it writes every 100 steps otherwise)."""
    script = SCRIPTS / "dead_rank.py"
    out = tmp_path / "stuck"
    job = launch([sys.executable, str(script), "stuck", str(out)], tmp_path, tmp_path / "cache",
                 out, timeout=240)  # fmt: skip
    assert job.returncode != 0, job.stderr[-3000:]
    assert re.search(r"rank 1 \(pid \d+\) exited with code 7", job.stderr), job.stderr[-3000:]
    ended = time.time()
    reached = re.search(r"rank 0 reached the failure step at ([\d.]+)", job.stderr)
    assert reached, job.stderr[-3000:]
    assert "leaving with its logs flushed" in job.stderr[reached.end() :], job.stderr[-3000:]
    # the watcher polls every 0.2 s and waits LAUNCHER_WAIT_S = 3 s for a failure of this process
    assert ended - float(reached.group(1)) < 20, f"{ended - float(reached.group(1)):.1f} s"
    rows = list(csv.DictReader(open(next(out.glob("run/version_*/metrics.csv")))))
    assert sorted({int(r["step"]) for r in rows if r.get("train_loss")}) == [0, 1, 2], rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_that_catches_the_failure_keeps_running(tmp_path):
    """Both ranks raise at step 3, and the script catches it and goes on past the grace period: no
    rank may be killed for a failure its caller handled."""
    script = SCRIPTS / "dead_rank.py"
    out = tmp_path / "caught"
    job = launch([sys.executable, str(script), "caught", str(out)], tmp_path, tmp_path / "cache",
                 out, timeout=240)  # fmt: skip
    assert (out / "survived_1").exists(), job.stderr[-3000:]
    assert (out / "survived_0").exists(), job.stderr[-3000:]
    assert job.returncode == 0, job.stderr[-3000:]
