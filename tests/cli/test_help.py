"""`titan fit --help` names every TitanStrategy argument with its help, after jsonargparse's own
help (which shows the subclass-typed --trainer.strategy as one line)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_titan import TitanStrategy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fit_help_names_every_strategy_argument_with_its_help():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_titan", "fit", "--help"],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "--model.lora" in proc.stdout and "--data.global_batch_size" in proc.stdout
    names = [
        n
        for n, p in inspect.signature(TitanStrategy.__init__).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    assert {"dp", "pp", "ep", "tp", "cp", "schedule", "zero", "async_save"} <= set(names)
    for name in names:
        at = next(
            i for i, line in enumerate(lines) if line.startswith(f"  --trainer.strategy.{name} ")
        )
        assert lines[at + 1].startswith(" " * 8) and lines[at + 1].strip(), name  # its help
    # the schedules' names, as choices
    schedule = next(line for line in lines if line.startswith("  --trainer.strategy.schedule "))
    assert "dualpipev" in schedule and "1f1b" in schedule
