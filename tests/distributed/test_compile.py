"""``TitanLM(compile=True)``'s stage (``model/compiled.py``) trains the same model as eager, and
compiles once.

The regions are compiled with the ``aot_eager`` backend: Dynamo's capture, its graph breaks at the
collectives and AOTAutograd's compiled backward (one autograd node per region, what the zero-bubble
split sees) are all exercised, without inductor's C++ compile, which takes minutes on a 2-core box.
Inductor's own rounding is measured by ``titan bench --compile`` and stated in docs/concepts.md.
One process against eager (also under activation checkpointing, and with expert capacity,
whose changing row counts must not recompile), then one spawn of 8 ranks running zero=3 under dp2 x
ep4 (each block gathered around its use) and dp2 x pp2 x ep2 (the stage whole for the step), then
dp2 x pp2 x ep2, tp2 x pp2 x ep2, cp2 x pp2 x ep2 and zbv against the eager single process, at the
equivalence suite's tolerances; no rank compiles a graph after the first step, and no graph breaks
where no region holds a collective (no tp, no cp).
"""

import pytest
import torch
from engine_harness import (
    ACKPT_CONFIG,
    CAPACITY_CONFIG,
    SELECTIVE_CONFIG,
    assert_matches_reference,
    reference,
    run_layouts,
    train,
)

from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.runtime.launch import run_on_ranks

BACKEND = "aot_eager"
LAYOUTS = [
    # zero=3, first (the regions traced while its hooks gather and free the weights around them,
    # which the graphs read as inputs): at pp=1 each block gathered for its forward and again for
    # its backward (AOTAutograd's saved weights refilled in place); under a pipeline the stage
    # whole for the step
    ((2, 1, 4), f"1f1b:zero3:compile={BACKEND}", 1),  # dp2 x ep4
    ((2, 2, 2), f"1f1b:zero3:compile={BACKEND}", 2),  # dp2 x pp2 x ep2
    ((2, 2, 2), f"1f1b:compile={BACKEND}", 2),
    # Dynamo alone (backend "eager": no AOTAutograd, half the compile time of 8 ranks on 2 cores)
    # where what is new is the capture: graph breaks at TP's gather and reduce-scatter, CP's key
    # gather and positions
    ((1, 2, 2, 2), "1f1b:compile=eager", 2),
    ((1, 2, 2, 1, 2), "1f1b:compile=eager", 2),
    # B/W split: the routers only, their graphs compiled by the cases above and reused: a backward
    # that kept the graph for W must not find its buffers donated
    ((2, 2, 2), f"zbv:compile={BACKEND}", 2),
]


@pytest.fixture(scope="module")
def ref():
    return reference()


def test_one_process_compiled_equals_eager_and_compiles_once(ref):
    torch._dynamo.reset()  # nothing cached from an earlier test: the first step compiles
    result = train(ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None), "gpipe", 1,
                   compile=BACKEND)  # fmt: skip
    # the attention region's graph, the router's and the experts' activation's, each shared by the
    # four blocks, and the last stage's head and loss
    assert result["graphs"] == 5
    assert result["recompiled"] == 0
    assert_matches_reference(ref, [result], "one process compiled")
    # and the stage, once compiled, runs more steps under torch's own no-recompile stance
    with torch.compiler.set_stance("fail_on_recompile"):
        again = train(ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None), "gpipe", 1,
                      compile=BACKEND, steps=3)  # fmt: skip
    assert again["loss"] == pytest.approx(ref["loss"][:3], rel=1e-5)
    # activation checkpointing runs the compiled regions again in the backward: the same numbers
    recomputed = train(ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None), "gpipe", 1,
                       ACKPT_CONFIG, compile=BACKEND)  # fmt: skip
    assert recomputed["recompiled"] == 0
    assert_matches_reference(ref, [recomputed], "one process compiled, activation checkpointing")
    # selective recompute: the attention eager, the experts' activation compiled inside the
    # recompute (without grad in the forward, with it in the backward: a graph each, reused)
    selective = train(ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None), "gpipe", 1,
                      SELECTIVE_CONFIG, compile=BACKEND, steps=3)  # fmt: skip
    assert selective["recompiled"] == 0
    assert selective["loss"] == pytest.approx(ref["loss"][:3], rel=1e-5)
    # expert capacity drops a different number of rows in every block and step: the experts'
    # activation sees a new row count each time, a symbol from its first trace, so it compiles once
    torch._dynamo.reset()
    capped = train(ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None), "gpipe", 1,
                   CAPACITY_CONFIG, compile=BACKEND)  # fmt: skip
    assert len(set(capped["dropped"])) > 1, "the test needs the dropped rows to change"
    assert (capped["graphs"], capped["recompiled"]) == (5, 0)
    assert_matches_reference(reference(CAPACITY_CONFIG), [capped], "one process compiled, capacity")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_layouts_equal_one_process(ref):
    per_rank = run_on_ranks(run_layouts, 8, LAYOUTS, timeout_s=580, start_method="fork")
    for i, (layout, schedule, m) in enumerate(LAYOUTS):
        results = [per_rank[r][i] for r in range(8)]
        assert_matches_reference(ref, results, f"{layout} {schedule} M={m}")
        recompiled = [r["recompiled"] for r in results]
        assert recompiled == [0] * 8, (
            f"{layout} {schedule}: graphs compiled after step 1 {recompiled}"
        )
        # no collective inside a region without tp or cp: no graph break (zero=3's hooks stay
        # outside the graphs)
        if layout[3:] in ((), (1,), (1, 1)):
            breaks = [r["graph_breaks"] for r in results]
            assert breaks == [0] * 8, f"{layout} {schedule}: graph breaks {breaks}"
        if i == 0:  # traced under zero=3 (no earlier case had its shapes)
            assert all(r["graphs"] > 0 for r in results), [r["graphs"] for r in results]
        if ":zero3" in schedule and layout[1] == 1:  # the blocks did gather around their use
            for r in results:
                seen = r["block_gathers"]
                assert seen["kept"] > 0 and seen["prefetched"] > 0, (layout, schedule, seen)
                assert seen["wasted"] == 0, (layout, schedule, seen)
