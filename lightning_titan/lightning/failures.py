"""Failing together during training: reports that name the rank.

- a rank that raises reports who it is and leaves; the supervisor brings the rest down
  (:func:`report_failure`); during setup, barriers and broadcasts are agreements so that a failing
  rank can join the one its peers wait in (``TitanStrategy.barrier``, ``runtime/agreement.py``);
- a non-finite loss or gradient norm is the training step's to handle (``train/nonfinite.py``).
"""

from __future__ import annotations

from typing import Any

from lightning_titan.lightning import supervisor
from lightning_titan.lightning.layout import Layout
from lightning_titan.runtime.agreement import distributed


def report_failure(
    exception: BaseException,
    layout: Layout,
    env: Any,
    *,
    trainer: Any,
    peers: list[tuple[str, int]] | None,
    grace_s: float,
    code: int = 1,
) -> None:
    """Print which rank failed and why (naming dead peers); a rank in a started job then leaves,
    with ``code`` (``supervisor.leave_after_failure``).
    ``env``: the cluster environment (None, or no process group yet: the launcher failed)."""
    started = distributed() or (env is not None and env.creates_processes_externally)
    if started:
        dims = layout.dims
        where = dims.label(dims.rank)
        if trainer is not None:
            where += f", global_step={trainer.global_step}"
        who, rank = f"rank {dims.rank}/{dims.world_size} ({where})", dims.rank
    else:  # no rank started yet (popen), or the parent of fork/spawn ranks
        who, rank = "the launcher", 0
    # this host's dead peers, shared with the other nodes; or what another node's rank found; or,
    # for a connection closed from a node lost whole (nobody left there to say), that node's ranks
    blamed = supervisor.blamed_peers(exception, rank=rank, peers=peers)
    blamed = supervisor.watched_blame(exception, blamed)
    blamed = blamed or supervisor.lost_hosts(exception, rank=rank, peers=peers)
    supervisor.say(supervisor.failure_report(exception, who=who, blamed=blamed))
    if distributed():
        # a dead or stopped peer's fault: the report names it, and this rank's traceback (gloo's
        # "Timed out waiting ...ms", a closed connection) would bury that line
        supervisor.leave_after_failure(grace_s, traceback=not blamed, code=code)


def unreduced_step_error() -> RuntimeError:
    return RuntimeError(
        "optimizer.step() was called on gradients that are not reduced yet: under manual "
        "optimization let the strategy's step finish them before the update, with "
        "`self.trainer.strategy.train_step.run(...)` (TitanLM.training_step) or "
        "`.update(your_backward)` around a backward of your own"
    )
