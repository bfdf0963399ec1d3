"""Errors agreed across ranks (setup, checkpoints) and the manual-optimization guard."""

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_titan.runtime.agreement import _portable, agree
from lightning_titan.runtime.launch import run_on_ranks

SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "scripts"


def _decode_error() -> UnicodeDecodeError:
    try:
        b"\xff".decode("utf-8")
    except UnicodeDecodeError as e:
        return e
    raise AssertionError("unreachable")


def test_an_error_whose_constructor_wants_more_arguments_still_travels():
    kind, message = _portable(_decode_error())
    assert kind is RuntimeError and message.startswith("UnicodeDecodeError: 'utf-8' codec")
    assert _portable(ValueError("bad value")) == (ValueError, "bad value")

    class Mine(Exception):
        pass

    assert _portable(Mine("x")) == (RuntimeError, "Mine: x")  # peers may not unpickle Mine


def _agree_on_rank(rank: int, world_size: int) -> str:
    try:
        agree(_decode_error() if rank == 1 else None, payload=rank)
    except BaseException as e:  # noqa: BLE001 - the test wants what each rank raised
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(120)
def test_every_rank_raises_the_failing_ranks_error():
    raised = run_on_ranks(_agree_on_rank, 2, timeout_s=90, start_method="fork")
    assert raised[0].startswith("RuntimeError: UnicodeDecodeError: 'utf-8' codec")
    assert raised[0].endswith("(raised on rank 1)")
    assert raised[1] == raised[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_manual_optimization_cannot_step_on_unreduced_gradients():
    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPTS / "manual_step.py"), mode],
            capture_output=True, text=True, timeout=150,
        )  # fmt: skip

    skipped = run("skip")
    assert skipped.returncode != 0
    assert "optimizer.step() was called on gradients that are not reduced yet" in skipped.stderr
    finished = run("step")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "TRAINED 2" in finished.stdout
