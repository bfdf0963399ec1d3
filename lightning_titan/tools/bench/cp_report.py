"""The context-parallel part of the report: per CP case, the activations saved for backward on the
largest rank, the step time and the time spent in the key / value exchange, beside pure DP on as many
ranks and one rank at the same tokens per step (CP splits each sequence where DP splits the batch).

The exchange is timed as the "cp" spans of the recorded steps (the all-gathers and, in backward, the
reduce-scatters of their grads), exclusive time per rank and step: the collectives block the rank
(gloo; on CUDA the recorder synchronises), so that time is exposed, none of it hidden behind compute.
torch's own ``context_parallel`` is not a peer here: on CPU, torch 2.13 has no sharding rule for
``aten._scaled_dot_product_flash_attention_for_cpu`` (it handles the CUDA flash, efficient and cuDNN
kernels only), so it raises before the first step."""

from __future__ import annotations

from lightning_titan.tools.bench.cases import OURS


def cp_rows(rows: list[dict]) -> list[dict]:
    """Per case with cp > 1: saved activations and step / CPU time, and their ratios (< 1: less)
    against ``dp<world>`` and ``single`` where the run has them."""
    by_case = {r["case"]: r for r in rows}
    out = []
    for row in rows:
        if row.get("cp", 1) == 1:
            continue
        mine = row["impls"][OURS]
        entry = {
            "world": row["world"],
            "case": row["case"],
            "cp": row["cp"],
            "tp": row.get("tp", 1),
            "tokens_per_s": mine["tokens_per_s"],
            "step_ms": mine["step_ms"],
            "cpu_ms": mine["cpu_ms"],
            "saved_mb": row["saved_peak_mb"],
            "kv_ms": row["time_ms"]["cp"],
            "step_split_ms": sum(row["time_ms"].values()),
        }
        for key, name in (("dp", f"dp{row['world']}"), ("single", "single")):
            base = by_case.get(name)
            if base is not None:
                theirs = base["impls"][OURS]
                entry[f"vs_{key}"] = {
                    "saved_mb": row["saved_peak_mb"] / base["saved_peak_mb"],
                    **{k: mine[k] / theirs[k] for k in ("step_ms", "cpu_ms")},
                }
        out.append(entry)
    return out


def _ratio(entry: dict | None, key: str) -> str:
    return "-" if entry is None else f"{entry[key]:.2f}x"


def cp_markdown(cp: list[dict]) -> list[str]:
    if not cp:
        return []
    lines = [
        "",
        "**Context parallelism**: ours per CP case; activations saved for backward on the "
        "largest rank during one step, and ratios ours / the other (< 1: less) against pure DP on "
        "as many ranks and against one rank, at the same tokens per step",
        "",
        "| ranks | composition | tokens/s | step ms | CPU ms | K/V exchange ms (of step) "
        "| saved MB/rank | saved / one rank (1/(cp*tp)) | saved / DP | step / DP | CPU / DP "
        "| step / one rank | CPU / one rank |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in cp:
        dp, one = c.get("vs_dp"), c.get("vs_single")
        lines.append(
            f"| {c['world']} | {c['case']} | {c['tokens_per_s']:,.0f} | {c['step_ms']:.1f} | "
            f"{c['cpu_ms']:.0f} | {c['kv_ms']:.1f} ({c['kv_ms'] / c['step_split_ms']:.0%}) | "
            f"{c['saved_mb']:.2f} | {_ratio(one, 'saved_mb')} "
            f"({1 / (c['cp'] * c['tp']):.2f}) | {_ratio(dp, 'saved_mb')} | {_ratio(dp, 'step_ms')} | "
            f"{_ratio(dp, 'cpu_ms')} | {_ratio(one, 'step_ms')} | {_ratio(one, 'cpu_ms')} |"
        )
    return lines
