"""Pipeline schedules as plain functions over one stage.

A schedule only decides the order of work; the stage does the work. ``stage`` provides::

    recv_forward(i) -> x          forward(i, x) -> y          send_forward(i, y)
    recv_backward(i) -> g         backward(i, g) -> dx        send_backward(i, dx)
    send_forward_recv_backward(i, y, j) -> g        # send y of microbatch i, get the grad of microbatch j
    send_backward_recv_forward(j, dx, i) -> x       # send dx of microbatch j, get the input of microbatch i

and ``stage.pp_rank``, ``stage.pp``. Sends and receives are no-ops where the stage has no neighbour, so
every stage runs the same code. Every stage of one pipeline must run the same schedule with the same M.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_titan.pipeline.interleaved import check_microbatches as check_interleaved
from lightning_titan.pipeline.interleaved import interleaved_1f1b


def gpipe(stage: Any, num_microbatches: int) -> None:
    """All forwards, then all backwards (in reverse). Peak: M microbatches of activations live."""
    for i in range(num_microbatches):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))
    for i in reversed(range(num_microbatches)):
        stage.send_backward(i, stage.backward(i, stage.recv_backward(i)))


def one_f_one_b(stage: Any, num_microbatches: int) -> None:
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


def forward_only(stage: Any, num_microbatches: int) -> None:
    """Evaluation: forwards only, no activations kept for backward."""
    for i in range(num_microbatches):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))


# schedules over several chunks per rank (virtual stages); their stage interface is interleaved.py's
CHUNKED: dict[str, Callable[[Any, int], None]] = {"interleaved_1f1b": interleaved_1f1b}
SCHEDULES: dict[str, Callable[[Any, int], None]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    **CHUNKED,
}


def check_microbatches(schedule: str, m: int, pp: int, virtual_stages: int) -> None:
    """Raise, saying which M work, if ``schedule`` cannot run ``m`` microbatches on this layout."""
    if schedule in CHUNKED:
        check_interleaved(pp, virtual_stages, m)
    elif virtual_stages > 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs an interleaved schedule, not "
            f"schedule={schedule!r}: use one of {sorted(CHUNKED)} (or virtual_stages=1)"
        )


def get_schedule(name: str) -> Callable[[Any, int], None]:
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is unknown; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]
