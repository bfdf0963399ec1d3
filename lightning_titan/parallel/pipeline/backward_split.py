"""A stage's backward in two parts: the input grad (B, on the pipeline's critical path) now, the
weight grads (W, local work that can fill a bubble) later. Zero-bubble schedules need the split.

B runs autograd from the objective to the stage input ``x`` only (``torch.autograd.grad``: a matmul
node then computes its input's grad, not its weight's) and, on the way, keeps the grads that arrive
at each node on x's path with an edge towards a weight (its *intermediates*: a Linear's matmul, a
norm's multiply, the experts' grouped matmul). One Python walk of the graph finds them; the engine
keeps their grads (each is one more of ``grad``'s ``inputs``, as a ``GradientEdge``: the engine
captures a grad there and still runs the node), which cost nothing measurable where a Python hook per
node cost about 1 ms per microbatch on a 4-layer stage at d_model 64.

W is two autograd calls, whatever the number of weights:

1. Every intermediate is called directly on its kept grads, from inside the backward of a one-node
   graph whose ``inputs`` are the intermediates' weight-side edges. A node computes only the outputs
   the running graph task needs (``task_should_compute_output``), so each intermediate computes its
   weight-side grads and not, again, its input's: B did that.
2. One backward from those weight-side edges with those grads to the weights: the graph between an
   intermediate and its weights (a transpose, a view) runs, and the grads accumulate into ``.grad``
   through the usual accumulate nodes, so the reducers' post-accumulate hooks see every weight grad
   exactly once, as with one backward. Edges into one node (a weight used twice) are summed there.

Each call walks only its own small graph. Running W instead as one autograd call per weight group
from the intermediates walked the whole graph below each group every time (x's path down to the
stage input): 42 calls costing 0.05-0.35 ms each on this project's 4-layer stage at d_model 64, most
of a backward. Under activation checkpointing W unpacks saved tensors again, which recomputes the
block's forward a second time (correct, one more forward per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward

AccumulateGrad = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]  # a leaf's node
FLUSH_BYTES = 1 << 20  # weight grads held before they are accumulated (``WeightGrads._accumulate``)


def _node(t: Tensor) -> Node | None:
    """The autograd node that receives ``t``'s grad (its accumulate node for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return torch.autograd.graph.get_gradient_edge(t).node if t.requires_grad else None


# a node's role (``_roles``), ordered: a node takes its highest child's
OFF, WEIGHT_SIDE, X_PATH = 0, 1, 2


def _roles(
    root: Node, x_node: Node | None, weight_ids: set[int]
) -> tuple[dict, dict[Node, Tensor]]:
    """One walk of the graph below ``root``: the intermediates (a node on x's path, that is one that
    reaches ``x_node``, with edges into the weight side: their indices and the edges) and the weights'
    accumulate nodes met, each with its weight. A node off x's path that reaches a weight is on the
    weight side. Post-order, so a node's children are decided before it (the graph is acyclic).
    Plain loops: this runs on every microbatch, and generator expressions made it 4x slower."""
    role: dict[Node, int] = {}
    children: dict[Node, tuple] = {}
    stack = [root]
    while stack:
        node = stack[-1]
        kids = children.get(node)
        if kids is None:  # first visit: children first
            kids = children[node] = node.next_functions
            waiting = False
            for kid, _ in kids:
                if kid is not None and kid not in children:
                    stack.append(kid)
                    waiting = True
            if waiting:
                continue
        stack.pop()
        if node in role:  # pushed by two parents
            continue
        r = OFF
        if node is x_node:
            r = X_PATH
        elif not kids:
            if isinstance(node, AccumulateGrad) and id(node.variable) in weight_ids:
                r = WEIGHT_SIDE
        else:
            for kid, _ in kids:
                if kid is not None and role[kid] > r:
                    r = role[kid]
        role[node] = r
    intermediates = {}
    for node, r in role.items():
        if r == X_PATH:
            edges = [
                (k, GradientEdge(kid, nr))
                for k, (kid, nr) in enumerate(children[node])
                if kid is not None and role[kid] == WEIGHT_SIDE
            ]
            if edges:
                intermediates[node] = edges
    weights = {
        n: n.variable  # type: ignore[attr-defined]  # an accumulate node's leaf
        for n, r in role.items()
        if r == WEIGHT_SIDE and not children[n]
    }
    return intermediates, weights


class _CallIntermediates(torch.autograd.Function):
    """The one-node graph of W's first call: its backward calls the intermediates (module doc)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, weights: WeightGrads) -> Tensor:
        ctx.weights = weights
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.weights.call_intermediates()
        return grad, None


@dataclass
class WeightGrads:
    """The W part of one microbatch's backward, ready to run once."""

    # each intermediate, the indices of its weight-side outputs and their edges
    intermediates: dict[Node, list[tuple[int, GradientEdge]]]
    kept: dict[Node, tuple]  # the grads B left at each intermediate
    weights: list[Tensor]

    def call_intermediates(self) -> None:
        edges: list[GradientEdge] = []
        grads: list[Tensor] = []
        held = 0  # bytes in grads
        for node, outputs in self.intermediates.items():
            kept = self.kept.get(node)
            if kept is None or all(g is None for g in kept):  # no grad reached it in B
                continue
            result = node(*kept)  # type: ignore[operator]  # a node runs its backward formula
            result = result if isinstance(result, tuple) else (result,)
            for k, edge in outputs:
                if result[k] is not None:
                    edges.append(edge)
                    grads.append(result[k])
                    held += grads[-1].nbytes
            if held >= FLUSH_BYTES:
                self._accumulate(edges, grads)
                held = 0
        self._accumulate(edges, grads)

    def _accumulate(self, edges: list[GradientEdge], grads: list[Tensor]) -> None:
        """The second call (module doc), for the grads computed so far: they go into ``.grad`` before
        the next intermediates allocate theirs, so the allocator hands the same memory out again
        (holding all of a stage's weight grads at once page-faulted about 45 MB per microbatch at
        d_model 256)."""
        if edges:
            # the engine's own entry, not ``torch.autograd.backward``: that one's Python checks each
            # edge's shape (and would refuse a broadcast weight's token-shaped grad), where the
            # engine sums such a grad down to the edge's shape and casts it, as it does between
            # nodes; about 0.5 ms per microbatch less on a 4-layer stage at d_model 64
            _engine_run_backward(
                tuple(edges), tuple(grads), False, False, tuple(self.weights), True, True
            )
        edges.clear()
        grads.clear()

    def run(self) -> None:
        edges = [e for outputs in self.intermediates.values() for _, e in outputs]
        anchor = torch.zeros((), requires_grad=True)
        inputs = [torch.autograd.graph.get_gradient_edge(anchor), *edges]
        torch.autograd.backward([_CallIntermediates.apply(anchor, self)], inputs=inputs)
        self.intermediates, self.kept = {}, {}


@dataclass
class WholeBackward:
    """The W of an objective that does not depend on x: its whole backward, into the weights only."""

    objective: Tensor
    weights: list[Tensor]

    def run(self) -> None:
        if self.weights:
            torch.autograd.backward(self.objective, inputs=self.weights)


def split(
    objective: Tensor, x: Tensor, params: list[nn.Parameter]
) -> tuple[Tensor, WeightGrads | WholeBackward]:
    """B: ``(d objective / d x, the W still to run)``; ``x`` is the stage input (requires grad)."""
    if objective.grad_fn is None:
        raise ValueError(
            "the backward split needs an objective computed with grad (it has no grad_fn)"
        )
    found, weights = _roles(objective.grad_fn, _node(x), {id(p) for p in params if p.requires_grad})
    intermediates: dict[Node, list[tuple[int, GradientEdge]]] = {}
    # latest first, as one backward meets them: the reducers' buckets fill in their usual order
    for node in sorted(found, key=lambda n: -n._sequence_nr()):
        if isinstance(node, BackwardCFunction):  # its backward would run whole, collectives and all
            raise RuntimeError(
                f"the backward split cannot defer the weight grads of {type(node).__name__}: a custom "
                "autograd Function that takes a weight computes all of its grads at once; give it "
                "the activation only and use the weight outside it, or use a schedule without the "
                "split (1f1b, interleaved_1f1b)"
            )
        intermediates[node] = found[node]
    # the grads arriving at each intermediate, captured by the engine on the way to x (a capture
    # does not stop the node from running): cheaper than a Python hook per node
    arity = {node: len(node._input_metadata) for node in intermediates}
    edges = [GradientEdge(node, i) for node, n in arity.items() for i in range(n)]
    inputs = [x, *edges]  # a tensor and edges: the engine takes both, the stub either
    dx, *grads = torch.autograd.grad(objective, inputs, retain_graph=True, allow_unused=True)  # type: ignore[arg-type]
    captured = iter(grads)
    kept = {node: tuple(next(captured) for _ in range(n)) for node, n in arity.items()}
    if dx is None:  # the objective ignores x: no node is on x's path, so all of the backward is W
        # and x's grad is zero (the stage before still waits for one)
        return torch.zeros_like(x), WholeBackward(objective, list(weights.values()))
    return dx, WeightGrads(intermediates, kept, list(weights.values()))
