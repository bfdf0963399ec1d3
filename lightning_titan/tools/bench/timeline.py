"""Per case a Chrome trace (``timeline/<case>.json``: open in ui.perfetto.dev) and, for pipeline
and EP cases, a Gantt chart of the last traced step (``timeline/<case>.png``)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_titan.lightning import plots
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.runtime import tracing
from lightning_titan.tools.bench.cases import OURS, SCHEDULE_IMPLS, Case


def write(
    out: Path, case: Case, spans: list[tracing.Span], num_microbatches: int, impl: str = OURS
) -> None:
    """The case's Chrome trace and Gantt chart; for another impl than ours (``--ep-overlap``), its
    own, named after its schedule."""
    dims = ParallelDims(case.dp, case.pp, case.ep, tp=case.tp, cp=case.cp)
    labels = {r: f"rank {r} ({dims.label(r)})" for r in range(case.world)}
    name = case.name if impl == OURS else f"{case.layout} {SCHEDULE_IMPLS.get(impl) or impl}"
    slug = name.replace(" ", "_")
    (out / "timeline").mkdir(parents=True, exist_ok=True)
    (out / "timeline" / f"{slug}.json").write_text(json.dumps(plots.chrome_trace(spans, labels)))
    if (case.pp > 1 or case.ep > 1) and spans and plots.available():
        last = max(s.step for s in spans)  # the steadiest recorded step
        plots.plot_gantt(
            [s for s in spans if s.step == last],
            out / "timeline" / f"{slug}.png",
            labels,
            title=f"{name}, M={num_microbatches}: measured timeline (F/B/W microbatch.chunk)",
        )
