"""ZBV (Qi et al., "Pipeline Parallelism with Controllable Memory", the V-shaped zero bubble schedule).

Each of P ranks holds two chunks: rank r holds virtual stage r (chunk 0, on the way down) and virtual
stage 2P-1-r (chunk 1, on the way back), so activations go 0 -> P-1 through the chunk 0's, turn on
the last rank (its two chunks are adjacent: the handoff stays on the rank) and come back P-1 -> 0
through the chunk 1's. Rank 0 embeds (chunk 0) and computes the loss (chunk 1). Backward is split as
in ZB-H1 (``backward_split``): B (the input grad) is on the critical path, W (the weight grads) fills
the bubbles.

The order is torch's ``ScheduleZBVZeroBubble`` (and the paper's figure): warmup forwards shaped like
the V, a steady state of F B W on chunk 0 then F B W on chunk 1, and a cooldown of B's with the W's
after them. It is built for max(M, 2P-1) microbatches and the ones beyond M dropped, so any M >= 1
runs (with fewer than 2P-1 the pipeline is never full). At most 2P chunk-microbatches are live (F
run, W not yet) on any rank: 1F1B's peak of P whole stages.

A zbv stage provides ``forward_chunk(chunk, i)``, ``backward_input_chunk(chunk, i)``,
``backward_weight_chunk(chunk, i)`` (inputs: what ``exchange_messages`` received),
``exchange_messages(done, take)`` (``done``: the action just run, whose output goes where ``output``
says; ``take``: the messages to receive, each the next of its peer's ``stream``: those its neighbours
sent at the same step of ``timetable``, so that both ranks of a pair post a message in the same
exchange, as NCCL needs) and ``pp``, ``pp_rank``. Messages keep their chunk: rank r's chunk 0 feeds
rank r+1's chunk 0, rank r's chunk 1 feeds rank r-1's chunk 1, and grads go the other way.
"""

from __future__ import annotations

from lightning_titan.parallel.pipeline.protocols import VStage

Action = tuple[str, int, int]  # ("F" | "B" | "W" | "BW": B and W at once, chunk 0 | 1, microbatch)
Message = tuple[str, int, int]  # ("act" | "grad", chunk it is for, microbatch)
# one tick of a rank's clock: an action, or (DualPipeV) a forward and a backward overlapped
Step = tuple[Action, ...]


def check_microbatches(pp: int, virtual_stages: int, m: int, schedule: str = "zbv") -> None:
    if virtual_stages != 2:
        raise ValueError(
            f"schedule={schedule!r} places exactly two chunks on every rank (the V): virtual_stages="
            f"{virtual_stages} does not work; use virtual_stages=2"
        )
    if pp < 2:
        fix = "'1f1b_overlap'" if schedule == "dualpipev" else "'1f1b'"
        raise ValueError(
            f"schedule={schedule!r} needs pp >= 2 (got pp={pp}): with one stage there is no V; use "
            f"schedule={fix}"
        )
    least = 2 * pp if schedule == "dualpipev" else 1
    if m < least:
        raise ValueError(
            f"schedule={schedule!r} needs num_microbatches >= {least} on pp={pp}, got {m}"
            + (
                ": the V's two chunks per rank, each with a microbatch in flight"
                if least > 1
                else ""
            )
        )


def order(pp: int, rank: int, m: int, train: bool = True) -> list[Action]:
    """Rank ``rank``'s F, B and W actions, in the order it runs them (``train=False``: evaluation, the
    forwards of chunk 0, then those of chunk 1)."""
    if not train:
        return [("F", chunk, i) for chunk in (0, 1) for i in range(m)]
    n = max(m, 2 * pp - 1)  # enough microbatches to fill the V; those >= m are dropped below
    ops: list[Action] = []
    f, b, w = [0, 0], [0, 0], [0, 0]  # next microbatch to forward / B / W, per chunk

    def run(kind: str, chunk: int) -> None:
        count = {"F": f, "B": b, "W": w}[kind]
        ops.append((kind, chunk, count[chunk]))
        count[chunk] += 1

    # warmup: the down stroke of the V, then forwards alternating with the way back
    for _ in range(2 * (pp - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(pp - rank):
        run("F", 1)
        run("B", 1)
        run("W", 1)
    # steady: F B W on chunk 0, then on chunk 1
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        run("F", 1)
        run("B", 1)
        run("W", 1)
    # cooldown: the last B's, with chunk 0's W's in the gaps and the rest at the end
    for _ in range(rank):
        run("B", 0)
        run("B", 1)
    for _ in range(pp - rank):
        run("B", 0)
        run("W", 0)
    while w[1] < b[1]:
        run("W", 1)
    while w[0] < b[0]:
        run("W", 0)
    return [a for a in ops if a[2] < m]


def dualpipev_order(pp: int, rank: int, m: int) -> list[Step]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into the V; torch's ``ScheduleDualPipeV``): rank
    ``rank``'s ticks. Its steady state pairs the forward of one chunk with the whole backward (B and
    W, "BW") of the other, overlapped (``parallel/overlap.py``): each one's all-to-alls run under
    the other's compute. The warmup and cooldown are zbv's shapes, with B and W apart where a W can
    wait for a bubble. Needs M >= 2P. Holds 2P chunk-microbatches (2P+1 on the last rank)."""
    ticks: list[Step] = []
    f, b = [0, 0], [0, 0]  # next microbatch to forward / to back-propagate, per chunk
    weights: list[Action] = []  # W's owed, oldest first

    def act(kind: str, chunk: int) -> Action:
        count = f if kind == "F" else b
        count[chunk] += 1
        if kind == "B":
            weights.append(("W", chunk, count[chunk] - 1))
        return (kind, chunk, count[chunk] - 1)

    def run(*kinds: tuple[str, int]) -> None:
        ticks.append(tuple(act(kind, chunk) for kind, chunk in kinds))

    def owed_weight() -> None:
        if weights:
            ticks.append((weights.pop(0),))

    later = pp - rank - 1  # ticks this rank starts its V later than the last rank
    for _ in range(2 * later):
        run(("F", 0))
    for _ in range(rank + 1):
        run(("F", 0))
        run(("F", 1))
    for _ in range(later):
        run(("B", 1))
        owed_weight()
        run(("F", 1))
    for k in range(m - 2 * pp + rank + 1):
        if k == 0 and rank == pp - 1:  # the turn's first pair run apart: a shorter bubble
            run(("F", 0))
            run(("BW", 1))
        else:
            run(("F", 0), ("BW", 1))
        run(("F", 1), ("BW", 0))
    for _ in range(later):
        run(("BW", 1))
        run(("F", 1), ("BW", 0))
    split = False  # the cooldown's second half splits B from W, whose W's fill the gaps
    for k in range(rank + 1):
        split = split or (k == (rank + 1) // 2 and rank % 2 == 1)
        run(("B" if split else "BW", 1))
        split = split or (k == (rank + 1) // 2 and rank % 2 == 0)
        run(("B" if split else "BW", 0))
    for _ in range(later):
        owed_weight()
        run(("B" if split else "BW", 0))
    while weights:
        owed_weight()
    return ticks


def output(pp: int, rank: int, action: Action) -> tuple[int, Message] | None:
    """Where an action's output goes: (peer pp rank, the message), or None (kept on the rank: the
    turn on the last rank; or nothing to send: the head's output, a W, the embedding's input grad)."""
    kind, chunk, i = action
    last = rank == pp - 1
    if kind == "F":
        if chunk == 0:
            return None if last else (rank + 1, ("act", 0, i))
        return None if rank == 0 else (rank - 1, ("act", 1, i))
    if kind in ("B", "BW"):
        if chunk == 1:
            return None if last else (rank + 1, ("grad", 1, i))
        return None if rank == 0 else (rank - 1, ("grad", 0, i))
    return None


def needs(pp: int, rank: int, action: Action) -> tuple[int, Message] | None:
    """The message an action needs from another rank first: (peer pp rank, the message), or None."""
    kind, chunk, i = action
    last = rank == pp - 1
    if kind == "F":
        if chunk == 0:
            return None if rank == 0 else (rank - 1, ("act", 0, i))
        return None if last else (rank + 1, ("act", 1, i))
    if kind in ("B", "BW"):
        if chunk == 1:
            return None if rank == 0 else (rank - 1, ("grad", 1, i))
        return None if last else (rank + 1, ("grad", 0, i))
    return None


def stream(
    pp: int, src: int, dst: int, m: int, train: bool = True, schedule: str = "zbv"
) -> list[Message]:
    """The messages rank ``src`` sends rank ``dst`` in one step, in the order it sends them: one
    ordered stream per pair of ranks (NCCL matches by order)."""
    if not 0 <= src < pp:
        return []
    sent = (output(pp, src, a) for step in steps(schedule, pp, src, m, train) for a in step)
    return [msg for out in sent if out is not None and out[0] == dst for msg in [out[1]]]


def steps(schedule: str, pp: int, rank: int, m: int, train: bool = True) -> list[Step]:
    """Rank ``rank``'s ticks under ``schedule`` ("zbv" or "dualpipev")."""
    if schedule == "dualpipev" and train:
        return dualpipev_order(pp, rank, m)
    return [(a,) for a in order(pp, rank, m, train)]


def zbv(stage: VStage, num_microbatches: int) -> None:
    """Train: this rank's actions (``order``) with their messages."""
    _run(stage, num_microbatches, train=True)


def dualpipev(stage: VStage, num_microbatches: int) -> None:
    """Train: this rank's ticks (``dualpipev_order``) with their messages."""
    _run(stage, num_microbatches, train=True, schedule="dualpipev")


def zbv_forward_only(stage: VStage, num_microbatches: int) -> None:
    """Evaluation: the forwards down the V, then back up."""
    _run(stage, num_microbatches, train=False)


def timetable(
    pp: int, m: int, train: bool = True, schedule: str = "zbv"
) -> list[list[Step | None]]:
    """Every rank's ticks on a common clock of unit steps: each rank runs its ``steps``, a tick at
    the first step after the one its inputs were sent at; None: the rank idles that step."""
    todo = [steps(schedule, pp, r, m, train) for r in range(pp)]
    table: list[list[Step | None]] = [[] for _ in range(pp)]
    sent_at: dict[tuple[int, Message], int] = {}  # (receiving rank, message): the step it was sent
    step = 0
    while any(todo):
        ran: list[Step | None] = []
        for r, left in enumerate(todo):
            needed = [need for a in left[0] if (need := needs(pp, r, a))] if left else []
            ready = left and all(sent_at.get((r, need[1]), step) < step for need in needed)
            table[r].append(left.pop(0) if ready else None)
            ran.append(table[r][-1])
        if not any(ran):
            raise RuntimeError(f"{schedule}'s order stalls at step {step} (pp={pp}, M={m})")
        for r, tick in enumerate(ran):
            for action in tick or ():
                out = output(pp, r, action)
                if out is not None:
                    sent_at[out] = step
        step += 1
    return table


def _run(stage: VStage, m: int, train: bool, schedule: str = "zbv") -> None:
    """The ranks keep ``timetable``'s clock: after its tick of a step (or none), each rank sends
    the tick's outputs and receives what its neighbours sent at that step, in one exchange. So two
    ranks exchange their messages in the same steps, as one batch on each side: NCCL, which runs a
    rank's batches in order and a send only with its receive, finds every pair matched. (A send in
    a batch of its own, with the receive due later, deadlocks there once the peer does the same.)
    Every tick's inputs were sent at an earlier step, so they are in when it runs."""
    pp, p = stage.pp, stage.pp_rank
    check_microbatches(pp, 2, m, schedule if train else "zbv")
    table = timetable(pp, m, train, schedule)
    run = {
        "F": stage.forward_chunk,
        "B": stage.backward_input_chunk,
        "W": stage.backward_weight_chunk,
        "BW": stage.backward_chunk,
    }
    for step, tick in enumerate(table[p]):
        if tick is not None and len(tick) == 2:
            stage.overlap_chunks(tick[0][1:], tick[1][1:])
        elif tick is not None:
            kind, chunk, i = tick[0]
            run[kind](chunk, i)
        take = []
        for peer in (p - 1, p + 1):
            theirs = table[peer][step] if 0 <= peer < pp and step < len(table[peer]) else None
            for out in (output(pp, peer, a) for a in theirs or ()):
                if out is not None and out[0] == p:
                    take.append((peer, out[1]))
        stage.exchange_messages(tick, take)
