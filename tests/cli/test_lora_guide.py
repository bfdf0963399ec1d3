"""docs/lora.md runs as written: its python blocks are saved under the name their first line gives,
its bash block runs in a folder holding a copy of configs/, with ``titan`` this checkout's and a few
training steps instead of the guide's twenty."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_lora_guide_runs(tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    bash = []
    for language, body in FENCE.findall((ROOT / "docs" / "lora.md").read_text()):
        if language == "python":
            name = body.splitlines()[0].removeprefix("# ").split(":")[0]
            (tmp_path / name).write_text(body)
        elif language == "bash":
            bash.append(body)
    assert len(bash) == 1 and {"build_qwen3.py", "generate.py"} <= {
        p.name for p in tmp_path.iterdir()
    }
    fork = "--trainer.strategy.init_args.start_method=fork"
    script = bash[0].replace("--trainer.max_steps=20", f"--trainer.max_steps=3 {fork}")
    script = re.sub(r"^titan ", f"{sys.executable} -m lightning_titan ", script, flags=re.M)
    script = re.sub(r"^python ", f"{sys.executable} ", script, flags=re.M)
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        ["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "LoRA" in proc.stdout + proc.stderr  # the end summary's trained-parameter line
    # generate.py: the PEFT adapter on the base and the merged model generate the same bytes
    assert proc.stdout.strip().splitlines()[-1].startswith("True b'")
