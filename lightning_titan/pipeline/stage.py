"""One rank's pipeline stage for one step: runs microbatches through the stage-local model.

The objective each rank back-propagates is its share of the global one:

    loss_fn sums over local tokens / local_tokens + sum over sequences of aux / local_sequences

so that averaging grads over the data ranks (the reducers) gives the gradient of the global mean loss,
whatever the layout (DESIGN.md invariant 3). ``loss_fn(logits_MSV, targets_MS)`` is the caller's
(TitanLM's): the sum of the token losses of one microbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_titan import probes
from lightning_titan.batching import split_microbatches
from lightning_titan.context_parallel import take_local
from lightning_titan.model import StageModel
from lightning_titan.parallel_dims import ParallelDims
from lightning_titan.pipeline.p2p import StageLinks
from lightning_titan.pipeline.schedules import forward_only, get_schedule

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class StepSums:
    """This rank's local sums for one step; the global values need one all-reduce over the world."""

    loss_sum: Tensor  # sum of the token losses (last stage's first TP rank only, else 0)
    aux_sum: Tensor  # sum over sequences of this stage's weighted aux losses (under TP: this rank's share)
    tokens: int  # tokens this rank's pipeline saw (counted where loss_sum is, else 0)


class PipelineStage:
    def __init__(
        self,
        model: StageModel,
        dims: ParallelDims,
        links: StageLinks,
        inputs: Tensor,
        targets: Tensor,
        num_microbatches: int,
        loss_fn: LossFn,
        *,
        backward: Callable[[Tensor], None] | None = None,
        on_last_backward: Callable[[], None] | None = None,
        tracer: Callable[[str, int], object] | None = None,
    ) -> None:
        local_batch = inputs.shape[0]
        self.model, self.links, self.loss_fn = model, links, loss_fn
        self.pp, self.pp_rank = dims.pp, dims.pp_rank
        self.is_first, self.is_last = dims.is_first_stage, dims.is_last_stage
        # every TP rank computes the same loss (vocab-parallel): one of them reports it
        self.reports_loss = self.is_last and dims.tp_rank == 0
        self.cp = dims.cp
        # under CP each rank computes its positions of every sequence (context_parallel)
        self.inputs = split_microbatches(take_local(inputs, model.cp_group), num_microbatches)
        self.targets = split_microbatches(take_local(targets, model.cp_group), num_microbatches)
        self.num_microbatches = num_microbatches
        self.local_sequences = local_batch
        self.local_tokens = inputs.numel()
        d_model = model.config.d_model
        # between stages each CP x TP rank sends its slice of the sequence
        self.shape = (
            local_batch // num_microbatches,
            inputs.shape[1] // (dims.cp * dims.tp),
            d_model,
        )
        self._backward = backward or (lambda loss: loss.backward())
        self._on_last_backward = on_last_backward
        self._tracer = tracer
        # microbatch -> (its input to get the grad of, its output to back-propagate into, its objective)
        self._saved: dict[int, tuple[Tensor | None, Tensor | None, Tensor]] = {}
        self._backwards_done = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)

    def _span(self, name: str, i: int):
        if self._tracer is not None:
            return self._tracer(name, i)
        return probes.span(name if name in ("forward", "backward") else "p2p", name, mb=i)

    # compute ---------------------------------------------------------------------------------------
    def forward(self, i: int, x: Tensor | None) -> Tensor | None:
        with self._span("forward", i):
            grad_enabled = torch.is_grad_enabled()
            if self.is_first:
                x = self.inputs[i]
            elif grad_enabled:
                x = x.requires_grad_()
            out, aux = self.model(x)
            if grad_enabled:
                out = probes.fault("forward", out)
            self.aux_sum += aux.detach().sum()
            objective = aux.sum() / self.local_sequences
            if self.is_last:
                loss = self.loss_fn(out, self.targets[i])
                if self.reports_loss:
                    self.loss_sum += loss.detach()
                objective = objective + loss / self.local_tokens
            if grad_enabled:
                # the surrogate (out * grad).sum() below gives `out` exactly the received grad
                self._saved[i] = (
                    None if self.is_first else x,
                    out if not self.is_last else None,
                    objective,
                )
            return None if self.is_last else out

    def backward(self, i: int, grad: Tensor | None) -> Tensor | None:
        with self._span("backward", i):
            x, out, objective = self._saved.pop(i)
            if out is not None:
                objective = objective + (out * grad.to(out.dtype)).sum()
            self._backwards_done += 1
            if self._backwards_done == self.num_microbatches and self._on_last_backward is not None:
                self._on_last_backward()
            self._backward(probes.fault("backward", objective))
            return None if x is None else x.grad

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

    # driving ---------------------------------------------------------------------------------------
    def run(self, schedule: str | None) -> StepSums:
        """Run a training schedule by name, or forward only when ``schedule`` is None."""
        m = self.num_microbatches
        self.links.start(self.shape, forward=m, backward=0 if schedule is None else m)
        (forward_only if schedule is None else get_schedule(schedule))(self, m)
        with self._span("wait_sends", m - 1):
            self.links.finish()
        if self._saved and schedule is not None:
            raise RuntimeError(
                f"schedule {schedule!r} left microbatches {sorted(self._saved)} without backward"
            )
        tokens = self.local_tokens // self.cp if self.reports_loss else 0  # each CP rank its own
        return StepSums(self.loss_sum, self.aux_sum, tokens)
