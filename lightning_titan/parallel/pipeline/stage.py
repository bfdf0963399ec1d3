"""One rank's pipeline stage for one step: runs microbatches through the stage-local model.

Each microbatch back-propagates what the caller's ``objective`` makes of it: this rank's share of the
global loss (``train/objective.py`` normalises it), so that the reducers' average over the data ranks
is the gradient of the global mean, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from lightning_titan.parallel.batching import split_microbatches
from lightning_titan.parallel.context_parallel import take_local
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.overlap import run_pair
from lightning_titan.parallel.pipeline import backward_split, interleaved, zbv
from lightning_titan.parallel.pipeline.p2p import StageLinks
from lightning_titan.parallel.pipeline.protocols import ChunkedStage, Stage, StageModule, VStage
from lightning_titan.parallel.pipeline.schedules import (
    CHUNKED,
    V_SHAPED,
    check_placement,
    forward_only,
    get_schedule,
)
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX
from lightning_titan.runtime import probes

# (aux, logits, targets) -> (this rank's share to back-propagate, the token-loss sum or None);
# logits and targets on the stage that holds the head only (train/objective.py's Objective)
StageObjective = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor, Tensor | None]]


@dataclass
class StepSums:
    """This rank's local sums for one step; the global values need one all-reduce over the world."""

    loss_sum: Tensor  # sum of the token losses (last stage's first TP rank only, else 0)
    aux_sum: Tensor  # sum over sequences of this stage's weighted aux losses (under TP: this rank's share)
    tokens: Tensor  # targets counted in loss_sum (not IGNORE_INDEX), 0-dim; 0 where loss_sum is


class PipelineStage:
    def __init__(
        self,
        model: StageModule,
        dims: ParallelDims,
        links: StageLinks,
        inputs: Tensor,
        targets: Tensor,
        num_microbatches: int,
        objective: StageObjective,
        *,
        backward: Callable[[Tensor], None] | None = None,
        accumulate: Callable[[], AbstractContextManager[Any]] = nullcontext,
        tracer: Callable[[str, int, int], object] | None = None,
        documents: Tensor | None = None,
    ) -> None:
        local_batch = inputs.shape[0]
        self.model, self.links, self.objective = model, links, objective
        self.pp, self.pp_rank = dims.pp, dims.pp_rank
        self.num_chunks = model.num_chunks  # virtual stages on this rank
        # every TP rank computes the same loss (vocab-parallel): one of them reports it
        self.reports_loss = model.is_last_stage and dims.tp_rank == 0
        # under CP each rank computes its positions of every sequence (context_parallel)
        self.inputs = split_microbatches(take_local(inputs, model.cp_group), num_microbatches)
        self.targets = split_microbatches(take_local(targets, model.cp_group), num_microbatches)
        # packed documents' ids [b, S], whole: every chunk of every stage reads them from here (the
        # model cuts them like the tokens under CP), so nothing but activations goes between stages
        self.documents = (
            None if documents is None else split_microbatches(documents, num_microbatches)
        )
        self.num_microbatches = num_microbatches
        # the targets the loss counts, of this rank's positions (each CP rank its own)
        self.counted = torch.stack([(t != IGNORE_INDEX).sum() for t in self.targets]).sum()
        d_model = model.config.d_model
        # between stages each CP x TP rank sends its slice of the sequence
        self.shape = (
            local_batch // num_microbatches,
            inputs.shape[1] // (dims.cp * dims.tp),
            d_model,
        )
        self._backward = backward or (lambda loss: loss.backward())
        # entered around every backward but the step's last (the engine's: the reducers' no_sync)
        self._accumulate = accumulate
        self._tracer = tracer
        # (chunk, microbatch) -> (its input to get the grad of, its output to back-propagate into,
        # its objective)
        self._saved: dict[tuple[int, int], tuple[Tensor | None, Tensor | None, Tensor]] = {}
        # chunked schedules: what exchange received and what it is to send, by (kind, chunk, mb)
        self._inbox: dict[tuple[str, int, int], Tensor | None] = {}
        self._outbox: dict[tuple[str, int, int], Tensor | None] = {}
        self._streams: tuple[list, list] = ([], [])
        self._due = {"x": 0, "g": 0}  # receives an exchange asked for that no chunk has taken yet
        self._pending: dict[int, list[zbv.Message]] = {}  # zbv on CPU: the same, by peer
        self._backwards_done = 0
        # zero-bubble: (chunk, microbatch) -> its W still to run (the embedding's chunk: its whole
        # objective)
        self._deferred: dict[
            tuple[int, int], backward_split.WeightGrads | backward_split.WholeBackward | Tensor
        ] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)

    def _span(self, name: str, i: int, chunk: int = 0) -> AbstractContextManager[Any]:
        if self._tracer is not None:
            # a context manager (runtime/tracing.py), which the tracer's signature calls object
            return cast(AbstractContextManager[Any], self._tracer(name, i, chunk))
        kind = name if name in ("forward", "backward") else "p2p"
        kind = "backward" if name == "backward_weight" else kind  # zero-bubble W: compute too
        if self.model.v_shape:  # the chunk's virtual stage: the V is not chunk * P + rank
            return probes.span(kind, name, mb=i, chunk=chunk, stage=self.model.stage_ids[chunk])
        if self.num_chunks > 1:
            return probes.span(kind, name, mb=i, chunk=chunk)
        return probes.span(kind, name, mb=i)

    # compute ---------------------------------------------------------------------------------------
    def embeds(self, chunk: int) -> bool:
        return self.model.embeds(chunk)

    def heads(self, chunk: int) -> bool:
        return self.model.heads(chunk)

    def _accumulating(self) -> AbstractContextManager[Any]:
        """A backward's context: ``accumulate()``, but not the step's last (W under zero-bubble)."""
        self._backwards_done += 1
        last = self._backwards_done == self.num_microbatches * self.num_chunks
        return nullcontext() if last else self._accumulate()

    def forward(self, i: int, x: Tensor | None, chunk: int = 0) -> Tensor | None:
        with self._span("forward", i, chunk):
            grad_enabled = torch.is_grad_enabled()
            if self.embeds(chunk):
                x = self.inputs[i]
            elif x is None:
                raise ValueError(
                    f"forward of microbatch {i} (chunk {chunk}) needs the previous stage's output"
                )
            elif grad_enabled:
                x = x.requires_grad_()
            documents = None if self.documents is None else self.documents[i]
            out, aux = self.model(x, chunk=chunk, documents=documents)
            if grad_enabled:
                out = probes.fault("forward", out)
            self.aux_sum += aux.detach().sum()
            head = self.heads(chunk)
            objective, loss = self.objective(
                aux, out if head else None, self.targets[i] if head else None
            )
            if loss is not None and self.reports_loss:
                self.loss_sum += loss.detach()
            if grad_enabled:
                # the surrogate (out * grad).sum() (_take_saved) gives `out` exactly the received grad
                self._saved[chunk, i] = (
                    None if self.embeds(chunk) else x,
                    None if self.heads(chunk) else out,
                    objective,
                )
            return None if self.heads(chunk) else out

    def _take_saved(self, i: int, grad: Tensor | None, chunk: int) -> tuple[Tensor | None, Tensor]:
        """Microbatch ``i``'s saved input and its objective, into which the surrogate
        ``(out * grad).sum()`` gives ``out`` exactly the received ``grad``."""
        x, out, objective = self._saved.pop((chunk, i))
        if out is not None:
            if grad is None:
                raise ValueError(
                    f"backward of microbatch {i} (chunk {chunk}) needs the next stage's grad"
                )
            objective = objective + (out * grad.to(out.dtype)).sum()
        return x, objective

    def backward(self, i: int, grad: Tensor | None, chunk: int = 0) -> Tensor | None:
        with self._span("backward", i, chunk):
            x, objective = self._take_saved(i, grad, chunk)
            with self._accumulating():
                self._backward(probes.fault("backward", objective))
            if x is None:
                return None
            # an output that ignores x still owes the stage before a grad: it waits for one
            return torch.zeros_like(x) if x.grad is None else x.grad

    def backward_input(self, i: int, grad: Tensor | None, chunk: int = 0) -> Tensor | None:
        """B: the input grad only; the weight grads wait for ``backward_weight(i)``. B and W call
        autograd themselves, not the ``backward`` callable (Lightning's ``manual_backward``, which
        under 32-true and bf16-mixed only calls ``.backward()``); the embedding's W does use it."""
        with self._span("backward", i, chunk):
            x, objective = self._take_saved(i, grad, chunk)
            objective = probes.fault("backward", objective)
            if x is None:  # the embedding's chunk sends nothing upstream: all of it is W
                self._deferred[chunk, i] = objective
                return None
            # the chunk's own weights (the other chunk's are not on this graph: split skips them)
            params = [p for p in self.model.parameters() if p.requires_grad]
            dx, self._deferred[chunk, i] = backward_split.split(objective, x, params)
            return dx

    def backward_weight(self, i: int, chunk: int = 0) -> None:
        """W: accumulate microbatch ``i``'s weight grads (the reducers' hooks fire here)."""
        with self._span("backward_weight", i, chunk):
            deferred = self._deferred.pop((chunk, i))
            with self._accumulating():
                if isinstance(deferred, Tensor):
                    self._backward(deferred)
                else:
                    deferred.run()

    # communication ---------------------------------------------------------------------------------
    def recv_forward(self, i: int) -> Tensor | None:
        with self._span("recv_forward", i):
            return self.links.recv_forward()

    def send_forward(self, i: int, y: Tensor | None) -> None:
        with self._span("send_forward", i):
            self.links.send_forward(y)

    def recv_backward(self, i: int) -> Tensor | None:
        with self._span("recv_backward", i):
            return self.links.recv_backward()

    def send_backward(self, i: int, dx: Tensor | None) -> None:
        with self._span("send_backward", i):
            self.links.send_backward(dx)

    def send_forward_recv_backward(self, i: int, y: Tensor | None, j: int) -> Tensor | None:
        with self._span("send_forward_recv_backward", i):
            return self.links.send_forward_recv_backward(y)

    def send_backward_recv_forward(self, j: int, dx: Tensor | None, i: int) -> Tensor | None:
        with self._span("send_backward_recv_forward", j):
            return self.links.send_backward_recv_forward(dx)

    # chunked schedules (interleaved.py): inputs and outputs by (chunk, microbatch) -----------------
    def forward_chunk(self, chunk: int, i: int) -> None:
        x = None if self.embeds(chunk) else self._received("x", chunk, i)
        self._sent("y", chunk, i, self.forward(i, x, chunk))

    def backward_chunk(self, chunk: int, i: int) -> None:
        grad = None if self.heads(chunk) else self._received("g", chunk, i)
        self._sent("dx", chunk, i, self.backward(i, grad, chunk))

    def _sent(self, kind: str, chunk: int, i: int, out: Tensor | None) -> None:
        """A chunk's output ("y") or input grad ("dx"): under interleaved 1F1B on CPU sent at once
        (``exchange``'s doc), else kept for the exchange that sends it."""
        if not self.links.early or self.model.v_shape:
            self._outbox[kind, chunk, i] = out
            return
        if out is None:  # the head's output, the embedding's input grad: nothing to send
            return
        with self._span("exchange", i, chunk):
            self.links.exchange(out if kind == "y" else None, out if kind == "dx" else None)

    def _received(self, kind: str, chunk: int, i: int) -> Tensor | None:
        """The input ``(kind, chunk, i)``, taking due messages of its stream until it is in."""
        msg = ("act" if kind == "x" else "grad", chunk, i)
        for peer, due in self._pending.items():  # zbv on CPU: its peer's due messages up to it
            if msg in due:
                self._receive([(peer, m) for m in due[: due.index(msg) + 1]], [], [], msg)
                del due[: due.index(msg) + 1]
        while (kind, chunk, i) not in self._inbox and self._due[kind]:
            self._take(kind)
        return self._inbox.pop((kind, chunk, i))

    def _take(self, kind: str) -> None:
        """Wait for the next message of stream ``kind`` ("x": activations, "g": grads) and file it."""
        self._due[kind] -= 1
        chunk, i = self._streams[kind == "g"][0]
        with self._span("exchange", i, chunk):
            received = self.links.recv_forward() if kind == "x" else self.links.recv_backward()
        self._file(kind, received)

    def _file(self, kind: str, received: Tensor | None) -> None:
        """File the next message of stream ``kind`` under the (chunk, microbatch) the stream says it
        is (``interleaved.stream_ids``)."""
        chunk, i = self._streams[kind == "g"].pop(0)
        self._inbox[kind, chunk, i] = received

    def exchange(
        self,
        send_forward: tuple[int, int] | None = None,
        send_backward: tuple[int, int] | None = None,
        recv_forward: bool = False,
        recv_backward: bool = False,
    ) -> None:
        """One batch of sends and receives; a received tensor is filed under the (chunk, microbatch)
        its stream says comes next (``interleaved.stream_ids``). On CPU the outputs went out when
        made and a receive marked due here is waited for when a chunk needs it (``interleaved``'s
        module doc says why that deadlocks no more than the schedule's order)."""
        if self.links.early:
            self._due["x"] += recv_forward
            self._due["g"] += recv_backward
            return
        y = None if send_forward is None else self._outbox.pop(("y", *send_forward))
        dx = None if send_backward is None else self._outbox.pop(("dx", *send_backward))
        with self._span("exchange", (send_forward or send_backward or (0, 0))[1]):
            x, g = self.links.exchange(y, dx, recv_forward, recv_backward)
        if recv_forward:
            self._file("x", x)
        if recv_backward:
            self._file("g", g)

    # zbv (zbv.py): the V's two chunks, B and W apart; inputs and outputs by (chunk, microbatch) ------
    def backward_input_chunk(self, chunk: int, i: int) -> None:
        grad = None if self.heads(chunk) else self._received("g", chunk, i)
        self._outbox["dx", chunk, i] = self.backward_input(i, grad, chunk)

    def backward_weight_chunk(self, chunk: int, i: int) -> None:
        self.backward_weight(i, chunk)

    def overlap_chunks(self, f: tuple[int, int], b: tuple[int, int]) -> None:
        """DualPipeV's pair: chunk ``f[0]``'s forward of microbatch ``f[1]`` with chunk ``b[0]``'s
        whole backward of ``b[1]``, overlapped (``parallel/overlap.py``); inputs taken first."""
        (cf, i), (cb, j) = f, b
        x = None if self.embeds(cf) else self._received("x", cf, i)
        g = None if self.heads(cb) else self._received("g", cb, j)
        y, dx = run_pair(lambda: self.forward(i, x, cf), lambda: self.backward(j, g, cb))
        self._sent("y", cf, i, y)
        self._sent("dx", cb, j, dx)

    def forward_backward(
        self, i: int, x: Tensor | None, j: int, grad: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Microbatch ``i``'s forward with ``j``'s backward, overlapped (``parallel/overlap.py``)."""
        return run_pair(lambda: self.forward(i, x), lambda: self.backward(j, grad))

    def exchange_messages(self, done: zbv.Step | None, take: list[tuple[int, zbv.Message]]) -> None:
        """Send the outputs of tick ``done`` where ``zbv.output`` says and receive ``take`` (each
        (peer pp rank, message) the next of its peer's stream) in one batch (``zbv._run``); on CPU a
        message is taken when an action needs it (``_received``), as in ``exchange``. The turn of
        the V stays on the last rank: chunk 0's output is chunk 1's input, and back for the grads."""
        to_next: list[Tensor] = []
        to_prev: list[Tensor] = []
        for kind, chunk, i in done or ():
            if kind == "W":
                continue
            out = self._outbox.pop(("y" if kind == "F" else "dx", chunk, i))
            target = zbv.output(self.pp, self.pp_rank, (kind, chunk, i))
            if target is not None and out is not None:
                # a link's streams go by direction: its forward one to the next rank
                (to_next if target[0] == self.pp_rank + 1 else to_prev).append(out)
            elif out is not None:
                # the turn, detached as a p2p leaves it: chunk 1's split walks its own graph only
                self._inbox[("x", 1, i) if kind == "F" else ("g", 0, i)] = out.detach()
        if self.links.early:
            for peer, msg in take:
                self._pending.setdefault(peer, []).append(msg)
            take = []
        if to_next or to_prev or take:
            at = done[0] if done else take[0][1]
            self._receive(take, to_next, to_prev, at)

    def _receive(self, take: list, to_next: list, to_prev: list, at: tuple) -> None:
        """One exchange: send ``to_next`` / ``to_prev``, receive ``take``, file each under its input."""
        from_prev = [msg for peer, msg in take if peer == self.pp_rank - 1]
        from_next = [msg for peer, msg in take if peer != self.pp_rank - 1]
        with self._span("exchange", at[2], at[1]):
            xs, gs = self.links.exchange_many(to_next, to_prev, len(from_prev), len(from_next))
        for (what, chunk, i), received in zip(from_prev + from_next, xs + gs, strict=True):
            self._inbox["x" if what == "act" else "g", chunk, i] = received

    def _start_v(self, schedule: str | None) -> Callable[[Any, int], None]:
        m, p, name = self.num_microbatches, self.pp_rank, schedule or "zbv"
        from_prev = zbv.stream(self.pp, p - 1, p, m, schedule is not None, name)
        from_next = zbv.stream(self.pp, p + 1, p, m, schedule is not None, name)
        self.links.start(self.shape, forward=len(from_prev), backward=len(from_next))
        return zbv.zbv_forward_only if schedule is None else V_SHAPED[schedule]

    # driving ---------------------------------------------------------------------------------------
    def run(self, schedule: str | None) -> StepSums:
        """Run a training schedule by name, or forward only when ``schedule`` is None."""
        m = self.num_microbatches
        check_placement(schedule, self.num_chunks, self.model.v_shape)
        if self.model.v_shape:
            run = self._start_v(schedule)
        elif self.num_chunks > 1:
            acts, grads = interleaved.stream_ids(self.pp, self.pp_rank, self.num_chunks, m)
            self._streams = (acts, [] if schedule is None else grads)
            self.links.start(self.shape, forward=len(acts), backward=len(self._streams[1]))
            run = interleaved.interleaved_forward_only if schedule is None else CHUNKED[schedule]
        else:
            self.links.start(self.shape, forward=m, backward=0 if schedule is None else m)
            run = forward_only if schedule is None else get_schedule(schedule)
        run(self, m)
        if any(self._due.values()) or any(self._pending.values()):  # a next step's message
            raise RuntimeError(
                f"schedule {schedule!r} marked receives due that no chunk took: "
                f"{self._due}, {self._pending}"
            )
        with self._span("wait_sends", m - 1):
            self.links.finish()
        if (self._saved or self._deferred) and schedule is not None:
            left = sorted(self._saved) + sorted(self._deferred)
            raise RuntimeError(f"schedule {schedule!r} left microbatches {left} without backward")
        tokens = self.counted if self.reports_loss else torch.zeros_like(self.counted)
        return StepSums(self.loss_sum, self.aux_sum, tokens)


def _serves_every_schedule(stage: PipelineStage) -> tuple[Stage, ChunkedStage, VStage]:
    """Never called: mypy checks here that PipelineStage satisfies each schedule's protocol."""
    return stage, stage, stage
