"""``titan doctor``: the first-GPU checklist as one command, a table of pass/fail rows.

    titan doctor                           # every row on this machine's GPUs (NCCL), sized for < 5 min
    titan doctor --only ep2_bf16 compile   # some rows
    titan doctor --cpu                     # gloo on CPU ranks, a tiny model (what the suite runs)
    titan doctor --json doctor.json        # the rows' numbers for a script ("-": stdout)
    python -m lightning_titan.tools.doctor --cpu   # the same without loading the Lightning CLI

Each row launches its ranks afresh (``run_on_ranks``) with a deadline: a row that hangs is killed at
``--timeout-s`` and reported failed, and the next row runs. The exit status is 1 if any row failed.
Rows that need more GPUs than ``--devices`` are skipped, not failed. What each row means and what to
do when one fails: docs/running.md, "First run on GPUs".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools import doctor_rows
from lightning_titan.tools.doctor_rows import Spec

# a tiny model for CPU ranks, and one for GPUs large enough that the grouped GEMM's rows are
# aligned, the pipeline's messages outgrow NCCL's buffers and the kernels are the real ones
CPU_CONFIG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=32, n_experts=4,
    top_k=2, seq_len=16,
)  # fmt: skip
GPU_CONFIG = replace(
    CPU_CONFIG, vocab_size=8192, d_model=512, n_heads=8, n_kv_heads=4, ffn_dim=1024, n_experts=8,
    seq_len=512,
)  # fmt: skip
GLOBAL_BATCH = 8
# per-step losses and grad norms, relative: fp32 layouts differ only in the order of their sums; bf16 rounds every
# GEMM's output to 8 bits of mantissa (2^-8 = 0.4 %), in other places under ep2 than on one device;
# a compiled step fuses ops and rounds in other places than the eager one
TOLERANCE = {"ep2_fp32": 1e-4, "ep2_bf16": 2e-2, "dualpipev": 1e-4, "compile": 1e-3}


@dataclass(frozen=True)
class Row:
    name: str
    what: str  # one line for --help
    run: Callable[..., Any]  # doctor_rows' worker: fn(rank, world, spec, *args)
    # each launch's rank count; the judge gets each launch's per-rank results
    launches: tuple[int, ...]
    judge: Callable[[str, list[list[Any]]], tuple[bool, str]]
    args: tuple[Any, ...] = ()

    @property
    def ranks(self) -> int:
        return max(self.launches)


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss curves (inf where one is not finite)."""
    if len(a) != len(b) or not all(math.isfinite(x) for x in a + b):
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def curves_diff(run: dict[str, list[float]], reference: dict[str, list[float]]) -> float:
    """The largest relative difference of the losses and of the grad norms of two runs."""
    return max(rel_diff(run[k], reference[k]) for k in ("losses", "norms"))


def _judge_smoke(name: str, launches: list[list[Any]]) -> tuple[bool, str]:
    per_rank, (one,) = launches
    losses, reference = per_rank[0]["losses"], one["losses"]
    diff = curves_diff(per_rank[0], one)
    gemm = ", ".join(sorted({p for r in per_rank for p in r["gemm"]}))
    # the layout must not change the kernels' choice: EP's rows arrive in the wire dtype, and a
    # choice that compared them with the weights' dtype fell back to the per-expert loop
    same_gemm = gemm == ", ".join(one["gemm"])
    if not same_gemm:
        gemm += " [differs from one device]"
    syncs = [r["syncs"] for r in per_rank]
    sync_note = "n/a (CPU)" if syncs[0] is None else "/".join(str(s) for s in syncs)
    ok = diff <= TOLERANCE[name] and same_gemm
    numbers = (
        f"loss {losses[-1]:.4f} vs one device {reference[-1]:.4f}, max rel diff of losses and "
        f"grad norms {diff:.1e} "
        f"(tol {TOLERANCE[name]:.0e}); expert GEMM: {gemm} (one device: {', '.join(one['gemm'])}); "
        f"sync warnings per rank in {len(losses)} steps: {sync_note}"
    )
    return ok, numbers


def _judge_pipeline(name: str, launches: list[list[Any]]) -> tuple[bool, str]:
    (per_rank,) = launches
    first = per_rank[0]
    diff = curves_diff(first["dualpipev"], first["1f1b"])
    ok = diff <= TOLERANCE[name]
    return ok, f"max rel diff to 1f1b {diff:.1e} (tol {TOLERANCE[name]:.0e}), no hang"


def _judge_save(name: str, launches: list[list[Any]]) -> tuple[bool, str]:
    """``background_round_trip``'s report, the same on every rank: its checks, and the times."""
    (per_rank,) = launches
    report = per_rank[0]
    if report["ok"]:
        numbers = (
            f"{len(report['compared'])} files byte-equal to a synchronous save, staged on host"
        )
    else:
        numbers = "; ".join(report["problems"])
    slowest = {k: max(r[k] for r in report["ranks"]) for k in ("call_ms", "write_ms")}
    numbers += f"; save call {slowest['call_ms']:.0f} ms, write {slowest['write_ms']:.0f} ms"
    return report["ok"], numbers


def _judge_compile(name: str, launches: list[list[Any]]) -> tuple[bool, str]:
    (per_rank,) = launches
    out = per_rank[0]
    diff = curves_diff(out["compiled"], out["eager"])
    ok = diff <= TOLERANCE[name] and out["graphs"] > 0
    return ok, (
        f"max rel diff to eager {diff:.1e} (tol {TOLERANCE[name]:.0e}); {out['graphs']} graphs, "
        f"first step {out['compile_s']:.1f} s"
    )


ROWS = {
    row.name: row
    for row in (
        Row("ep2_fp32", "ep2 against one device, 32-true", doctor_rows.smoke, (2, 1),
            _judge_smoke, (False,)),
        Row("ep2_bf16", "ep2 against one device, bf16-mixed", doctor_rows.smoke, (2, 1),
            _judge_smoke, (True,)),
        Row("dualpipev", "pp2 x ep2: dualpipev against 1f1b", doctor_rows.pipeline, (4,),
            _judge_pipeline),
        Row("background_save", "dp2 x tp2, zero=1: a background save against a synchronous one",
            doctor_rows.background_save, (4,), _judge_save),
        Row("compile", "one device: compiled against eager", doctor_rows.compile_run, (1,),
            _judge_compile),
    )
}  # fmt: skip


@dataclass
class Result:
    row: str
    status: str  # "pass", "FAIL" or "skip"
    numbers: str
    seconds: float


def run_row(row: Row, spec: Spec, timeout_s: float, backend: str, start_method: str) -> Result:
    start = time.perf_counter()
    try:
        launches = []
        for ranks in row.launches:  # the row's deadline covers all of its launches
            left = timeout_s - (time.perf_counter() - start)
            with tempfile.TemporaryDirectory(prefix=f"titan-doctor-{row.name}-") as scratch:
                launches.append(run_on_ranks(
                    row.run, ranks, replace(spec, scratch=scratch), *row.args,
                    timeout_s=max(left, 1.0), backend=backend, start_method=start_method,
                ))  # fmt: skip
        ok, numbers = row.judge(row.name, launches)
    except Exception as err:  # noqa: BLE001 - a rank's failure or the deadline: the row failed
        ok, numbers = False, _first_lines(str(err))
    return Result(row.name, "pass" if ok else "FAIL", numbers, time.perf_counter() - start)


def _first_lines(message: str) -> str:
    """A rank's traceback as its last line (the error), with the launcher's first (which rank)."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1].strip()}"


def table(results: list[Result]) -> str:
    width = max(len(r.row) for r in results)
    lines = [f"{'row':{width}}  result  {'seconds':>7}  numbers"]
    for r in results:
        lines.append(f"{r.row:{width}}  {r.status:6}  {r.seconds:7.1f}  {r.numbers}")
    failed = [r.row for r in results if r.status == "FAIL"]
    lines.append(f"failed: {', '.join(failed)}" if failed else "every row passed")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    rows = "; ".join(f"{r.name}: {r.what} ({r.ranks} ranks)" for r in ROWS.values())
    parser = argparse.ArgumentParser(
        prog="titan doctor", description=__doc__.split("\n")[0], epilog=f"rows: {rows}"
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU ranks, a tiny model")
    parser.add_argument(
        "--devices",
        type=int,
        help="GPUs to use (default: all); rows needing more are skipped (CPU ranks: no limit)",
    )
    parser.add_argument("--only", nargs="+", choices=list(ROWS), help="run only these rows")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=180.0,
        help="a row's deadline, its launches and a cold compile included (default 180 s)",
    )
    parser.add_argument(
        "--compile-backend",
        help="torch.compile backend of the compile row (default: inductor on GPUs, aot_eager on CPU; "
        "eager is the cheapest)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"titan doctor: --steps {args.steps} must be at least 1")
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit(
            "titan doctor: no CUDA device is visible (torch.cuda.is_available() is False); "
            "check the driver and CUDA_VISIBLE_DEVICES, or run the CPU checks with --cpu"
        )
    devices = (args.devices or torch.cuda.device_count()) if cuda else None
    spec = Spec(
        config=GPU_CONFIG if cuda else CPU_CONFIG,
        global_batch=GLOBAL_BATCH,
        steps=args.steps,
        cuda=cuda,
        compile_backend=args.compile_backend or ("inductor" if cuda else "aot_eager"),
    )
    # forked CPU ranks start in a second; CUDA does not survive a fork
    backend, start_method = ("cpu:gloo,cuda:nccl", "spawn") if cuda else ("gloo", "fork")
    results = []
    for name in args.only or list(ROWS):
        row = ROWS[name]
        if devices is not None and row.ranks > devices:
            results.append(Result(name, "skip", f"needs {row.ranks} GPUs, {devices} given", 0.0))
        else:
            results.append(run_row(row, spec, args.timeout_s, backend, start_method))
        print(f"titan doctor: {name} {results[-1].status}", file=sys.stderr, flush=True)
    # with --json - the JSON alone goes to stdout, for a pipe
    print(table(results), file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    if args.json:
        report = {
            "ok": all(r.status != "FAIL" for r in results),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
            "rows": [r.__dict__ for r in results],
        }
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
