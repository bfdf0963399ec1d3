"""A checkpoint written by an older version of the package (tests/support/fixtures/older_checkpoint, from
pp2 x ep2; expected.json says which) resumes under ep2 and continues on the curve the old code
continued it on: checkpoints outlive the code that wrote them."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "support" / "fixtures" / "older_checkpoint"


@pytest.mark.timeout(300)
def test_a_checkpoint_from_an_older_version_resumes_on_its_curve(tmp_path: Path) -> None:
    want = json.loads((FIXTURE / "expected.json").read_text())
    ckpt = tmp_path / "last.ckpt"
    shutil.copytree(
        FIXTURE / "last.ckpt", ckpt
    )  # a resume may write beside it: never into the repo
    cmd = [sys.executable, "-m", "lightning_titan", "fit", "--config", str(ROOT / "configs" / "ep.yaml"),
           *want["overrides"], "--trainer.max_steps=4", "--trainer.strategy.init_args.start_method=fork",
           "--trainer.logger.init_args.name=resumed", "--ckpt_path", str(ckpt)]  # fmt: skip
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = csv.DictReader(open(tmp_path / "runs" / "resumed" / "version_0" / "metrics.csv"))
    got = {
        r["step"]: (float(r["train_loss"]), float(r["grad_norm"])) for r in rows if r["train_loss"]
    }
    assert sorted(got) == sorted(want["train_loss"]), got
    for step, (loss, norm) in got.items():
        assert loss == pytest.approx(want["train_loss"][step], rel=1e-5), step
        assert norm == pytest.approx(want["grad_norm"][step], rel=1e-4), step
