"""The ZeRO-3 table: each rank's parameters, grads and optimizer state at zero=3 against its share of
zero=0's, the parameter bytes whole at once during a step, and the step time against torch FSDP2
(resharding after forward) and our zero=2, in the same rounds."""

from __future__ import annotations

from lightning_titan.plan.memory import PARTS
from lightning_titan.tools.bench.cases import FSDP2_ZERO3, OURS, ZERO2, ZERO3
from lightning_titan.tools.bench.paired import INTERVAL, mark, step_and_cpu
from lightning_titan.tools.bench.zero_report import optimizer_shares

_MB = 1e6
PEER_TARGET = 1.0  # zero=3's step / FSDP2's (ZeRO-3), at most: ours no slower
ZERO2_TARGET = 1.15  # zero=3's step / zero=2's, at most
MEMORY_TOLERANCE = 0.05  # each part's worst rank within 5 % of its share
SPLIT_KINDS = ("all_gather", "all_reduce", "other")  # what zero=3 adds: gathers, hooks' Python


def _mb(states: list[dict[str, int]], kind: str) -> float:
    """The largest rank's bytes of one kind, expert and non-expert, in MB."""
    return max(s[f"expert_{kind}"] + s[f"non_expert_{kind}"] for s in states) / _MB


def zero3_rows(rows: list[dict]) -> list[dict]:
    """Per case with ours at zero=3: per part (params, grads, optimizer) the worst rank's bytes
    / zero=0's against the ideal (each parameter's over its own data-parallel group:
    ``optimizer_shares``; target: within 5 %); the most parameter bytes held at once in a step
    (``param_peak_bytes``: the rows and the blocks gathered) at zero=2, zero=3 and under FSDP2; the
    step time of zero=3 against FSDP2's ZeRO-3 (target: at most 1.0x) and against zero=2 (target:
    at most 1.15x), each decided over the paired rounds; the recorded steps' time split."""
    out = []
    for row in rows:
        impls = row["impls"]
        if ZERO3 not in impls or OURS not in impls:
            continue
        zero0, zero3 = impls[OURS], impls[ZERO3]
        parts = {}
        for kind in PARTS:
            ratios, ideals = optimizer_shares(zero0, zero3, row, kind)
            worst = max(range(len(ratios)), key=lambda r: ratios[r] / ideals[r])
            parts[kind] = {
                "ratio_per_rank": ratios,
                "ideal_per_rank": ideals,
                "ratio": ratios[worst],
                "ideal": ideals[worst],
                "met": abs(ratios[worst] / ideals[worst] - 1) <= MEMORY_TOLERANCE,
            }
        entry: dict = {
            "world": row["world"],
            "case": row["case"],
            "dp": row["dp"],
            "ep": row["ep"],
            "parts": parts,
            "memory_met": all(p["met"] for p in parts.values()),
            "mb": {
                impl: {kind: _mb(v["state_bytes_per_rank"], kind) for kind in PARTS}
                for impl, v in impls.items()
            },
            "param_peak_mb": {
                impl: max(v["param_peak_bytes_per_rank"]) / _MB
                for impl, v in impls.items()
                if "param_peak_bytes_per_rank" in v
            },
        }
        if "block_gathers_per_rank" in zero3:
            entry["block_gathers"] = zero3["block_gathers_per_rank"][0]
        if "time_ms" in zero3:
            entry["split_ms"] = {
                impl: {k: impls[impl]["time_ms"][k] for k in SPLIT_KINDS}
                for impl in (ZERO2, ZERO3)
                if "time_ms" in impls.get(impl, {})
            }
        for name, base, target in (
            ("peer", FSDP2_ZERO3, PEER_TARGET),
            ("zero2", ZERO2, ZERO2_TARGET),
        ):
            if base not in impls:
                continue
            step, cpu = step_and_cpu(zero3, impls[base])
            entry[name] = {
                "step_ratio": step.median,
                "step_cell": step.cell,
                "cpu_ratio": cpu.median,
                "cpu_cell": cpu.cell,
                "target": target,
                "met": step.at_most(target),
            }
        out.append(entry)
    return out


def _time_cells(t: dict | None) -> str:
    if t is None:
        return "- | - | -"
    return f"{t['step_cell']} | {mark(t['met'])} | {t['cpu_cell']}"


def zero3_markdown(zero3: list[dict]) -> list[str]:
    """The ZeRO-3 table, one row a case; FSDP2's cells say where it cannot run (expert parallelism)."""
    if not zero3:
        return []
    lines = [
        "",
        "**ZeRO-3**: model state per rank in MB (largest rank), zero=0 and zero=3; zero=3 / zero=0 on "
        "the worst rank against the ideal (each parameter's over its own data-parallel group: "
        "experts over dp x cp x tp ranks, the rest over dp x ep x cp x tp) for the parameters, the "
        "grads and the optimizer state; the most parameter bytes a rank holds at once during a "
        "step (its rows and the blocks gathered, sampled at each block's forward and backward) "
        "at zero=2, zero=3 and under FSDP2; all-gather waited, grad reduction and untraced "
        "(hooks, Python) ms per rank and step, zero=2 -> zero=3, from the recorded steps; rank 0's "
        "block gathers over the run, found in flight (prefetched), kept from the forward into "
        "the backward (the last block), gathered at their use, or prefetched and not used "
        "(wasted); step "
        f"time of zero=3 against FSDP2 and against zero=2, in the same rounds ({INTERVAL}), and "
        "CPU time per step (all ranks; what other load does not inflate). "
        "FSDP2: torch's fully_shard on each block and the root, reshard_after_forward=True, fp32 "
        "weights as ours; it has no expert parallelism, so it does not run where ep > 1 (-)",
        "",
        "| ranks | composition | params / grads / optimizer MB zero=0 | zero=3 "
        "| zero=3 / zero=0 params; grads; optimizer (ideal) | within 5% "
        "| FSDP2 params / grads / optimizer MB | param peak MB zero=2 / zero=3 / FSDP2 "
        "| all-gather + reduce + untraced ms zero=2 -> zero=3 | blocks prefetched / kept / gathered / wasted "
        "| step zero=3 / FSDP2 | <= 1.0x | CPU zero=3 / FSDP2 | step zero=3 / zero=2 | <= 1.15x "
        "| CPU zero=3 / zero=2 |",
        "|---:|---|---|---|---|---|---|---|---|---|---:|---|---:|---:|---|---:|",
    ]

    def three(mb: dict | None) -> str:
        if mb is None:
            return "-"
        return " / ".join(f"{mb[kind]:.3f}" for kind in PARTS)

    for z in zero3:
        mb, parts = z["mb"], z["parts"]
        shares = "; ".join(f"{parts[k]['ratio']:.3f} ({parts[k]['ideal']:.3f})" for k in PARTS)
        peaks = " / ".join(
            f"{z['param_peak_mb'][impl]:.3f}" if impl in z["param_peak_mb"] else "-"
            for impl in (ZERO2, ZERO3, FSDP2_ZERO3)
        )
        split = "-"
        if len(z.get("split_ms", {})) == 2:
            split = " -> ".join(
                " + ".join(f"{z['split_ms'][impl][k]:.1f}" for k in SPLIT_KINDS)
                for impl in (ZERO2, ZERO3)
            )
        gathers = z.get("block_gathers")
        blocks = "-"
        if gathers is not None:
            kinds = ("prefetched", "kept", "gathered", "wasted")
            blocks = " / ".join(str(gathers.get(k, 0)) for k in kinds)
        lines.append(
            f"| {z['world']} | {z['case']} | {three(mb[OURS])} | {three(mb[ZERO3])} | {shares} | "
            f"{mark(z['memory_met'])} | {three(mb.get(FSDP2_ZERO3))} | {peaks} | {split} | "
            f"{blocks} | {_time_cells(z.get('peer'))} | {_time_cells(z.get('zero2'))} |"
        )
    return lines
