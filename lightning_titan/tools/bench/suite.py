"""``titan bench``: every composition on 2, 4 and 8 ranks at the same tokens per step, beside its peers.

    titan bench                                  # = python -m lightning_titan.tools.bench
    titan bench --worlds 2 4 --rounds 5 --out bench_out
    titan bench --quick                          # 2 ranks, tiny model: a smoke run (~30 s)
    titan bench --worlds 2 4 --only dp2 dp4 dp2xep2  # ZeRO-1/2 vs zero=0 and ZeroRedundancyOptimizer
    titan bench --worlds 1 2 4 --cases single dp2 tp2 dp2xtp2 ep2xtp2  # TP vs DP, one rank, torch TP
    titan bench --worlds 1 2 4 --cases single dp2 cp2 dp4 cp4 --seq-len 1024  # CP: activations
    titan bench --global-batch 128 --d-model 256 --device cuda   # scale up (CUDA: one rank per GPU)
    titan bench --routing   # only: grouped vs loop experts, FLOP/s vs the matmul peak, load balance
    titan bench --schedules --rounds 3  # pp2/pp4: 1f1b, interleaved_1f1b v2, zb_h1, zbv vs torch's (8 layers)
    titan bench --checkpoint --rounds 5  # only: training blocked by a save, at once vs in the background
    titan bench --lora --d-model 256 --rounds 5  # only: LoRA vs a full fine-tune, state and step time
    titan bench --packing --rounds 5  # only: packed documents' attention cost, windows' fill
    titan bench --ep-overlap --shared-expert-dim 128 --rounds 5  # all-to-all exposed, before/after pairs
    titan bench --zero3 --worlds 2 4 --rounds 11  # zero=3 vs FSDP2 (ZeRO-3) and zero=2: state, time
    titan bench --compile --rounds 9  # only: eager vs compiled, one rank, d_model 64/256/512

Writes bench.md (the tables), bench.json (everything), PNG charts, and per case a Chrome trace
(timeline/<case>.json: open in ui.perfetto.dev) plus a Gantt chart for pipeline and EP cases.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from lightning_titan.lightning import plots
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.pipeline.schedules import check_microbatches
from lightning_titan.parallel.pipeline.split import AUTO
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools.bench import checkpoint as checkpoint_bench
from lightning_titan.tools.bench import (
    compile_cmp,
    overlap_report,
    report,
    routing,
    schedule_report,
    timeline,
)
from lightning_titan.tools.bench import lora as lora_bench
from lightning_titan.tools.bench import packing as packing_bench
from lightning_titan.tools.bench.cases import (
    PAIRED,
    SCHEDULES_N_LAYERS,
    Case,
    Settings,
    default_cases,
    ep_overlap_cases,
    quick_cases,
    schedule_cases,
    zero3_cases,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan bench", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8], help="numbers of ranks")
    p.add_argument("--quick", action="store_true", help="2 ranks, a tiny model, few steps")
    p.add_argument(
        "--schedules",
        action="store_true",
        help="the pipeline schedules table: pp2 and pp4 under 1f1b, interleaved_1f1b (v=2), zb_h1 and "
        "zbv beside torch's, and pp2 with stage_layers='auto' (with --quick: pp2 only)",
    )
    p.add_argument(
        "--ep-overlap",
        action="store_true",
        help="ep2, ep4, pp2xep2, dp2xpp2xep2: 1f1b with the all-to-alls waited for at once, 1f1b "
        "and zbv with the in-layer overlap, and 1f1b_overlap / dualpipev in the same rounds: exposed "
        "all-to-all per rank, measured and replayed with free cores, activations against the "
        "theory (with --quick: ep2)",
    )
    p.add_argument(
        "--zero3",
        action="store_true",
        help="dp2, dp4 and dp2xep2 (--worlds picks): ours at zero=3 against torch FSDP2 resharding "
        "after forward (not on dp2xep2: it has no EP) and our zero=2 in the same rounds, with "
        "zero=0 for the state it divides: parameters, grads and optimizer state per rank against "
        "1/N, the parameter peak with gathered blocks (with --quick: dp2)",
    )
    p.add_argument(
        "--shared-expert-dim", type=int, default=0, help="a shared expert this wide (0: none)"
    )
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument(
        "--only", nargs="+", default=None, help="run cases whose name contains one of these"
    )
    p.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="run only the cases with exactly these names (e.g. single dp2 tp2 dp2xtp2)",
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="ours only (zero=0, and zero=1 and 2 where timed): no DDP, ZeroRedundancyOptimizer, "
        "pipelining or per-param",
    )
    p.add_argument(
        "--no-dispatch", action="store_true", help="skip the EP dispatch micro-benchmark"
    )
    p.add_argument(
        "--global-batch", type=int, default=32, help="sequences per step, every world size"
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--ffn-dim", type=int, default=128)
    p.add_argument(
        "--n-layers",
        type=int,
        default=None,
        help=f"default 4; {SCHEDULES_N_LAYERS} with --schedules (pp4 x v2)",
    )
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating ours and the peers")
    p.add_argument("--traced-steps", type=int, default=3)
    p.add_argument("--microbatches-per-stage", type=int, default=4, help="M = this x pp")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="torch CPU threads per rank (default: the cores split between the ranks); 1 on a "
        "shared box, where a second thread mostly waits for a preempted core",
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=Settings.bucket_cap_mb,
        help="our reducer's bucket size (DDP keeps its defaults)",
    )
    p.add_argument("--dispatch-tokens", type=int, default=8192)
    p.add_argument("--dispatch-threads", type=int, default=1)
    p.add_argument("--note", default="", help="free text for the machine line (e.g. 'shared box')")
    p.add_argument(
        "--routing",
        action="store_true",
        help="run only the one-process routing benchmarks (tools/bench/routing.py) into routing.md/json",
    )
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="run only the checkpoint benchmark (tools/bench/checkpoint.py) into checkpoint.md/json: "
        "dp2 x pp2 x ep2, training blocked by a synchronous vs a background save",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="run only the LoRA benchmark (tools/bench/lora.py) into lora.md/json: LoRA vs a full "
        "fine-tune of the same model, state bytes and step time (--lora-layout)",
    )
    p.add_argument(
        "--lora-layout",
        choices=("single", "ep2"),
        default="single",
        help="--lora's layout: one process (default) or ep2 on two ranks",
    )
    p.add_argument(
        "--packing",
        action="store_true",
        help="run only the packed-documents benchmark (tools/bench/packing.py) into packing.md/json",
    )
    p.add_argument("--compile", action="store_true", help="only: eager vs compiled, one rank")
    p.add_argument("--mfu-d-models", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--balance-steps", type=int, default=200)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    return p


def _settings(args: argparse.Namespace) -> Settings:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    n_layers = args.n_layers or (SCHEDULES_N_LAYERS if args.schedules else 4)
    config = ModelConfig(
        d_model=args.d_model,
        ffn_dim=args.ffn_dim,
        n_layers=n_layers,
        n_experts=args.n_experts,
        seq_len=args.seq_len,
        shared_expert_dim=args.shared_expert_dim,
    )
    settings = Settings(
        config=config,
        global_batch=args.global_batch,
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
        traced_steps=args.traced_steps,
        microbatches_per_stage=args.microbatches_per_stage,
        device=device,
        threads_per_rank=args.threads_per_rank,
        timeout_s=args.timeout,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    if args.quick:
        settings = replace(
            settings,
            config=replace(config, d_model=32, ffn_dim=32, seq_len=16),
            global_batch=16,
            warmup=1,
            steps=2,
            rounds=2,
            traced_steps=1,
        )
    return settings


def _exact(cases: list[Case], names: list[str]) -> list[Case]:
    unknown = sorted(set(names) - {c.name for c in cases})
    if unknown:
        raise ValueError(
            f"--cases {' '.join(unknown)}: no such case among the selected world sizes; choose from "
            f"{', '.join(c.name for c in cases)} (or add their world size to --worlds)"
        )
    return [c for c in cases if c.name in names]


def _check_case(case: Case, settings: Settings) -> None:
    local = settings.global_batch % (case.dp * case.ep)
    if local:
        raise ValueError(
            f"global batch {settings.global_batch} does not split over dp*ep = {case.dp * case.ep} data "
            f"ranks ({case.name}); use a --global-batch divisible by {case.dp * case.ep}"
        )
    split = None if case.stage_layers == AUTO else case.split  # auto: chosen on the ranks
    settings.config.validate_layout(case.pp, case.ep, case.tp, case.cp, split)
    for c in {case.of(impl) for impl in case.impls}:  # --ep-overlap: each impl's own schedule
        check_microbatches(c.schedule, settings.num_microbatches(c), c.pp, c.virtual_stages)


def _machine(settings: Settings, note: str) -> str:
    if settings.device == "cuda":
        text = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        text = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), gloo"
    text += f", torch {torch.__version__}"
    return f"{text}; {note}" if note else text


def _load() -> str:
    """1-minute load average: how busy the machine was besides the benchmark."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def _launch(cases: list[Case], settings: Settings, world: int) -> list[list[dict]]:
    from lightning_titan.tools.bench.worker import run_world

    kwargs = {}
    if settings.device == "cuda":
        kwargs["backend"] = "cpu:gloo,cuda:nccl"
    return run_on_ranks(run_world, world, cases, settings, timeout_s=settings.timeout_s, **kwargs)


def _check_device(settings: Settings, cases: list[Case]) -> None:
    if settings.device != "cuda":
        return
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise ValueError(
            f"--device cuda, but torch {torch.__version__} sees no CUDA device; use --device cpu"
        )
    worlds = sorted({c.world for c in cases if c.world > gpus})
    if worlds:
        raise ValueError(
            f"world sizes {worlds} need that many GPUs (NCCL takes one rank per GPU) and this machine "
            f"has {gpus}; pass --worlds up to {gpus}, or --device cpu"
        )


def _routing_only(args: argparse.Namespace, argv: list[str], out: Path, load_before: str) -> dict:
    started = time.perf_counter()
    table, results = routing.run_all(args)
    results["command"] = "titan bench " + shlex.join(argv)
    results["machine"] = _machine(_settings(args), args.note) + f"; load {load_before} -> {_load()}"
    results["wall_s"] = time.perf_counter() - started
    (out / "routing.md").write_text(f"`{results['command']}`\n\n{results['machine']}\n\n{table}")
    (out / "routing.json").write_text(json.dumps(results, indent=1))
    print(table)
    print(f"titan bench: {results['wall_s']:.0f} s; wrote {out.resolve()}/routing.md, routing.json")
    return results


def _one_bench(
    bench: Any,
    name: str,
    args: argparse.Namespace,
    argv: list[str],
    settings: Settings,
    out: Path,
    load_before: str,
    **options: Any,
) -> dict:
    """One of the benchmarks with a ``run`` and a ``markdown`` of their own (checkpoint, lora,
    packing); ``options``: that benchmark's own keywords."""
    started = time.perf_counter()
    command = "titan bench " + shlex.join(argv)
    result = bench.run(
        settings.config, settings.global_batch, args.rounds, args.steps, args.timeout, **options
    )
    result["machine"] = _machine(settings, args.note) + f"; load {load_before} -> {_load()}"
    table = bench.markdown(result, command, result["machine"])
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"command": command, **result}, indent=1))
    print(table)
    wall = time.perf_counter() - started
    print(f"titan bench: {wall:.0f} s; wrote {out.resolve()}/{name}.md, {name}.json")
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    try:  # every bad argument is reported before anything runs, as a usage error
        settings = _settings(args)
        if args.schedules:
            cases = schedule_cases(not args.no_peers)
            cases = [c for c in cases if c.pp == 2] if args.quick else cases
        elif args.ep_overlap:
            cases = ep_overlap_cases(args.quick)
        elif args.zero3:
            cases = [c for c in zero3_cases(args.quick) if c.world in args.worlds or args.quick]
        elif args.quick:
            cases = quick_cases(not args.no_peers)
        else:
            cases = default_cases(args.worlds, not args.no_peers)
        if args.only:
            cases = [c for c in cases if any(word in c.name for word in args.only)]
        if args.cases:
            cases = _exact(cases, args.cases)
        for case in cases:
            _check_case(case, settings)
        _check_device(settings, cases)
    except ValueError as error:
        parser.error(str(error))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), _load()
    if args.routing:
        return _routing_only(args, argv, out, load_before)
    if args.checkpoint:
        return _one_bench(checkpoint_bench, "checkpoint", args, argv, settings, out, load_before)
    if args.lora:
        return _one_bench(
            lora_bench, "lora", args, argv, settings, out, load_before, layout=args.lora_layout
        )
    if args.packing:
        return _one_bench(packing_bench, "packing", args, argv, settings, out, load_before)
    if args.compile:  # tools/bench/compile_cmp.py
        return compile_cmp.write(args, argv, out, _machine(settings, args.note))

    dispatch_rows: list[dict] = []
    experts_rows: list[dict] = []
    dispatch_settings = ""
    if not (
        args.no_dispatch or args.schedules or args.ep_overlap or args.zero3
    ):  # the schedules table is about pipelines only
        dispatch_rows, dispatch_settings, experts_rows = routing.micro_benchmarks(args, settings)

    full = report.full_model_params(settings)
    rows = []
    for world in sorted({c.world for c in cases}):
        world_cases = [c for c in cases if c.world == world]
        print(f"titan bench: {world} rank(s): {', '.join(c.name for c in world_cases)}", flush=True)
        per_rank = _launch(world_cases, settings, world)
        for i, case in enumerate(world_cases):
            row, spans = report.summarize(case, settings, [r[i] for r in per_rank], full)
            rows.append(row)
            timeline.write(out, case, spans, settings.num_microbatches(case))
            for impl in PAIRED:  # their two threads' timelines
                if impl in case.impls:
                    own = [s for r in per_rank for s in r[i][impl]["spans"]]
                    timeline.write(out, case, own, settings.num_microbatches(case), impl)
    schedules = schedule_report.schedule_rows(rows)

    results: dict[str, Any] = {
        "command": "titan bench " + shlex.join(argv),
        "machine": _machine(settings, args.note) + f"; load average {load_before} -> {_load()}",
        "settings": {**asdict(settings), "tokens_per_step": settings.tokens_per_step},
        "rows": rows,
        "peers": report.peer_ratios(rows),
        "memory": report.memory_pairs(rows),
        "zero": report.zero_rows(rows),
        "zero3": report.zero3_rows(rows),
        "tp": report.tp_rows(rows),
        "cp": report.cp_rows(rows),
        "bubble_checks": report.bubble_checks(rows),
        "schedules": schedules,
        "schedule_checks": schedule_report.schedule_checks(schedules),
        "dispatch": dispatch_rows,
        "dispatch_settings": dispatch_settings,
        "dispatch_checks": report.dispatch_check(dispatch_rows),
        "experts": experts_rows,
        "ep_overlap": overlap_report.overlap_rows(rows),
        "wall_s": time.perf_counter() - started,
    }
    table = report.markdown(results)
    if results["ep_overlap"]:
        table += "\n\n" + overlap_report.overlap_markdown(results["ep_overlap"])
    if experts_rows:
        table += "\n\n" + routing.markdown(experts_rows, [], [], dispatch_settings)
    (out / "bench.md").write_text(f"`{results['command']}`\n\n{table}")
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    if plots.available():
        plots.plot_throughput(rows, out / "throughput.png")
        plots.plot_breakdown(rows, out / "breakdown.png")
        if results["peers"] or dispatch_rows:
            plots.plot_peers(results["peers"], dispatch_rows, out / "peers.png")
        if results["memory"]:
            plots.plot_memory(results["memory"], out / "memory.png")
    else:
        print("titan bench: matplotlib is not installed, so no PNG charts (pip install matplotlib)")
    print(table)
    print(
        f"titan bench: {results['wall_s']:.0f} s; wrote {out.resolve()}/bench.md, bench.json, *.png, timeline/"
    )
    return results
