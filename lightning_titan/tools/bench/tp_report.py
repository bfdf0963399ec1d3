"""The tensor-parallel part of the report: the arithmetic of a TP rank's state share, and the TP
table (ours per TP case against pure DP on as many ranks, one rank, and torch's TP)."""

from __future__ import annotations

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.parallel.tensor_parallel import padded_vocab
from lightning_titan.tools.bench.cases import OURS, TORCH_TP

_MB = 1e6


def span(values: list[float], digits: int = 3) -> str:
    """min..max, or the one value when every rank has it."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}..{high}"


def expected_tp_shares(
    config: ModelConfig, pp: int, tp: int, pp_rank: int, split: StageSplit | None = None
) -> tuple[float, float]:
    """(cut, whole) non-expert shares one rank of stage ``pp_rank`` should hold, by arithmetic: its
    layers' attention / tp, its vocabulary rows of the embedding (virtual stage 0) and the LM head
    (the last virtual stage), ``padded_vocab / tp`` each; its layers' norms and routers and the final
    norm whole. ``split``: the resolved layer split (uneven, interleaved, the V); None: even."""
    split = split or StageSplit()
    d, hd = config.d_model, config.head_dim
    attn = 2 * d * config.n_heads * hd + 2 * d * config.kv_heads * hd  # q, o; k, v
    per_layer_whole = 2 * d + d * config.n_experts  # two norms, the router
    layers = sum(end - start for start, end in split.chunk_ranges(config.n_layers, pp, pp_rank))
    stages = split.stage_ids(pp, pp_rank)
    first, last = 0 in stages, pp * split.virtual_stages - 1 in stages
    rows = padded_vocab(config.vocab_size, tp) // tp
    cut = layers * attn // tp + (first + last) * rows * d
    whole = layers * per_layer_whole + last * d
    return (
        cut / (config.n_layers * attn + 2 * config.vocab_size * d),
        whole / (config.n_layers * per_layer_whole + d),
    )


def tp_rows(rows: list[dict]) -> list[dict]:
    """Per case with tp > 1: ours against pure DP on as many ranks, against one rank, and against
    torch's ``parallelize_module`` where the case has it (step and CPU time ratios, < 1: faster)."""
    ours = {r["case"]: r["impls"][OURS] for r in rows}
    out = []
    for row in rows:
        if row.get("tp", 1) == 1:
            continue
        mine, world = row["impls"][OURS], row["world"]
        entry = {
            "world": world,
            "case": row["case"],
            "tokens_per_s": mine["tokens_per_s"],
            "step_ms": mine["step_ms"],
            "cpu_ms": mine["cpu_ms"],
            "state_mb": max(row["state"]["mb_per_rank"]),
            "tp_cut_share": row["state"]["tp_cut_share"],
            "expected_tp_cut_share": row["state"]["expected_tp_cut_share"],
        }
        for key, base in (("dp", ours.get(f"dp{world}")), ("single", ours.get("single"))):
            if base is not None:
                entry[f"vs_{key}"] = {k: mine[k] / base[k] for k in ("step_ms", "cpu_ms")}
        peer = row["impls"].get(TORCH_TP)
        if peer is not None:
            entry["peer"] = {
                "tokens_per_s": peer["tokens_per_s"],
                "step_ms": peer["step_ms"],
                "cpu_ms": peer["cpu_ms"],
                "state_mb": max(sum(s.values()) for s in peer["state_bytes_per_rank"]) / _MB,
                "tp_cut_share": peer["tp_cut_share"],
                "ours_over_peer": {k: mine[k] / peer[k] for k in ("step_ms", "cpu_ms")},
            }
        out.append(entry)
    return out


def _ratio(entry: dict | None, key: str) -> str:
    return "-" if entry is None else f"{entry[key]:.2f}x"


def tp_markdown(tp: list[dict]) -> list[str]:
    """The TP table: ours per TP case beside pure DP on as many ranks, one rank, and torch TP."""
    if not tp:
        return []
    lines = [
        "",
        "**Tensor parallelism**: ours per TP case; ratios of step time (wall) and CPU time "
        "per step, ours / the other (< 1: ours takes less): against pure DP on as many ranks, "
        "against one rank, and against torch's `parallelize_module` TP + SP in the same rounds "
        "(the peer's TP-cut share: DTensor cuts the 257-row vocabulary 129 / 128, unpadded)",
        "",
        "| ranks | composition | tokens/s | step ms | CPU ms | state MB/rank | TP-cut share "
        "(expected) | step / DP | CPU / DP | step / one rank | CPU / one rank "
        "| torch TP tokens/s | step ms | CPU ms | state MB/rank | TP-cut share "
        "| step ours / torch | CPU ours / torch |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for t in tp:
        dp, one, peer = t.get("vs_dp"), t.get("vs_single"), t.get("peer")
        theirs = "- | - | - | - | - | - | - |"
        if peer is not None:
            mine = peer["ours_over_peer"]
            theirs = (
                f"{peer['tokens_per_s']:,.0f} | {peer['step_ms']:.1f} | {peer['cpu_ms']:.0f} | "
                f"{peer['state_mb']:.2f} | {span(peer['tp_cut_share'], 4)} | "
                f"{mine['step_ms']:.2f}x | {mine['cpu_ms']:.2f}x |"
            )
        lines.append(
            f"| {t['world']} | {t['case']} | {t['tokens_per_s']:,.0f} | {t['step_ms']:.1f} | "
            f"{t['cpu_ms']:.0f} | {t['state_mb']:.2f} | {span(t['tp_cut_share'], 4)} "
            f"({span(t['expected_tp_cut_share'], 4)}) | {_ratio(dp, 'step_ms')} | "
            f"{_ratio(dp, 'cpu_ms')} | {_ratio(one, 'step_ms')} | {_ratio(one, 'cpu_ms')} | {theirs}"
        )
    return lines
