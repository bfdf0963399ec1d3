"""From every rank's raw measurements to the rows, peer ratios and targets the benchmark reports."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from lightning_titan.model.decoder import StageModel
from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.split import AUTO
from lightning_titan.parallel.tensor_parallel import tp_shards
from lightning_titan.runtime import tracing
from lightning_titan.tools.bench.cases import (
    A2A_BLOCKING,
    BASELINES,
    DDP,
    DDP_ZERO,
    FSDP2,
    FSDP2_ZERO3,
    IMPL_LABELS,
    OURS,
    TORCH_PP,
    ZERO_LEVELS,
    Case,
    Settings,
)
from lightning_titan.tools.bench.cp_report import cp_markdown, cp_rows  # noqa: F401 (suite)
from lightning_titan.tools.bench.overlap_report import ep_overlap
from lightning_titan.tools.bench.paired import INTERVAL, mark, step_and_cpu
from lightning_titan.tools.bench.schedule_report import schedules_markdown
from lightning_titan.tools.bench.tp_report import expected_tp_shares, span, tp_markdown, tp_rows
from lightning_titan.tools.bench.zero3_report import zero3_markdown, zero3_rows  # noqa: F401
from lightning_titan.tools.bench.zero_report import zero_markdown, zero_rows  # noqa: F401 (suite)

_MB = 1e6


def full_model_params(settings: Settings) -> dict[str, int]:
    """Parameter bytes of the whole model: expert and non-expert, and the non-expert part split into
    the weights TP cuts (attention, embedding, LM head) and the rest (norms, routers): what the
    per-rank shares divide."""
    model = StageModel(settings.config)
    expert, non_expert = split_expert_parameters(model)
    cut = tp_shards(model)  # marked without a group too: the weights a TP layout would cut
    out = {
        part: sum(p.numel() * p.element_size() for _, p in named)
        for part, named in (("expert", expert), ("non_expert", non_expert))
    }
    out["tp_cut"] = sum(p.numel() * p.element_size() for _, p in non_expert if id(p) in cut)
    out["tp_whole"] = out["non_expert"] - out["tp_cut"]
    return out


def summarize(
    case: Case, settings: Settings, per_rank: list[dict], full: dict[str, int]
) -> tuple[dict, list[tracing.Span]]:
    """One row for ``case`` from every rank's result, and the spans recorded for it."""
    dims = ParallelDims(case.dp, case.pp, case.ep, tp=case.tp, cp=case.cp)
    impls = {}
    for impl in case.impls:
        step_s = per_rank[0][impl]["median_step_s"]
        impls[impl] = {
            "step_ms": step_s * 1e3,
            "tokens_per_s": settings.tokens_per_step / step_s,
            "rounds_ms": [s * 1e3 for s in per_rank[0][impl]["step_s"]],
            "cpu_ms": per_rank[0][impl]["median_cpu_s"] * 1e3,  # all ranks together, per step
            "rounds_cpu_ms": [s * 1e3 for s in per_rank[0][impl]["cpu_s"]],
            "peak_mb_per_rank": [r[impl]["peak_bytes"] / _MB for r in per_rank],
            "state_bytes_per_rank": [r[impl]["state_bytes"] for r in per_rank],
            "tp_cut_share": [r[impl]["tp_cut_param_bytes"] / full["tp_cut"] for r in per_rank],
            "tp_cut_bytes_per_rank": [r[impl]["tp_cut_param_bytes"] for r in per_rank],
        }
        for key in ("param_peak_bytes", "block_gathers"):  # zero=2, zero=3 and FSDP2's
            if key in per_rank[0][impl]:
                impls[impl][f"{key}_per_rank"] = [r[impl][key] for r in per_rank]
        if impl != OURS and "spans" in per_rank[0][impl]:
            impls[impl]["time_ms"] = tracing.time_by_kind(
                [s for r in per_rank for s in r[impl]["spans"]]
            )
    spans = [s for r in per_rank for s in r[OURS]["spans"]]
    row = {
        "world": case.world,
        "case": case.name,
        "layout": case.layout,
        "dp": case.dp,
        "pp": case.pp,
        "ep": case.ep,
        "tp": case.tp,
        "cp": case.cp,
        "schedule": case.schedule,
        "microbatches": settings.num_microbatches(case),
        "impls": impls,
        "time_ms": tracing.time_by_kind(spans),
        "saved_peak_mb": max(r[OURS]["saved_peak_bytes"] for r in per_rank) / _MB,
    }
    if case.pp > 1:
        pipelines = dims.all_groups("pp")
        row["bubbles"] = tracing.bubble_breakdown(spans, pipelines)
        saved: dict[int, int] = defaultdict(int)
        for r in per_rank:
            stage = r[OURS]["coords"][1]
            saved[stage] = max(saved[stage], r[OURS]["saved_peak_bytes"])
        row["saved_peak_mb_per_stage"] = [saved[p] / _MB for p in range(case.pp)]
        row["virtual_stages"] = case.virtual_stages
        row["stage_layers"] = per_rank[0][OURS]["stage_layers"]
        row["auto_split"] = case.stage_layers == AUTO
        if "microbatch_saved_bytes" in per_rank[0][OURS]:
            by_stage = {r[OURS]["coords"][1]: r[OURS]["microbatch_saved_bytes"] for r in per_rank}
            row["microbatch_saved_mb_per_stage"] = [
                [b / _MB for b in by_stage[p]] for p in range(case.pp)
            ]
    row["state"] = _state_shares(case, settings, per_rank, full)
    if A2A_BLOCKING in case.impls:  # titan bench --ep-overlap
        row["ep_overlap"] = ep_overlap(case, settings, per_rank, dims)
    return row, spans


def _state_shares(
    case: Case, settings: Settings, per_rank: list[dict], full: dict[str, int]
) -> dict:
    """Our state per rank and the share of each part of the whole model it holds, beside the
    arithmetic: experts 1/(PP*EP) (whole on the TP ranks); per rank, the TP-cut weights of its stage
    / TP (the padded vocabulary rows), its stage's norms and routers whole, and the two together."""
    states = [r[OURS]["state_bytes"] for r in per_rank]
    cut = [r[OURS]["tp_cut_param_bytes"] for r in per_rank]
    counts = per_rank[0][OURS].get("stage_layers")  # the split as run ("auto" resolved)
    split = replace(case.split, stage_layers=counts and tuple(counts))
    expected = [
        expected_tp_shares(settings.config, case.pp, case.tp, r[OURS]["coords"][1], split)
        for r in per_rank
    ]
    return {
        "mb_per_rank": [sum(s.values()) / _MB for s in states],
        "expert_share": [s["expert_params"] / full["expert"] for s in states],
        "non_expert_share": [s["non_expert_params"] / full["non_expert"] for s in states],
        "expected_expert_share": 1 / (case.pp * case.ep),
        "expected_non_expert_share": [
            (cut_e * full["tp_cut"] + whole_e * full["tp_whole"]) / full["non_expert"]
            for cut_e, whole_e in expected
        ],
        "tp_cut_share": [c / full["tp_cut"] for c in cut],
        "tp_whole_share": [
            (s["non_expert_params"] - c) / full["tp_whole"]
            for s, c in zip(states, cut, strict=True)
        ],
        "expected_tp_cut_share": [e[0] for e in expected],
        "expected_tp_whole_share": [e[1] for e in expected],
    }


PEER_TARGETS = {
    TORCH_PP: 1.05,
    DDP: 1.00,
    DDP_ZERO: 1.00,
    FSDP2: 1.00,
    FSDP2_ZERO3: 1.00,
}  # peer time / ours at least this


def peer_ratios(rows: list[dict]) -> list[dict]:
    """Peer step time / ours (its baseline: ours at zero=1 for the ZeRO peer): above 1 means ours is
    faster. Ours at zero=1 against zero=0 is ``zero_rows``'s."""
    out = []
    for row in rows:
        for impl, peer in row["impls"].items():
            if impl == OURS or impl in ZERO_LEVELS:  # ours at zero>0: zero_rows's
                continue
            base = BASELINES.get(impl, OURS)
            base = base if base in row["impls"] else OURS
            ours, target = row["impls"][base], PEER_TARGETS.get(impl)
            label = IMPL_LABELS[impl] + ("" if base == OURS else f" (vs {IMPL_LABELS[base]})")
            ratio, cpu = step_and_cpu(peer, ours)
            out.append(
                {
                    "world": row["world"],
                    "case": row["case"],
                    "peer": impl,
                    "baseline": base,
                    "peer_label": label,
                    "ours_tokens_per_s": ours["tokens_per_s"],
                    "peer_tokens_per_s": peer["tokens_per_s"],
                    "ratio": ratio.median,
                    "ratio_cell": ratio.cell,
                    "target": target,
                    "ours_cpu_ms": ours["cpu_ms"],
                    "peer_cpu_ms": peer["cpu_ms"],
                    "cpu_ratio": cpu.median,
                    "cpu_cell": cpu.cell,
                    "met": None if target is None else ratio.at_least(target),
                }
            )
    return out


def memory_pairs(rows: list[dict]) -> list[dict]:
    """1F1B vs GPipe peak activation memory on the same layout and M; target <= (P / M) * 1.1."""
    by_key = {
        (r["dp"], r["pp"], r["ep"], r["microbatches"], r["schedule"]): r
        for r in rows
        if r["pp"] > 1
    }
    out = []
    for (dp, pp, ep, m, schedule), row in by_key.items():
        gpipe = by_key.get((dp, pp, ep, m, "gpipe"))
        if schedule != "1f1b" or gpipe is None:
            continue
        ours, theirs = row["saved_peak_mb_per_stage"], gpipe["saved_peak_mb_per_stage"]
        # per stage: 1F1B keeps P - p microbatches live where GPipe keeps M; stage 0 is the worst
        per_stage = [a / b for a, b in zip(ours, theirs, strict=True)]
        ratio = max(per_stage)
        out.append(
            {
                "world": row["world"],
                "layout": row["layout"],
                "microbatches": m,
                "gpipe_mb_per_stage": theirs,
                "1f1b_mb_per_stage": ours,
                "ratio_per_stage": per_stage,
                "ratio": ratio,
                "ideal": pp / m,
                "target": pp / m * 1.1,
                "met": ratio <= pp / m * 1.1,
            }
        )
    return out


def bubble_checks(rows: list[dict]) -> list[dict]:
    """Target: measured <= theory + 5 points on every stage, for 1F1B at M >= 4P."""
    out = []
    for row in rows:
        if row["pp"] == 1 or row["schedule"] != "1f1b" or row["microbatches"] < 4 * row["pp"]:
            continue
        worst = max(row["bubbles"], key=lambda b: b["measured"] - b["theory"])
        out.append(
            {
                "world": row["world"],
                "case": row["case"],
                "theory": worst["theory"],
                "measured_max": worst["measured"],
                "stage": worst["stage"],
                "compute_only": worst["compute_only"],
                "steady_compute": worst["steady_compute"],
                "met": worst["measured"] <= worst["theory"] + 0.05,
            }
        )
    return out


def dispatch_check(dispatch_rows: list[dict]) -> list[dict]:
    return [
        {
            "experts": r["experts"],
            "ratio_fwd": r["ratio_fwd"],
            "ratio_fwd_bwd": r["ratio_fwd_bwd"],
            "target": 10.0,
            "met": r["ratio_fwd_bwd"] >= 10.0,
        }
        for r in dispatch_rows
        if r["experts"] >= 64
    ]


# -- markdown -------------------------------------------------------------------------------------------


def _stages(values: list[float], fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def markdown(results: dict) -> str:
    """The tables of one benchmark run, as markdown."""
    s, lines = results["settings"], []
    lines += [
        f"Machine: {results['machine']}. Model: d_model={s['config']['d_model']}, "
        f"{s['config']['n_layers']} layers, {s['config']['n_experts']} experts top-{s['config']['top_k']}, "
        f"seq_len={s['config']['seq_len']}; global batch {s['global_batch']} sequences "
        f"({s['global_batch'] * s['config']['seq_len']} tokens/step) on every world size. "
        f"Median of {s['rounds']} rounds of {s['steps']} steps after {s['warmup']} warm-up steps; "
        f"torch threads per rank: {s['threads_per_rank'] or 'cores / ranks'}. "
        "CPU ms: process CPU time per step summed over ranks. Time split (compute ... other): from "
        "separately recorded steps, exclusive time per rank, mean over ranks.",
        "",
        "| ranks | composition | M | tokens/s | step ms | CPU ms | compute ms | p2p ms | all-to-all ms "
        "| all-reduce ms | TP / CP ms | wait ms | optimizer ms | other ms | bubble per stage (theory) "
        "| peak RSS MB/rank | state MB/rank |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results["rows"]:
        ours, t = r["impls"][OURS], r["time_ms"]
        bubble = "-"
        if "bubbles" in r:
            bubble = (
                _stages([b["measured"] for b in r["bubbles"]])
                + f" ({r['bubbles'][0]['theory']:.2f})"
            )
        lines.append(
            f"| {r['world']} | {r['case']} | {r['microbatches']} | {ours['tokens_per_s']:,.0f} | "
            f"{ours['step_ms']:.1f} | {ours['cpu_ms']:.0f} | {t['forward'] + t['backward']:.1f} | "
            f"{t['p2p']:.1f} | "
            f"{t['all_to_all']:.1f} | {t['all_reduce']:.1f} | {t['tp']:.1f} / {t['cp']:.1f} | "
            f"{t['wait']:.1f} | {t['optimizer']:.1f} | "
            f"{t['other']:.1f} | {bubble} | {max(ours['peak_mb_per_rank']):.0f} | "
            f"{max(r['state']['mb_per_rank']):.2f} |"
        )
    lines += [
        "",
        "**Peers** (same model, batches, steps and rounds; ratio = peer step time / ours, "
        f"{INTERVAL}; CPU ratio = peer CPU time per step / ours, all ranks, which other load "
        "on the machine does not inflate)",
        "",
        "| ranks | composition | peer | ours tokens/s | peer tokens/s | ratio | target | met "
        "| CPU ms ours / peer | CPU ratio |",
        "|---:|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for p in results["peers"]:
        target, met = (
            ("-", "-") if p["target"] is None else (f">= {p['target']:.2f}x", mark(p["met"]))
        )
        lines.append(
            f"| {p['world']} | {p['case']} | {p['peer_label']} | {p['ours_tokens_per_s']:,.0f} | "
            f"{p['peer_tokens_per_s']:,.0f} | {p['ratio_cell']} | {target} | {met} | "
            f"{p['ours_cpu_ms']:.0f} / {p['peer_cpu_ms']:.0f} | {p['cpu_cell']} |"
        )
    if results["dispatch"]:
        lines += [
            "",
            "**EP dispatch + combine** (one process, identity experts; "
            f"{results['dispatch_settings']}): vectorised vs a per-expert Python loop",
            "",
            "| experts | vectorised fwd ms | loop fwd ms | ratio fwd | vectorised fwd+bwd ms "
            "| loop fwd+bwd ms | ratio fwd+bwd |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for d in results["dispatch"]:
            lines.append(
                f"| {d['experts']} | {d['vectorised_fwd_ms']:.3f} | {d['loop_fwd_ms']:.3f} | "
                f"{d['ratio_fwd']:.1f}x | {d['vectorised_fwd_bwd_ms']:.3f} | "
                f"{d['loop_fwd_bwd_ms']:.3f} | {d['ratio_fwd_bwd']:.1f}x |"
            )
    if results["memory"]:
        lines += [
            "",
            "**Activation memory**: peak bytes saved for backward per stage (MB), 1F1B vs "
            "GPipe on the same layout and M",
            "",
            "| ranks | layout | M | GPipe per stage | 1F1B per stage | 1F1B / GPipe per stage | worst "
            "| P/M | target | met |",
            "|---:|---|---:|---|---|---|---:|---:|---:|---|",
        ]
        for m in results["memory"]:
            lines.append(
                f"| {m['world']} | {m['layout']} | {m['microbatches']} | "
                f"{_stages(m['gpipe_mb_per_stage'])} | {_stages(m['1f1b_mb_per_stage'])} | "
                f"{_stages(m['ratio_per_stage'], '{:.3f}')} | {m['ratio']:.3f} | {m['ideal']:.3f} | <= {m['target']:.3f} | {mark(m['met'])} |"
            )
    lines += [
        "",
        "**Model state per rank** (params + grads + AdamW moments): share of the whole "
        "model's parameters held, min..max over ranks, vs the expected 1/(PP*EP) of the experts "
        "and, per rank, its stage's share of the rest (the embedding and head sit on the first "
        "and last stage); the "
        "non-expert part split into the weights TP cuts (attention q/k/v/o, embedding, LM head: "
        "1/TP of them, the vocabulary padded to a multiple of TP) and the rest (norms, routers: "
        "whole on every TP rank), each against its arithmetic per rank",
        "",
        "| ranks | composition | state MB/rank | expert share | expected | non-expert share "
        "| expected | TP-cut share | expected | norms + routers share | expected |",
        "|---:|---|---:|---|---:|---|---:|---|---|---|---|",
    ]
    for r in results["rows"]:
        st = r["state"]
        e, n = st["expert_share"], st["non_expert_share"]
        lines.append(
            f"| {r['world']} | {r['case']} | {max(st['mb_per_rank']):.2f} | {span(e)} | "
            f"{st['expected_expert_share']:.3f} | {span(n)} | "
            f"{span(st['expected_non_expert_share'])} | {span(st['tp_cut_share'], 4)} | "
            f"{span(st['expected_tp_cut_share'], 4)} | {span(st['tp_whole_share'])} | "
            f"{span(st['expected_tp_whole_share'])} |"
        )
    lines += tp_markdown(tp_rows(results["rows"]))
    lines += cp_markdown(results.get("cp", []))
    lines += zero_markdown(results.get("zero", []))
    lines += zero3_markdown(results.get("zero3", []))
    lines += schedules_markdown(results.get("schedules", []), results.get("schedule_checks", []))
    if results["bubble_checks"]:
        lines += [
            "",
            "**Pipeline bubble**, 1F1B at M >= 4P: worst stage measured vs theory (P-1)/(M+P-1), "
            "beside what explains it: the recorded forwards and backwards replayed with free "
            "send/recv, once with every span at its rank's median length (*uneven stages*) and "
            "once as recorded (*+ jitter*); measured minus that is the transfers' share",
            "",
            "| ranks | composition | theory | uneven stages | + jitter | measured (worst stage) | target | met |",
            "|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for b in results["bubble_checks"]:
            lines.append(
                f"| {b['world']} | {b['case']} | {b['theory']:.3f} | {b['steady_compute']:.3f} | "
                f"{b['compute_only']:.3f} | {b['measured_max']:.3f} (stage {b['stage']}) | "
                f"<= {b['theory'] + 0.05:.3f} | {mark(b['met'])} |"
            )
    return "\n".join(lines) + "\n"
