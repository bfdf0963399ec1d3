"""A stage's backward in two parts: the input grad (B, on the pipeline's critical path) now, the
weight grads (W, local work that can fill a bubble) later. Zero-bubble schedules need the split.

B runs autograd from the objective to the stage input ``x`` only (``torch.autograd.grad``: a matmul
node then computes its input's grad, not its weight's) and, on the way, keeps the grads that arrive
at each node on x's path with an edge towards a weight (its *intermediates*: a Linear's matmul, a
norm's multiply, the experts' grouped matmul).

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

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

FLUSH_BYTES = 1 << 20  # weight grads held before they are accumulated (``WeightGrads._accumulate``)


def _node(t: Tensor) -> Node | None:
    """The autograd node that receives ``t``'s grad (its accumulate node for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return torch.autograd.graph.get_gradient_edge(t).node if t.requires_grad else None


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``root``: node -> the nodes that take its output."""
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                users[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    return users


def _up(starts: list[Node], users: dict[Node, list[Node]], stop: set[Node]) -> tuple[set, set]:
    """Nodes reachable from ``starts`` towards the root, not passing ``stop``; and the ``stop`` ones met."""
    seen, met, stack = set(starts), set(), list(starts)
    while stack:
        for user in users.get(stack.pop(), []):
            if user in stop:
                met.add(user)
            elif user not in seen:
                seen.add(user)
                stack.append(user)
    return seen, met


def _as_received(grad: Tensor, edge: GradientEdge) -> Tensor:
    """What the engine makes of a node's output before passing it along an edge (its
    ``validate_outputs``): summed down to a broadcast input's shape, cast to its dtype. A norm's
    weight, broadcast over the tokens, gets its multiply's token-shaped grad summed here."""
    meta = edge.node._input_metadata[edge.output_nr]
    if grad.shape != meta.shape:
        grad = grad.sum_to_size(meta.shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


class _CallIntermediates(torch.autograd.Function):
    """The one-node graph of W's first call: its backward calls the intermediates (module doc)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, weights: WeightGrads) -> Tensor:
        ctx.weights = weights
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        ctx.weights.call_intermediates()
        return grad, None


@dataclass
class WeightGrads:
    """The W part of one microbatch's backward, ready to run once."""

    # each intermediate, the indices of its weight-side outputs and their edges
    intermediates: dict[Node, list[tuple[int, GradientEdge]]]
    kept: dict[Node, tuple]  # the grads B left at each intermediate
    weights: list[nn.Parameter]

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
                    grads.append(_as_received(result[k], edge))
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
            torch.autograd.backward(edges, grads, inputs=self.weights)
        edges.clear()
        grads.clear()

    def run(self) -> None:
        edges = [e for outputs in self.intermediates.values() for _, e in outputs]
        anchor = torch.zeros((), requires_grad=True)
        inputs = [torch.autograd.graph.get_gradient_edge(anchor), *edges]
        torch.autograd.backward([_CallIntermediates.apply(anchor, self)], inputs=inputs)
        self.intermediates, self.kept = {}, {}


def split(objective: Tensor, x: Tensor, params: list[nn.Parameter]) -> tuple[Tensor, WeightGrads]:
    """B: ``(d objective / d x, the W still to run)``; ``x`` is the stage input (requires grad)."""
    root, x_node = objective.grad_fn, _node(x)
    users = _consumers(root)
    on_x_path, _ = _up([x_node], users, set())
    weights = {n: p for p in params if p.requires_grad and (n := _node(p)) in users}
    # the weight side: every node between the weights and x's path; the intermediates: where they meet
    weight_side, met = _up(list(weights), users, on_x_path)
    intermediates: dict[Node, list[tuple[int, GradientEdge]]] = {}
    # latest first, as one backward meets them: the reducers' buckets fill in their usual order
    for node in sorted(met, key=lambda n: -n._sequence_nr()):
        if isinstance(node, BackwardCFunction):  # its backward would run whole, collectives and all
            raise RuntimeError(
                f"the backward split cannot defer the weight grads of {type(node).__name__}: a custom "
                "autograd Function that takes a weight computes all of its grads at once; give it "
                "the activation only and use the weight outside it, or use a schedule without the "
                "split (1f1b, interleaved_1f1b)"
            )
        intermediates[node] = [
            (k, GradientEdge(nxt, nr))
            for k, (nxt, nr) in enumerate(node.next_functions)
            if nxt in weight_side
        ]
    kept: dict[Node, tuple] = {}

    def keep(node: Node):
        def hook(grad_outputs: tuple) -> None:
            kept[node] = grad_outputs

        return hook

    handles = [n.register_prehook(keep(n)) for n in intermediates]
    try:
        (dx,) = torch.autograd.grad(objective, [x], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, WeightGrads(intermediates, kept, list(weights.values()))
