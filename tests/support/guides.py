"""Run a guide's code blocks as written: its ```python blocks saved under the file name their first
line gives (``# name.py: ...``), its ```bash blocks run in order in a folder holding a copy of
configs/, ``titan`` this checkout's, with the replacements a test gives (fewer steps)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def run_guide(
    text: str, folder: Path, replace: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    """The blocks of ``text`` (a page, or a section of one) in ``folder``; forked ranks."""
    shutil.copytree(ROOT / "configs", folder / "configs")
    bash = []
    for language, body in FENCE.findall(text):
        if language == "python" and body.startswith("# ") and ".py" in body.split("\n", 1)[0]:
            name = body.splitlines()[0].removeprefix("# ").split(":")[0]
            (folder / name).write_text(body)
        elif language == "bash":
            bash.append(body)
    script = "\n".join(bash)
    for old, new in replace.items():
        assert old in script, f"the guide no longer has {old!r}"
        script = script.replace(old, new)
    fork = "--trainer.strategy.init_args.start_method=fork"
    script = re.sub(r"^titan fit (.*)$", rf"titan fit \1 {fork}", script, flags=re.M)
    script = re.sub(r"^titan ", f"{sys.executable} -m lightning_titan ", script, flags=re.M)
    script = re.sub(r"^python ", f"{sys.executable} ", script, flags=re.M)
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(folder / "cache")}
    return subprocess.run(
        ["bash", "-ec", script], cwd=folder, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
