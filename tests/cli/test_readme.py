"""Every code block of README.md runs, so that the README cannot go stale.

- A ```python block runs in its own process, from a file in a temporary folder, with every
  ``max_steps=N`` made ``max_steps=2``.
- The ```bash blocks run in README order, each as one bash process, in one temporary folder that
  holds a copy of ``configs/``: a later block may use the runs an earlier one wrote, as a reader
  following the README would. ``titan`` there is this checkout's ``python -m lightning_titan``, and
  every ``titan fit`` gets ``--trainer.max_steps=2`` (4 when it resumes with ``--ckpt_path``, so that
  the resume trains); a ``titan bench`` line that reproduces a table runs its cases once, one round
  of one step (the table itself takes minutes to an hour).
- ``pip install SPEC && COMMAND``: the install is not run (the suite runs inside that install).
  Its spec must name pyproject's package, torch at or above pyproject's floor and an extra that
  exists; ``COMMAND`` runs, except ``python -m pytest`` (this suite), which must be what ``.ci/run``
  runs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
PIP = re.compile(r"^pip install (?P<spec>.+?) && (?P<command>.+)$")


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def _lines(block: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _tiny(line: str) -> str:
    """A `titan fit` line with a small max_steps (forked ranks, one validation batch), a `titan bench` line with one round of one step
    (the cases, worlds and peers as written), placed before any trailing comment."""
    command, hash_, comment = line.partition(" #")
    if command.lstrip().startswith("titan fit"):
        steps = 4 if "--ckpt_path" in command else 2
        # forked ranks share the launcher's imports: 8 ranks start in seconds, not 8 x 6 CPU-s
        fork = "--trainer.strategy.init_args.start_method=fork"
        command = (
            f"{command.rstrip()} --trainer.max_steps={steps} --trainer.limit_val_batches=1 {fork}"
        )
    elif command.lstrip().startswith("titan bench") and "--quick" not in command:
        command = re.sub(r" --(?:rounds|steps|warmup) \d+", "", command.rstrip())
        command += " --rounds 1 --steps 1 --warmup 1 --out bench"
    else:
        return line
    return command + (f"  #{comment}" if hash_ else "")


def _env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "LIGHTNING_TITAN_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "MPLBACKEND": "Agg",
    }


def test_the_readme_has_only_blocks_this_test_runs():
    languages = [lang for lang, _ in FENCE.findall(README.read_text())]
    assert set(languages) <= {"python", "bash"}, languages
    assert languages.count("python") >= 2 and languages.count("bash") >= 3


def test_the_install_lines_name_this_package_and_ci_runs_the_test_line():
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+, the floor is 3.10
    (floor,) = re.findall(r'^    "torch>=([\d.]+)"', pyproject, re.MULTILINE)
    extras_section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    known_extras = re.findall(r"^(\w+) = \[", extras_section, re.MULTILINE)
    installs = [m for b in blocks("bash") for line in _lines(b) if (m := PIP.match(line))]
    assert len(installs) == 2, [m.group(0) for m in installs]
    for match in installs:
        torch, editable, target = shlex.split(match["spec"])
        assert torch.startswith("torch==") and editable == "-e", match["spec"]
        assert _version(torch[len("torch==") :]) >= _version(floor), (torch, floor)
        extras = re.fullmatch(r"\.(?:\[(\w+)\])?", target)
        assert extras, f"{target}: the README installs this checkout"
        assert extras[1] is None or extras[1] in known_extras, (extras[1], known_extras)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    (test_line,) = [m.group(0) for m in installs if m["command"] == "python -m pytest"]
    assert test_line in ci, f".ci/run must run the README's line: {test_line}"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def _python_blocks() -> list:
    # a block that starts ranks is a training run: the slow tier
    return [
        pytest.param(i, marks=[pytest.mark.slow] if "Trainer(" in block else [])
        for i, block in enumerate(blocks("python"))
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", _python_blocks())
def test_a_python_block_runs(index, tmp_path):
    source = re.sub(r"max_steps=\d+", "max_steps=2", blocks("python")[index])
    (tmp_path / "block.py").write_text(source)
    proc = subprocess.run(
        [sys.executable, "block.py"], cwd=tmp_path, env=_env(tmp_path / "cache"),
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"README python block {index}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    promised = _promised_prints(source)
    if promised:
        assert proc.stdout.splitlines() == promised, "the README's comments say what it prints"


def _promised_prints(source: str) -> list[str]:
    """``print(...)  # VALUE: why`` promises VALUE (a dict or list literal) as that output line."""
    prints = re.findall(r"^print\(.*$", source, re.MULTILINE)
    values = [re.match(r"^print\(.*\)  # ([\[{].*?[\]}])(?::|$)", line) for line in prints]
    return [v[1] for v in values] if prints and all(values) else []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_shell_blocks_run_in_order(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    preamble = f'set -euo pipefail\ntitan() {{ "{sys.executable}" -m lightning_titan "$@"; }}\n'
    for index, block in enumerate(blocks("bash")):
        commands = []
        for line in _lines(block):
            match = PIP.match(line)
            if match and match["command"] == "python -m pytest":
                continue  # this suite: checked against .ci/run above
            commands.append(_tiny(match["command"] if match else line))
        script = preamble + "\n".join(commands) + "\n"
        proc = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=_env(tmp_path / "cache"),
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        assert proc.returncode == 0, (
            f"README bash block {index} failed:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        )
