"""Eager against compiled (``TitanLM(compile=True)``), one rank, one thread: the training step's time
in paired rounds and its model FLOP/s as a share of the one-thread matmul peak.

    titan bench --compile                          # d_model 64, 256 and 512 (docs/benchmarks.md)
    titan bench --compile --mfu-d-models 64 --rounds 9

Both runs are the same model (same weights, same batches) stepped in turn: round ``i`` times one
eager step and one compiled step back to back (the order alternating), so load from elsewhere falls
on both members of a pair (``paired.py``). The first compiled step compiles; its time is reported
apart and the rounds start after ``warmup`` steps of each. The peak is a 2048^2 matmul probed in
every round, its best reading kept, as each run's best step is. FLOPs are ``flops.step_flops`` (the
matmuls by formula, forward and backward) for both: the same numerator, whatever the kernels.
"""

from __future__ import annotations

import itertools
import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_titan.model import flops
from lightning_titan.tools.bench.paired import INTERVAL, Ratio
from lightning_titan.tools.bench.routing import _train_steps, mfu_config, random_batches


def compile_case(d_model: int, rounds: int, batch: int = 32, warmup: int = 2) -> dict:
    """One d_model: per-round step seconds of each run, the compile time, the ratio and the shares."""
    config = mfu_config(d_model)
    runs = {
        name: _train_steps(config, random_batches(config, batch), compile=name == "compiled")
        for name in ("eager", "compiled")
    }
    start = time.perf_counter()
    next(runs["compiled"])
    compile_s = time.perf_counter() - start
    for run in runs.values():  # warm both: caches, the allocator, the compiled backward
        for _ in itertools.islice(run, warmup):
            pass
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    peak = 0.0  # probed in every round, the best kept: a busy box lowers a single probe's reading
    for i in range(rounds):
        order = ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")
        for name in order:
            seconds, _ = next(runs[name])
            times[name].append(seconds)
        peak = max(peak, flops.matmul_peak(torch.device("cpu"), torch.float32, n=2048, seconds=0.2))
    ops = {name: top_ops(run) for name, run in runs.items()}
    step_flops = flops.step_flops(config, batch * config.seq_len)
    row: dict = {"d_model": d_model, "tokens": batch * config.seq_len, "compile_s": compile_s}
    row["ops"] = ops
    for name, steps_s in times.items():
        row[name] = {"rounds_ms": [1e3 * s for s in steps_s], "step_ms": 1e3 * min(steps_s)}
        row[f"{name}_share"] = step_flops / min(steps_s) / peak
    row["peak_gflops_per_s"] = peak / 1e9
    row["speedup"] = Ratio.of(row["eager"], row["compiled"])  # eager's time / compiled's
    return row


def top_ops(run: Iterator[tuple[float, Any]], n: int = 6) -> list[tuple[str, float]]:
    """One more step of ``run`` under the profiler: its ``n`` largest ops by own CPU time, each with
    its share of the step (what bounds it, op by op; a compiled region shows as its kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        next(run)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.self_cpu_time_total / total) for e in events[:n]]


def run(d_models: list[int], rounds: int) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [compile_case(d, rounds) for d in d_models]
    finally:
        torch.set_num_threads(threads)


def markdown(rows: list[dict]) -> str:
    lines = [
        "**Eager vs compiled, one rank, one thread** (fp32; share of the 2048^2 one-thread matmul "
        f"peak at the best step; eager / compiled step time: {INTERVAL})",
        "",
        "| d_model | tokens/step | compile s | eager ms | compiled ms | eager / compiled "
        "| eager share | compiled share | peak GFLOP/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['d_model']} | {r['tokens']} | {r['compile_s']:.0f} | "
            f"{r['eager']['step_ms']:.1f} | {r['compiled']['step_ms']:.1f} | {r['speedup'].cell} | "
            f"{100 * r['eager_share']:.0f}% | {100 * r['compiled_share']:.0f}% | "
            f"{r['peak_gflops_per_s']:.1f} |"
        )
    for r in rows:
        for name, ops in r.get("ops", {}).items():
            cells = ", ".join(f"`{op}` {100 * share:.0f}%" for op, share in ops)
            lines.append(f"\nd_model {r['d_model']}, {name}, own CPU time by op: {cells}")
    return "\n".join(lines)


def write(args: Any, argv: list[str], out: Path, machine: str) -> dict:
    """``titan bench --compile``: the table into compile.md (with the command and the machine)."""
    rows = run(args.mfu_d_models, args.rounds)
    command = "titan bench " + shlex.join(argv)
    table = markdown(rows)
    (out / "compile.md").write_text(f"`{command}`\n\n{machine}\n\n{table}\n")
    for r in rows:
        r["speedup"] = {"median": r["speedup"].median, "interval": r["speedup"].interval}
    results = {"command": command, "machine": machine, "rows": rows}
    (out / "compile.json").write_text(json.dumps(results, indent=1))
    print(table)
    print(f"titan bench: wrote {out.resolve()}/compile.md, compile.json")
    return results
