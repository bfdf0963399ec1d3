"""Pipeline schedules as plain functions over one stage.

A schedule only decides the order of work; the stage does the work. ``stage`` provides::

    recv_forward(i) -> x          forward(i, x) -> y          send_forward(i, y)
    recv_backward(i) -> g         backward(i, g) -> dx        send_backward(i, dx)
    send_forward_recv_backward(i, y, j) -> g        # send y of microbatch i, get the grad of microbatch j
    send_backward_recv_forward(j, dx, i) -> x       # send dx of microbatch j, get the input of microbatch i

(zero-bubble schedules split ``backward`` into ``backward_input(i, g) -> dx`` and, later,
``backward_weight(i)``), and ``stage.pp_rank``, ``stage.pp``. Sends and receives are no-ops where the
stage has no neighbour, so every stage runs the same code. Every stage of one pipeline must run the
same schedule with the same M.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_titan.parallel.pipeline.interleaved import check_microbatches as check_interleaved
from lightning_titan.parallel.pipeline.interleaved import interleaved_1f1b
from lightning_titan.parallel.pipeline.protocols import Stage
from lightning_titan.parallel.pipeline.zbv import check_microbatches as check_zbv
from lightning_titan.parallel.pipeline.zbv import dualpipev, zbv


def gpipe(stage: Stage, num_microbatches: int) -> None:
    """All forwards, then all backwards (in reverse). Peak: M microbatches of activations live."""
    for i in range(num_microbatches):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))
    for i in reversed(range(num_microbatches)):
        stage.send_backward(i, stage.backward(i, stage.recv_backward(i)))


def one_f_one_b(stage: Stage, num_microbatches: int) -> None:
    """1F1B (PipeDream-flush): at most P - p microbatches live on stage p.

    Warmup: stage p runs P - p - 1 forwards so the last stage can start its first backward at once.
    Steady: one forward then one backward; sends and receives to the same neighbour are paired.
    Cooldown: the backwards of the warmup microbatches.
    """
    m = num_microbatches
    warmup = min(m, stage.pp - stage.pp_rank - 1)
    steady = m - warmup

    for i in range(warmup):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))

    x = stage.recv_forward(warmup) if steady > 0 else None
    for k in range(steady):
        i, j = warmup + k, k  # forward microbatch i, backward microbatch j
        grad = stage.send_forward_recv_backward(i, stage.forward(i, x), j)
        dx = stage.backward(j, grad)
        if k == steady - 1:
            stage.send_backward(j, dx)
        else:
            x = stage.send_backward_recv_forward(j, dx, i + 1)

    for j in range(steady, m):
        stage.send_backward(j, stage.backward(j, stage.recv_backward(j)))


def one_f_one_b_overlap(stage: Stage, num_microbatches: int) -> None:
    """1F1B with its steady state overlapped, on one stage (pp=1): the forward of microbatch i+1
    runs with the backward of i (``stage.forward_backward``, ``parallel/overlap.py``), each one's
    expert-parallel all-to-alls under the other's compute. One microbatch live, as 1F1B: the pair's
    backward frees faster than its forward saves. (With pp > 1 a stage's backward waits for the next stage's grad of the same tick, which
    would run the stages one after another: there the V's ``dualpipev`` pairs its two chunks.)"""
    m = num_microbatches
    stage.forward(0, None)
    for i in range(1, m):
        stage.forward_backward(i, None, i - 1, None)
    stage.backward(m - 1, None)


def zb_h1(stage: Stage, num_microbatches: int) -> None:
    """ZB-H1 (Qi et al., zero-bubble pipeline parallelism): 1F1B with each backward split into B (the
    input grad, sent upstream at once) and W (the weight grads, ``stage.backward_weight``).

    Stage p defers its W's by p backwards, so they fill the cooldown, where 1F1B waits: the first
    stage runs B W B W (1F1B's order), the last one F B F B ... with its W's at the end. At most
    min(M, P) microbatches are live (forward run, W not yet) on every stage: 1F1B's peak (stage 0's).
    """
    m, delay = num_microbatches, stage.pp_rank
    warmup = min(m, stage.pp - stage.pp_rank - 1)
    steady = m - warmup
    deferred: list[int] = []

    def weights_after(j: int) -> None:
        deferred.append(j)
        if len(deferred) > delay:
            stage.backward_weight(deferred.pop(0))

    for i in range(warmup):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))

    x = stage.recv_forward(warmup) if steady > 0 else None
    for k in range(steady):
        i, j = warmup + k, k  # forward microbatch i, backward microbatch j
        grad = stage.send_forward_recv_backward(i, stage.forward(i, x), j)
        stage.send_backward(j, stage.backward_input(j, grad))  # upstream first: the critical path
        weights_after(j)
        if k < steady - 1:
            x = stage.recv_forward(i + 1)

    for j in range(steady, m):
        stage.send_backward(j, stage.backward_input(j, stage.recv_backward(j)))
        weights_after(j)
    for j in deferred:
        stage.backward_weight(j)


def forward_only(stage: Stage, num_microbatches: int) -> None:
    """Evaluation: forwards only, no activations kept for backward."""
    for i in range(num_microbatches):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))


# schedules over several chunks per rank (virtual stages); their stage interface is interleaved.py's
CHUNKED: dict[str, Callable[[Any, int], None]] = {"interleaved_1f1b": interleaved_1f1b}
# two chunks per rank in a V (rank r: virtual stages r and 2P-1-r); their stage interface is zbv.py's
V_SHAPED: dict[str, Callable[[Any, int], None]] = {"zbv": zbv, "dualpipev": dualpipev}
# the schedules that overlap one microbatch's forward with another's backward (parallel/overlap.py)
OVERLAPPED = ("1f1b_overlap", "dualpipev")
# the schedules whose backward is B then W (parallel/pipeline/backward_split.py)
SPLIT_BACKWARD = ("zb_h1", *V_SHAPED)
SCHEDULES: dict[str, Callable[[Any, int], None]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b_overlap": one_f_one_b_overlap,
    "zb_h1": zb_h1,
    **CHUNKED,
    **V_SHAPED,
}


def check_microbatches(schedule: str, m: int, pp: int, virtual_stages: int) -> None:
    """Raise, saying which M work, if ``schedule`` cannot run ``m`` microbatches on this layout."""
    if schedule in CHUNKED:
        check_interleaved(pp, virtual_stages, m)
    elif schedule in V_SHAPED:
        check_zbv(pp, virtual_stages, m, schedule)
    elif schedule == "1f1b_overlap" and pp > 1:
        raise ValueError(
            f"schedule='1f1b_overlap' overlaps microbatches on one stage (pp=1), got pp={pp}: "
            "across stages a backward waits for the next stage's grad of the same tick, so the "
            "stages would run one after another; use schedule='dualpipev' (the V, virtual_stages=2)"
        )
    elif virtual_stages > 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs a schedule over several chunks per rank, not "
            f"schedule={schedule!r}: use one of {sorted({**CHUNKED, **V_SHAPED})} (or "
            "virtual_stages=1)"
        )


def check_placement(schedule: str | None, num_chunks: int, v_shape: bool) -> None:
    """Raise unless ``schedule`` (None: forward only, which runs on any placement) runs on a stage
    built with ``num_chunks`` chunks, in a V or not."""
    if schedule is None:
        return
    if v_shape != (schedule in V_SHAPED):
        raise ValueError(
            f"schedule={schedule!r} needs the V placement: build the model with "
            "StageSplit(virtual_stages=2, v_shape=True)"
            if not v_shape
            else f"schedule={schedule!r} cannot run the V placement this stage was built with "
            f"(StageSplit(v_shape=True)); use one of {sorted(V_SHAPED)}"
        )
    if not v_shape and (num_chunks > 1) != (schedule in CHUNKED):
        raise ValueError(
            f"schedule={schedule!r} runs one chunk per rank but this stage holds {num_chunks} "
            f"(virtual_stages): use one of {sorted(CHUNKED)}"
            if num_chunks > 1
            else f"schedule={schedule!r} needs virtual_stages >= 2 (this stage holds one chunk); "
            "build the model with StageSplit(virtual_stages=...) or use schedule='1f1b'"
        )


def default_microbatches(schedule: str, pp: int) -> int:
    """The fewest microbatches that keep every stage busy: one per stage; the overlapped schedules
    need a second microbatch in flight to pair with (1f1b_overlap: 2, dualpipev: 2P)."""
    return {"1f1b_overlap": 2, "dualpipev": 2 * pp}.get(schedule, pp)


def get_schedule(name: str) -> Callable[[Any, int], None]:
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is unknown; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]
