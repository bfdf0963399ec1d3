"""``titan doctor --cpu``: every row passes on CPU ranks and prints its table and JSON; a row that
hangs (a fault planted through ``TITAN_FAULT``) is killed at its deadline, named, and fails the
command while the next row still runs; the judges fail rows whose numbers are off."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_titan.checkpoint.selfcheck import _report
from lightning_titan.tools import doctor

ROOT = Path(__file__).resolve().parents[2]


def _doctor(
    args: list[str], fault: str | None = None, timeout: float = 240
) -> tuple[int, str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TITAN_FAULT", None)
    if fault:
        env["TITAN_FAULT"] = fault
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.timeout(300)
def test_cpu_mode_every_row_passes(tmp_path: Path) -> None:
    report = tmp_path / "doctor.json"
    start = time.monotonic()
    code, out, err = _doctor(["-m", "lightning_titan.tools.doctor", "--cpu", "--json", str(report)])
    seconds = time.monotonic() - start
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["row", "result", "seconds"]
    for name in doctor.ROWS:
        (line,) = [x for x in lines if x.split()[:1] == [name]]
        assert line.split()[1] == "pass", line
    assert lines[-1] == "every row passed"
    parsed = json.loads(report.read_text())
    assert parsed["ok"] is True
    assert [r["row"] for r in parsed["rows"]] == list(doctor.ROWS)
    assert all(r["status"] == "pass" and r["seconds"] > 0 for r in parsed["rows"])
    by_row = {r["row"]: r["numbers"] for r in parsed["rows"]}
    # the expert GEMM path is named: fp32 rows take the grouped GEMM on CPU
    assert "expert GEMM: grouped fp32" in by_row["ep2_fp32"]
    assert "byte-equal to a synchronous save, staged on host" in by_row["background_save"]
    assert seconds < 120, f"titan doctor --cpu took {seconds:.0f} s (aim: under 60)"


@pytest.mark.slow  # ~40 s: the command's Lightning import, the 20 s deadline, the next row
@pytest.mark.timeout(300)
def test_a_hung_row_is_killed_named_and_fails_the_command() -> None:
    # rank 1 stops in its second step's all-to-all (and waits there for a signal that never comes);
    # rank 0 waits in the same all-to-all: the row's deadline kills both
    code, out, err = _doctor(
        ["-m", "lightning_titan", "doctor", "--cpu", "--only", "ep2_fp32", "compile",
         "--timeout-s", "20", "--json", "-"],
        fault="rank=1,step=1,phase=all_to_all,action=note",
    )  # fmt: skip
    assert code == 1, out + err
    parsed = json.loads(out)  # --json -: stdout is the JSON alone, the table on stderr
    assert parsed["ok"] is False
    rows = {r["row"]: r for r in parsed["rows"]}
    assert rows["ep2_fp32"]["status"] == "FAIL"
    assert "did not finish within 20 s" in rows["ep2_fp32"]["numbers"]
    assert rows["ep2_fp32"]["seconds"] < 60
    # the next row ran (one rank, rank 0: the fault, armed in every row, never fires there)
    assert rows["compile"]["status"] == "pass"
    assert "failed: ep2_fp32" in err.splitlines()


def _smoke(losses: list[float], reference: list[float], one_gemm: str = "loop") -> list[list[dict]]:
    rank = {"losses": losses, "norms": [1.0] * len(losses), "syncs": None, "gemm": ["loop"]}
    one = {"losses": reference, "norms": [1.0] * len(reference), "syncs": None, "gemm": [one_gemm]}
    return [[rank, dict(rank)], [one]]


def test_the_judges_fail_rows_whose_numbers_are_off() -> None:
    ok, numbers = doctor._judge_smoke("ep2_fp32", _smoke([4.0, 3.9], [4.0, 3.9 * (1 + 5e-5)]))
    assert ok and "grad norms 5.0e-05 (tol 1e-04)" in numbers and "n/a (CPU)" in numbers
    ok, _ = doctor._judge_smoke("ep2_fp32", _smoke([4.0, 3.9], [4.0, 3.9 * (1 + 2e-4)]))
    assert not ok
    ok, _ = doctor._judge_smoke("ep2_bf16", _smoke([4.0, 3.9], [4.0, 3.9 * (1 + 2e-4)]))
    assert ok  # bf16's tolerance
    # the expert GEMM path is reported; a layout that changed it fails the row
    ok, numbers = doctor._judge_smoke("ep2_bf16", _smoke([4.0], [4.0], "grouped bf16"))
    assert not ok and "loop [differs from one device] (one device: grouped bf16)" in numbers
    ok, numbers = doctor._judge_smoke("ep2_bf16", _smoke([4.0], [4.0]))
    assert ok and "expert GEMM: loop (one device: loop)" in numbers
    assert doctor.rel_diff([1.0, math.nan], [1.0, 1.0]) == math.inf
    same = {"losses": [2.0], "norms": [0.5]}
    assert doctor._judge_pipeline("dualpipev", [[{"1f1b": same, "dualpipev": same}]])[0]
    for off in ({"losses": [2.1], "norms": [0.5]}, {"losses": [2.0], "norms": [1.0]}):
        # a loss or a grad norm off (a grad scaled twice, which Adam's step would hide)
        assert not doctor._judge_pipeline("dualpipev", [[{"1f1b": same, "dualpipev": off}]])[0]
    # the save row passes background_round_trip's verdict on, with its problems
    ranks = [{"device": "cuda:0", "staged": ["cpu"], "pinned": True, "writer": ["cuda:0"],
              "contexts": [0], "call_ms": 1.0, "write_ms": 2.0},
             {"device": "cuda:1", "staged": ["cpu"], "pinned": True, "writer": ["cuda:1"],
              "contexts": [1], "call_ms": 1.0, "write_ms": 2.0}]  # fmt: skip
    good = _report(ranks, ["__0_0.distcp", "meta.pt"], [])
    assert doctor._judge_save("background_save", [[good, good]])[0]
    ranks[1]["contexts"] = [0, 1]  # rank 1's writer made a context on GPU 0
    ranks[0]["staged"] = ["cuda"]  # rank 0's staging moved its copies back to the device
    bad = _report(ranks, ["meta.pt"], ["meta.pt"])
    ok, numbers = doctor._judge_save("background_save", [[bad, bad]])
    assert not ok
    assert "differ in ['meta.pt']" in numbers
    assert "rank 1 on cuda:1: CUDA contexts on other devices [0]" in numbers
    assert "rank 0: staged tensors on ['cuda']" in numbers
    compiled = {"eager": same, "compiled": same, "graphs": 3, "compile_s": 1.0}
    assert doctor._judge_compile("compile", [[compiled]])[0]
    nothing = {**compiled, "graphs": 0}
    assert not doctor._judge_compile("compile", [[nothing]])[0]  # nothing compiled: no check
