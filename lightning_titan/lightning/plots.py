"""PNG charts: a run's loss curve, the measured pipeline timeline (Gantt), expert load, and the
benchmark's summaries; the timeline as a Chrome trace too.

Uses matplotlib's object API with the Agg canvas, so it never switches a notebook's backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_titan.runtime import holders
from lightning_titan.runtime.tracing import BACKGROUND_KINDS, KINDS, Span

COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "p2p": "#B0B0B0",
    "all_to_all": "#DD8452",
    "all_reduce": "#C44E52",
    "wait": "#8172B3",
    "optimizer": "#937860",
    "other": "#E0E0E0",
    "all_gather": "#DA8BC3",
    "tp": "#8C8C3C",
    "cp": "#64B5CD",
    "in_flight": "#F2C5A0",  # an all-to-all travelling under compute: a strip under the rank's row
}
_HEIGHT = {"forward": 0.8, "backward": 0.8, "optimizer": 0.8}  # others: drawn thinner, on top


def available() -> bool:
    """matplotlib is an optional dependency (``pip install matplotlib``): without it, no PNGs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


Curve = Sequence[tuple[int, float]]


def plot_loss_curve(train: Curve, val: Curve, path: str | Path, title: str = "") -> None:
    """``train`` and ``val``: (step, loss) pairs; the train loss a line, the val loss a line with
    markers (its few points), on one step axis."""
    if not train:
        raise ValueError("no train_loss to plot: log at least one step")
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in train], [v for _, v in train], color="#4C72B0", linewidth=1.0,
            label="train_loss")  # fmt: skip
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], color="#C44E52", linewidth=1.0,
                marker="o", markersize=3, label="val_loss")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def plot_gantt(
    spans: Sequence[Span],
    path: str | Path,
    rank_labels: dict[int, str] | None = None,
    title: str = "",
) -> None:
    """One row per rank, time in ms from the first span; compute full height, communication thin on top.
    An overlapped pair's two threads share their rank's row: each span is drawn where its thread
    held the rank (``runtime/holders.py``), the exchanges in flight whole."""
    from matplotlib.patches import Patch

    if not spans:
        raise ValueError("no spans to plot: record at least one step (tracing.start / stop)")
    spans = [
        piece
        for rank in sorted({s.rank for s in spans})
        for piece in holders.held([s for s in spans if s.rank == rank], BACKGROUND_KINDS)
    ]
    t0 = min(s.start_ns for s in spans)
    width_ms = (max(s.end_ns for s in spans) - t0) / 1e6
    ranks = sorted({s.rank for s in spans})
    fig = _figure(12, 0.55 * len(ranks) + 1.6)
    ax = fig.add_subplot()
    # compute first, then the spans nested inside it, so the short ones stay visible
    for s in sorted(spans, key=lambda s: (s.kind not in _HEIGHT, s.start_ns)):
        y: float = ranks.index(s.rank)
        h = _HEIGHT.get(s.kind, 0.4)
        if s.kind in BACKGROUND_KINDS:
            y, h = y + 0.47, 0.12
        start, dur = (s.start_ns - t0) / 1e6, s.duration_ns / 1e6
        ax.barh(y, dur, left=start, height=h, color=COLORS.get(s.kind, "black"), linewidth=0)
        if s.kind in ("forward", "backward") and "mb" in s.args and dur > width_ms / 60:
            letter = "W" if s.name == "backward_weight" else s.kind[0].upper()  # zero-bubble W
            label = (
                letter + str(s.args["mb"]) + (f".{s.args['chunk']}" if "chunk" in s.args else "")
            )
            ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [(rank_labels or {}).get(r, f"rank {r}") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    kinds = [k for k in (*KINDS, *BACKGROUND_KINDS) if any(s.kind == k for s in spans)]
    ax.legend(
        handles=[Patch(color=COLORS[k], label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
        ncol=len(kinds),
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path)


Balance = Sequence[tuple[int, Sequence[float], Sequence[float] | None]]


def plot_expert_load(
    history: Sequence[tuple[int, Sequence[Sequence[float]]]],
    path: str | Path,
    balance: Balance | None = None,
) -> None:
    """``history``: (step, [layer][expert] share of assignments); one panel per layer, one line per
    expert. ``balance``: (step, [layer] max/mean load, [layer] max/mean of the unbiased choice or
    None), drawn in a last panel, one line per layer (dashed: without the bias)."""
    if not history:
        raise ValueError("no expert-load history to plot")
    steps = [step for step, _ in history]
    n_layers, n_experts = len(history[0][1]), len(history[0][1][0])
    panels = n_layers + bool(balance)
    cols = min(4, panels)
    rows = -(-panels // cols)
    fig = _figure(3.2 * cols, 2.4 * rows + 0.4)
    for layer in range(n_layers):
        ax = fig.add_subplot(rows, cols, layer + 1)
        for e in range(n_experts):
            ax.plot(steps, [shares[layer][e] for _, shares in history], linewidth=0.8)
        ax.axhline(1 / n_experts, color="black", linewidth=0.6, linestyle="--")
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=7)
    if balance:
        _draw_balance(fig.add_subplot(rows, cols, panels), balance)
    fig.suptitle("share of token assignments per expert (dashed: uniform)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def _draw_balance(ax: Any, balance: Balance) -> None:
    steps = [step for step, _, _ in balance]
    for layer in range(len(balance[0][1])):
        ax.plot(
            steps,
            [row[1][layer] for row in balance],
            color=f"C{layer}",
            linewidth=0.9,
            label=f"layer {layer}",
        )
        unbiased = [row[2][layer] for row in balance if row[2] is not None]
        if unbiased:
            ax.plot(steps, unbiased, color=f"C{layer}", linewidth=0.7, linestyle="--")
    ax.axhline(1.0, color="black", linewidth=0.6)
    dashed = "; dashed: no bias" if balance[0][2] is not None else ""
    ax.set_title(f"max / mean load per layer{dashed}", fontsize=8)
    ax.set_xlabel("step", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)


def plot_throughput(rows: Sequence[dict], path: str | Path) -> None:
    """tokens/s of ours per composition, grouped by world size."""
    fig = _figure(max(6, 0.45 * len(rows) + 2), 4)
    ax = fig.add_subplot()
    labels = [f"{r['world']}: {r['case']}" for r in rows]
    values = [r["impls"]["titan"]["tokens_per_s"] for r in rows]
    colors = [
        f"C{[1, 2, 4, 8].index(r['world']) if r['world'] in (1, 2, 4, 8) else 5}" for r in rows
    ]
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (same global batch)")
    ax.set_title("throughput by composition (colour: number of ranks)")
    fig.tight_layout()
    fig.savefig(path)


def plot_breakdown(rows: Sequence[dict], path: str | Path) -> None:
    """Stacked mean time per step and rank by kind, per composition."""
    fig = _figure(max(6, 0.45 * len(rows) + 2), 4)
    ax = fig.add_subplot()
    bottom = [0.0] * len(rows)
    for kind in (*KINDS, "other"):
        values = [r["time_ms"].get(kind, 0.0) for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, color=COLORS[kind], label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(
        range(len(rows)),
        [f"{r['world']}: {r['case']}" for r in rows],
        rotation=60,
        ha="right",
        fontsize=7,
    )
    ax.set_ylabel("ms per step and rank")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("where a step's time goes")
    fig.tight_layout()
    fig.savefig(path)


def plot_peers(peers: Sequence[dict], dispatch: Sequence[dict], path: str | Path) -> None:
    """Peer ratios (peer time / ours) with their targets; the dispatch ratios beside them."""
    items = [(f"{p['world']}: {p['case']}\nvs {p['peer']}", p["ratio"], p["target"]) for p in peers]
    items += [
        (
            f"dispatch E={d['experts']}\nvs loop",
            d["ratio_fwd_bwd"],
            10.0 if d["experts"] >= 64 else None,
        )
        for d in dispatch
    ]
    fig = _figure(max(6, 0.7 * len(items) + 2), 4)
    ax = fig.add_subplot()
    ax.bar(range(len(items)), [v for _, v, _ in items], color="#4C72B0")
    for i, (_, _, target) in enumerate(items):
        if target is not None:
            ax.plot([i - 0.4, i + 0.4], [target, target], color="#C44E52")
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(
        range(len(items)), [label for label, _, _ in items], rotation=60, ha="right", fontsize=7
    )
    ax.set_ylabel("speed-up of ours (log); red: target")
    fig.tight_layout()
    fig.savefig(path)


def plot_memory(pairs: Sequence[dict], path: str | Path) -> None:
    """Activation peak per stage, GPipe vs 1F1B."""
    fig = _figure(max(5, 2.5 * len(pairs) + 1), 3.6)
    for i, m in enumerate(pairs):
        ax = fig.add_subplot(1, len(pairs), i + 1)
        stages = range(len(m["gpipe_mb_per_stage"]))
        ax.bar([s - 0.2 for s in stages], m["gpipe_mb_per_stage"], width=0.4, label="GPipe")
        ax.bar([s + 0.2 for s in stages], m["1f1b_mb_per_stage"], width=0.4, label="1F1B")
        ax.set_xticks(list(stages), [f"stage {s}" for s in stages], fontsize=7)
        ax.set_title(f"{m['world']} ranks {m['layout']}, M={m['microbatches']}", fontsize=8)
        ax.set_ylabel("MB saved for backward (peak)", fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def chrome_trace(spans: Iterable[Span], rank_labels: dict[int, str] | None = None) -> dict:
    """Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one process per rank, times in us
    from the earliest span. Ranks of one host share the monotonic clock, so their spans line up."""
    spans = list(spans)
    t0 = min((s.start_ns for s in spans), default=0)
    threads: dict[tuple[int, int], int] = {}
    events = []
    for s in sorted(spans, key=lambda s: (s.rank, s.start_ns)):
        tid = threads.setdefault((s.rank, s.thread), sum(r == s.rank for r, _ in threads))
        events.append(
            {
                "name": s.name if "mb" not in s.args else f"{s.name} {s.args['mb']}",
                "cat": s.kind,
                "ph": "X",
                "pid": s.rank,
                "tid": tid,
                "ts": (s.start_ns - t0) / 1e3,
                "dur": s.duration_ns / 1e3,
                "args": {"step": s.step, **{k: _jsonable(v) for k, v in s.args.items()}},
            }
        )
    for rank in sorted({s.rank for s in spans}):
        label = (rank_labels or {}).get(rank, f"rank {rank}")
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _jsonable(value: object) -> object:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
