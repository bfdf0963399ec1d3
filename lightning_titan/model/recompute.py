"""Selective recompute (``activation_checkpointing="selective"``): the blocks' RMSNorms and the
experts' gated activations are run again in the backward instead of kept, as Megatron's
``--recompute-granularity selective --recompute-modules layernorm moe_act`` does.

``run(fn, *inputs, recompute=True)`` computes ``fn(*inputs)`` inside an autograd Function that runs it
without grad: autograd keeps the inputs (which the caller keeps anyway: the residual stream, the
gate and up projections), none of ``fn``'s intermediates. Its output is still saved by the op that
reads it (the q/k/v projections, the router, the down projection): ``discard_after(consumer_out)``,
called once that consumer has run, frees the output's storage (``untyped_storage().resize_(0)``;
the tensor objects and the consumer's saved reference to it stay) and registers a hook on the
consumer's output. In the backward the consumer's output gets its grad before any node that reads
the discarded tensor runs, so the hook recomputes ``fn`` there, with grad and under the forward's
autocast, writes the values back into the same storage, and leaves the recomputed graph for the
Function's backward, which takes the input grads from it: one recompute, the consumer's backward
reading exactly the numbers of the forward. ``then(g)`` adds a step with weights, ``g(output)``,
run under autograd as usual (so its weights keep their own edges in the graph, which the zero-bubble
split (``parallel/pipeline/backward_split.py``) defers like any other weight), whose output is
discarded and rewritten too (the norm's ``weight * normalized``, cast to the compute dtype: the
tensor the projections save, so the discarded storage is the one they hold under bf16 autocast).

``recompute=False``: ``fn`` runs under autograd as usual and ``discard_after`` does nothing. Only
``fn`` without weights and without randomness goes into ``run`` (it is called twice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_titan.runtime.saved_tensors import storage_resized

Fn = Callable[..., Tensor]


class _WithoutGrad(torch.autograd.Function):
    """``fn(*inputs)`` computed without grad, the inputs saved; the backward differentiates the
    recompute the hook left in ``ctx.recomputed`` (or recomputes here, if no hook ran)."""

    @staticmethod
    def forward(ctx: Any, run: Recomputed, *inputs: Tensor) -> Tensor:
        with torch.no_grad():
            out = run.fn(*inputs)
        ctx.save_for_backward(*inputs)
        ctx.fn, ctx.autocast, ctx.recomputed = run.fn, run.autocast, None
        run.ctx = ctx  # the run holds the node, not the other way round: no cycle through the graph
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inputs, out = ctx.recomputed or _recompute(ctx.fn, ctx.autocast, ctx.saved_tensors)
        ctx.recomputed = None
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, *(next(grads) if x.requires_grad else None for x in inputs))


def _recompute(
    fn: Fn, autocast: tuple[str, bool, torch.dtype], saved: tuple[Tensor, ...]
) -> tuple[list[Tensor], Tensor]:
    """``fn`` again on detached copies of its inputs, with grad and the forward's autocast."""
    device, enabled, dtype = autocast
    inputs = [x.detach().requires_grad_(x.requires_grad) for x in saved]
    with torch.enable_grad(), torch.autocast(device, dtype, enabled=enabled):
        return inputs, fn(*inputs)


def _write(dst: Tensor, nbytes: int, src: Tensor) -> None:
    """Give ``dst``'s freed storage its ``nbytes`` back and ``src``'s values, through an alias of
    its own: autograd's saved copies of ``dst`` check its version counter, which must not move."""
    storage = dst.untyped_storage()
    storage.resize_(nbytes)
    with torch.no_grad():
        alias = src.new_empty(0).set_(storage, dst.storage_offset(), dst.shape, dst.stride())
        alias.copy_(src)


class Recomputed:
    """``fn(*inputs)`` whose output (``output``) and derived outputs (``then``) autograd does not keep
    once ``discard_after`` ran (module doc)."""

    def __init__(self, fn: Fn, *inputs: Tensor) -> None:
        self.fn = fn
        device = inputs[0].device.type
        self.autocast = (
            device,
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
        )
        self.ctx: Any = None
        self.output: Tensor = _WithoutGrad.apply(self, *inputs)
        # no input wants a grad (a frozen embedding's output under LoRA): autograd records no node
        # and keeps nothing, yet the output is refilled for a consumer whose adapters train
        self._inputs = None if any(x.requires_grad for x in inputs) else inputs
        self._derived: list[tuple[Tensor, Callable[[Tensor], Tensor]]] = []
        self._freed: list[tuple[Tensor, int]] = []

    def then(self, g: Callable[[Tensor], Tensor]) -> Tensor:
        """``g(output)`` under autograd, discarded with the output and rewritten from it."""
        out = g(self.output)
        self._derived.append((out, g))
        return out

    def discard_after(self, consumer_out: Tensor) -> Tensor:
        """Free the outputs' storage now that ``consumer_out``'s op saved them; they come back when
        ``consumer_out``'s grad does. Returns ``consumer_out``. Nothing is freed where no grad
        will come (no backward reads them then)."""
        if not consumer_out.requires_grad:
            return consumer_out
        seen = set()
        for t in [self.output, *(t for t, _ in self._derived)]:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self._freed.append((t, storage.nbytes()))
                storage.resize_(0)
        storage_resized()  # the saved-tensor meters read their sizes again
        consumer_out.register_hook(self._restore)
        return consumer_out

    def _restore(self, grad: Tensor) -> None:
        ctx = self.ctx
        if ctx is None:  # restored already (a second backward through a retained graph)
            return
        saved = ctx.saved_tensors if self._inputs is None else self._inputs
        inputs, out = _recompute(self.fn, self.autocast, saved)
        ctx.recomputed = inputs, out
        sizes = {id(t): n for t, n in self._freed}
        if id(self.output) in sizes:
            _write(self.output, sizes[id(self.output)], out.detach())
        device, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device, dtype, enabled=enabled):
            for t, g in self._derived:
                if id(t) in sizes:
                    _write(t, sizes[id(t)], g(self.output))
        storage_resized()
        self.ctx, self._inputs, self._derived, self._freed = None, None, [], []


class Kept:
    """``fn(*inputs)`` under autograd as usual: ``recompute=False``'s side of ``run``."""

    def __init__(self, fn: Fn, *inputs: Tensor) -> None:
        self.output = fn(*inputs)

    def then(self, g: Callable[[Tensor], Tensor]) -> Tensor:
        return g(self.output)

    def discard_after(self, consumer_out: Tensor) -> Tensor:
        return consumer_out


def run(fn: Fn, *inputs: Tensor, recompute: bool) -> Recomputed | Kept:
    """``fn(*inputs)``, recomputed in the backward where ``recompute`` and grad is on (module doc)."""
    if recompute and torch.is_grad_enabled():
        return Recomputed(fn, *inputs)
    return Kept(fn, *inputs)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the matmuls on ``x`` run in: autocast's where it is on, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def selective_block(
    block: Any,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    key_starts: tuple[int, ...] | None,
    cache: Any,
) -> tuple[Tensor, Tensor]:
    """``Block.forward`` (``model/decoder.py``) with each norm's output discarded once the sublayer
    that reads it (the attention; the MoE layer or the dense MLP) has run, and recomputed when that
    sublayer's output grad arrives."""
    normed, h = block.attn_norm.recomputed(x)
    x = x + normed.discard_after(block.attn(h, cos, sin, mask, key_starts, cache))
    normed, h = block.moe_norm.recomputed(x)
    if block.moe is None:  # a dense layer: no aux loss
        out, aux = block.mlp(h), torch.zeros(x.shape[0], device=x.device, dtype=torch.float32)
    else:
        out, aux = block.moe(h, block.shared_expert)
    return x + normed.discard_after(out), aux
