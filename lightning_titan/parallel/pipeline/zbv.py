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

Action = tuple[str, int, int]  # ("F" | "B" | "W", chunk 0 | 1, microbatch)
Message = tuple[str, int, int]  # ("act" | "grad", chunk it is for, microbatch)


def check_microbatches(pp: int, virtual_stages: int, m: int) -> None:
    if virtual_stages != 2:
        raise ValueError(
            f"schedule='zbv' places exactly two chunks on every rank (the V): virtual_stages="
            f"{virtual_stages} does not work; use virtual_stages=2"
        )
    if pp < 2:
        raise ValueError(
            f"schedule='zbv' needs pp >= 2 (got pp={pp}): with one stage there is no V; use "
            "schedule='1f1b'"
        )
    if m < 1:
        raise ValueError(f"schedule='zbv' needs num_microbatches >= 1, got {m}")


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


def output(pp: int, rank: int, action: Action) -> tuple[int, Message] | None:
    """Where an action's output goes: (peer pp rank, the message), or None (kept on the rank: the
    turn on the last rank; or nothing to send: the head's output, a W, the embedding's input grad)."""
    kind, chunk, i = action
    last = rank == pp - 1
    if kind == "F":
        if chunk == 0:
            return None if last else (rank + 1, ("act", 0, i))
        return None if rank == 0 else (rank - 1, ("act", 1, i))
    if kind == "B":
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
    if kind == "B":
        if chunk == 1:
            return None if rank == 0 else (rank - 1, ("grad", 1, i))
        return None if last else (rank + 1, ("grad", 0, i))
    return None


def stream(pp: int, src: int, dst: int, m: int, train: bool = True) -> list[Message]:
    """The messages rank ``src`` sends rank ``dst`` in one step, in the order it sends them: one
    ordered stream per pair of ranks (NCCL matches by order)."""
    sent = (output(pp, src, a) for a in order(pp, src, m, train)) if 0 <= src < pp else iter(())
    return [msg for out in sent if out is not None and out[0] == dst for msg in [out[1]]]


def zbv(stage: VStage, num_microbatches: int) -> None:
    """Train: this rank's actions (``order``) with their messages."""
    _run(stage, num_microbatches, train=True)


def zbv_forward_only(stage: VStage, num_microbatches: int) -> None:
    """Evaluation: the forwards down the V, then back up."""
    _run(stage, num_microbatches, train=False)


def timetable(pp: int, m: int, train: bool = True) -> list[list[Action | None]]:
    """Every rank's actions on a common clock of unit steps: each rank runs ``order``, an action at
    the first step after the one its input was sent at; None: the rank idles that step."""
    orders = [order(pp, r, m, train) for r in range(pp)]
    table: list[list[Action | None]] = [[] for _ in range(pp)]
    sent_at: dict[tuple[int, Message], int] = {}  # (receiving rank, message): the step it was sent
    step = 0
    while any(len(o) for o in orders):
        ran = []
        for r, todo in enumerate(orders):
            need = needs(pp, r, todo[0]) if todo else None
            ready = todo and (need is None or sent_at.get((r, need[1]), step) < step)
            table[r].append(todo.pop(0) if ready else None)
            ran.append(table[r][-1])
        if not any(ran):
            raise RuntimeError(f"zbv's order stalls at step {step} (pp={pp}, M={m})")
        for r, action in enumerate(ran):
            out = None if action is None else output(pp, r, action)
            if out is not None:
                sent_at[out] = step
        step += 1
    return table


def _run(stage: VStage, m: int, train: bool) -> None:
    """The ranks keep ``timetable``'s clock: after its action of a step (or none), each rank sends
    the action's output and receives what its neighbours sent at that step, in one exchange. So two
    ranks exchange their messages in the same steps, as one batch on each side: NCCL, which runs a
    rank's batches in order and a send only with its receive, finds every pair matched. (A send in
    a batch of its own, with the receive due later, deadlocks there once the peer does the same.)
    Every action's input was sent at an earlier step, so it is in when the action runs."""
    pp, p = stage.pp, stage.pp_rank
    check_microbatches(pp, 2, m)
    table = timetable(pp, m, train)
    run = {
        "F": stage.forward_chunk,
        "B": stage.backward_input_chunk,
        "W": stage.backward_weight_chunk,
    }
    for step, action in enumerate(table[p]):
        if action is not None:
            run[action[0]](*action[1:])
        take = []
        for peer in (p - 1, p + 1):
            theirs = table[peer][step] if 0 <= peer < pp and step < len(table[peer]) else None
            out = None if theirs is None else output(pp, peer, theirs)
            if out is not None and out[0] == p:
                take.append((peer, out[1]))
        stage.exchange_messages(action, take)
