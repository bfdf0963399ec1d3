"""The example notebooks run top to bottom (quick mode), and the committed ones match their sources.

Each notebook is executed in a fresh kernel in a temporary folder with TITAN_NOTEBOOK_QUICK=1 (fewer
steps); the assertions inside the notebooks (curves coincide, groups match, EP equals one process) are
what fails the test. Build the notebooks with: python examples/notebooks/build.py
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import nbclient  # test dependencies (pip install -e '.[test]'): missing, the suite must fail loudly
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "examples" / "notebooks"


def _build_module():
    spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build_module()
SOURCES = build.sources()


def test_there_are_five_notebooks():
    assert [s.stem for s in SOURCES] == [
        "01_mesh",
        "02_pipeline_schedules",
        "03_expert_parallelism",
        "04_train_in_3d",
        "05_finetune_pretrained_moe",
    ]


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.stem)
def test_committed_notebook_is_built_from_its_source_without_outputs(source):
    target = source.with_suffix(".ipynb")
    assert target.exists(), f"{target.name} is missing: python examples/notebooks/build.py"
    assert target.read_text() == build.render(source), (
        f"{target.name} differs from {source.name}: python examples/notebooks/build.py"
    )
    cells = json.loads(target.read_text())["cells"]
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    # one prepared corpus for every notebook (preparing it is the slow part of a first run)
    return tmp_path_factory.mktemp("titan_cache")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.stem)
def test_notebook_runs_top_to_bottom(source, tmp_path, shared_cache, monkeypatch):
    monkeypatch.setenv("TITAN_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("LIGHTNING_TITAN_CACHE", str(shared_cache))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # OpenMP threads that spin at barriers crawl when other processes share the cores (a 2-thread
    # single-process fit took 15 s instead of 1 s per 8 steps on a loaded 2-core box); sleeping does not
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    nb = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{source.stem}.ipynb failed:\n{str(error)[-6000:]}")
    print(f"{source.stem}: {time.perf_counter() - start:.1f} s")


# -- the example scripts ---------------------------------------------------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
# srun on one node: SLURM_NTASKS copies of the command, each with the variables srun gives a task
# (srun's own options, such as --kill-on-bad-exit=1, are passed over: every task here succeeds)
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""

SHORT_RUN = ["--accelerator", "cpu", "--max-steps", "2", "--global-batch-size", "8"]


def _train_losses(out: Path) -> list[float]:
    import csv

    (metrics,) = (out / "logs").glob("version_*/metrics.csv")
    return [float(r["train_loss"]) for r in csv.DictReader(open(metrics)) if r.get("train_loss")]


def _run(cmd: list[str], env: dict, timeout: int = 240) -> None:
    import subprocess

    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def test_launch_scripts_parse():
    import subprocess

    for script in ("torchrun.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(ROOT / "examples" / script)], check=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_script_under_each_launcher_gives_the_same_losses(tmp_path, shared_cache):
    """examples/train.py through examples/torchrun.sh as (1, 2, 1) and through examples/slurm.sbatch
    (srun stood in for by a script that starts the tasks here) as (1, 1, 2): each writes a complete
    checkpoint, and the two layouts give the same per-step losses (that each equals one process is
    tests/distributed/test_equivalence.py's and tests/cli/test_cli.py's job)."""
    import os
    import sys

    from lightning_titan.runtime.launch import free_port

    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(shared_cache), "OMP_WAIT_POLICY": "PASSIVE"}
    env["PATH"] = (
        f"{tmp_path / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    )
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)

    torchrun = tmp_path / "torchrun"
    _run(["bash", "examples/torchrun.sh", "--dp", "1", "--pp", "2", "--ep", "1", *SHORT_RUN,
          "--out", str(torchrun)],
         {**env, "NPROC": "2", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable})  # fmt: skip
    slurm = tmp_path / "slurm"
    slurm_env = {**env, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1",
                 "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "titan",
                 "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}  # fmt: skip
    _run(["bash", "examples/slurm.sbatch", *SHORT_RUN, "--pp", "1", "--ep", "2", "--out", str(slurm)],
         slurm_env)  # fmt: skip

    reference = _train_losses(torchrun)
    assert len(reference) == 2
    for out in (torchrun, slurm):
        assert (out / "checkpoints" / "last.ckpt" / "COMPLETE").exists(), out.name
        assert _train_losses(out) == pytest.approx(reference, rel=1e-5), out.name


# -- the docs ----------------------------------------------------------------------------------------


def _gen_reference():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "docs" / "gen_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_generated_from_the_code():
    gen = _gen_reference()
    assert gen.TARGET.read_text() == gen.render(), (
        "docs/reference.md is stale: python docs/gen_reference.py"
    )


def test_every_cli_flag_in_the_reference_exists():
    """The flags docs/reference.md names for the strategy, module, model and data parse in `titan`."""
    import re

    from lightning_titan.cli import TitanCLI, cli_components

    cli = TitanCLI(
        *cli_components(), run=False, args=["--config", str(ROOT / "configs" / "dp_pp_ep.yaml")]
    )
    # LoRA given, so that its fields (a dataclass defaulting to None) are keys too
    args = ["--config", str(ROOT / "configs" / "dp_pp_ep.yaml"), "--model.lora.rank=8"]
    namespace = cli.parser.parse_args(args)
    keys = set(vars(namespace.clone().as_flat()))
    text = _gen_reference().render()
    flags = [f for f in re.findall(r"`--((?:trainer\.strategy|model|data)\.[\w.]+)`", text)
             if not f.endswith("NAME")]  # fmt: skip
    assert len(flags) > 40
    missing = [f for f in flags if f not in keys and not any(k.startswith(f + ".") for k in keys)]
    assert not missing, f"flags in docs/reference.md that titan does not have: {missing}"


def test_docs_link_to_files_that_exist():
    import re

    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
