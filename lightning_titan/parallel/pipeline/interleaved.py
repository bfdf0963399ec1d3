"""Interleaved 1F1B (Megatron-LM's virtual pipeline): each rank holds ``v`` chunks of layers.

Virtual stage ``s`` is chunk ``s // pp`` of rank ``s % pp`` (``pipeline.split``), so activations go
round the ring of ranks v times: the last rank's chunk c feeds the first rank's chunk c + 1. The
bubble shrinks from (P-1)/(M+P-1) to (P-1)/(v*M+P-1) for v times as many messages.

Every rank runs its v*M forwards in the same order: in groups of P microbatches, chunk by chunk
(``forward_ids``), and its backwards likewise with the chunks reversed (``backward_ids``); this needs
M to be a multiple of P. Each step's sends and receives go out together (``stage.exchange``), so
the ring cannot deadlock. That is the order for NCCL, which pairs each send with its receive. On
CPU the sends do not wait and every receive is posted ahead (``StageLinks``), so each message moves
as soon as it can: a chunk's output is sent when its forward ends, not after the backward that
follows it, and a receive marked due by an exchange is waited for only when a chunk needs it
(``PipelineStage._received``). Every wait is then on data its peer produces without waiting for a
send, the dependencies the schedule's order already satisfies (the order tests), so nothing
deadlocks. On pp2 at d_model 64 the paired exchange held each rank 2-5 ms on most steady steps: the
peer's output of a forward waited for the backward after it.

A chunked stage provides::

    forward_chunk(chunk, i)     backward_chunk(chunk, i)     # inputs: what exchange received
    exchange(send_forward=(chunk, i) | None, send_backward=(chunk, i) | None,
             recv_forward=bool, recv_backward=bool)       # the next message of each stream

and ``pp``, ``pp_rank``, ``num_chunks``. The stage drops a send where the chunk has no neighbour
(the head's output, the embedding's input grad). A received message is the next one of its stream:
the sender's forwards (backwards) in the order above, restricted to the chunks that send to this
rank (``stream_ids``).
"""

from __future__ import annotations

from lightning_titan.parallel.pipeline.protocols import ChunkedStage

ChunkId = tuple[int, int]  # (chunk, microbatch)


def check_microbatches(pp: int, v: int, m: int) -> None:
    if v < 2:
        raise ValueError(
            f"schedule='interleaved_1f1b' needs virtual_stages >= 2 (got {v}); with one chunk per "
            "rank use schedule='1f1b'"
        )
    if pp < 2:
        raise ValueError(
            "schedule='interleaved_1f1b' needs pp >= 2: with one stage there is no bubble to fill"
        )
    if m % pp:
        raise ValueError(
            f"schedule='interleaved_1f1b' runs microbatches in groups of pp={pp}: num_microbatches="
            f"{m} does not work; use a multiple of {pp} (M = {pp}, {2 * pp}, {3 * pp}, ...)"
        )


def _chunk_id(k: int, pp: int, v: int, forward: bool) -> ChunkId:
    group, r = divmod(k, pp * v)
    chunk = r // pp if forward else v - 1 - r // pp
    return chunk, group * pp + r % pp


def forward_ids(pp: int, v: int, m: int) -> list[ChunkId]:
    return [_chunk_id(k, pp, v, True) for k in range(v * m)]


def backward_ids(pp: int, v: int, m: int) -> list[ChunkId]:
    return [_chunk_id(k, pp, v, False) for k in range(v * m)]


def has_prev(pp_rank: int, chunk: int) -> bool:
    """Whether this chunk's input comes from another stage (virtual stage 0 embeds the tokens)."""
    return not (pp_rank == 0 and chunk == 0)


def has_next(pp: int, pp_rank: int, v: int, chunk: int) -> bool:
    """Whether this chunk's output goes to another stage (the last virtual stage runs the head)."""
    return not (pp_rank == pp - 1 and chunk == v - 1)


def stream_ids(pp: int, pp_rank: int, v: int, m: int) -> tuple[list[ChunkId], list[ChunkId]]:
    """The (chunk, microbatch) of each activation this rank receives, in order, and of each grad."""
    acts = [c for c in forward_ids(pp, v, m) if has_prev(pp_rank, c[0])]
    grads = [c for c in backward_ids(pp, v, m) if has_next(pp, pp_rank, v, c[0])]
    return acts, grads


def warmup_forwards(pp: int, pp_rank: int, v: int, m: int) -> int:
    """Forwards before the first backward: each stage 2 behind the one before it, plus v-1 rounds."""
    return min(v * m, (pp - pp_rank - 1) * 2 + (v - 1) * pp)


def interleaved_1f1b(stage: ChunkedStage, num_microbatches: int) -> None:
    """Warmup: forwards only. Steady: one forward, one backward, one exchange carrying both. Cooldown:
    the remaining backwards. Peak: ``warmup_forwards + 1`` chunk-microbatches live (v*M at most)."""
    pp, p, v, m = stage.pp, stage.pp_rank, stage.num_chunks, num_microbatches
    check_microbatches(pp, v, m)
    fwd, bwd, total = forward_ids(pp, v, m), backward_ids(pp, v, m), v * m
    first, last = p == 0, p == pp - 1
    warmup = warmup_forwards(pp, p, v, m)
    steady = total - warmup

    stage.exchange(recv_forward=has_prev(p, fwd[0][0]))
    for k in range(warmup):
        stage.forward_chunk(*fwd[k])
        recv_prev = k + 1 < total and has_prev(p, fwd[k + 1][0])
        # the last warmup exchange also takes the grad of the first backward
        recv_next = k == warmup - 1 and not last
        stage.exchange(send_forward=fwd[k], recv_forward=recv_prev, recv_backward=recv_next)

    for k in range(steady):
        f, b = warmup + k, k
        stage.forward_chunk(*fwd[f])
        stage.backward_chunk(*bwd[b])
        # the first rank is P-1 forwards ahead of the last: its next input is the last rank's output
        # of forward f - (P-1), which feeds the chunk after it (none after the last chunk)
        recv_prev = not (first and fwd[(f - (pp - 1)) % total][0] == v - 1)
        recv_next = not (last and bwd[(b - (pp - 1)) % total][0] == 0)  # likewise for grads
        stage.exchange(
            send_forward=fwd[f],
            send_backward=bwd[b],
            recv_forward=recv_prev and k < steady - 1,
            recv_backward=recv_next,
        )

    for k in range(steady, total):
        stage.backward_chunk(*bwd[k])
        recv_next = k + 1 < total and has_next(pp, p, v, bwd[k + 1][0])
        stage.exchange(send_backward=bwd[k], recv_backward=recv_next)


def interleaved_forward_only(stage: ChunkedStage, num_microbatches: int) -> None:
    """Evaluation: the forwards in the same order, each step's send and receive together."""
    pp, p, v, m = stage.pp, stage.pp_rank, stage.num_chunks, num_microbatches
    check_microbatches(pp, v, m)
    fwd = forward_ids(pp, v, m)
    stage.exchange(recv_forward=has_prev(p, fwd[0][0]))
    for k, ids in enumerate(fwd):
        stage.forward_chunk(*ids)
        recv_prev = k + 1 < len(fwd) and has_prev(p, fwd[k + 1][0])
        stage.exchange(send_forward=ids, recv_forward=recv_prev)
