"""A stage's backward in two parts: the input grad (B, on the pipeline's critical path) now, the
weight grads (W, local work that can fill a bubble) later. Zero-bubble schedules need the split.

B runs autograd from the objective to the stage input ``x`` only (``torch.autograd.grad``: a matmul
node then computes its input's grad, not its weight's) and, on the way, keeps the grads that arrive
at each node on x's path with an edge towards a weight (its *intermediates*: a Linear's matmul, a
norm's multiply, the experts' grouped matmul). W starts from those nodes with the kept grads and
runs autograd to the weights only, accumulating into ``.grad`` through the usual accumulate nodes,
so the reducers' post-accumulate hooks see every weight grad exactly once, as with one backward.

Nodes are grouped so that W never walks back along x's path: a group is the intermediates that
share weights, and each group's autograd call asks for its own weights only. A weight whose grad
reaches the objective without passing x's path (none in this model) would be missed; ``split`` then
raises instead. Under activation checkpointing W unpacks saved tensors again, which recomputes the
block's forward a second time (correct, one more forward per block).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node


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


@dataclass
class _Group:
    params: set[Node]
    intermediates: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)


def _replace_with(kept: tuple | None):
    def hook(grad_outputs: tuple) -> tuple | None:
        return kept

    return hook


@dataclass
class WeightGrads:
    """The W part of one microbatch's backward, ready to run once."""

    groups: list[_Group]
    weights: dict[Node, nn.Parameter]

    def run(self) -> None:
        for group in self.groups:
            edges, grads = [], []
            for node in group.intermediates:
                for i, g in enumerate(group.grads.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            # the kept grads replace what reaches an intermediate through another one (no double count)
            handles = [
                n.register_prehook(_replace_with(group.grads.get(n)))
                for n in group.intermediates
                if len(group.intermediates) > 1
            ]
            try:
                if edges:
                    inputs = [self.weights[p] for p in group.params]
                    torch.autograd.backward(edges, grads, inputs=inputs)
            finally:
                for h in handles:
                    h.remove()
        self.groups = []


def split(objective: Tensor, x: Tensor, params: list[nn.Parameter]) -> tuple[Tensor, WeightGrads]:
    """B: ``(d objective / d x, the W still to run)``; ``x`` is the stage input (requires grad)."""
    root, x_node = objective.grad_fn, _node(x)
    users = _consumers(root)
    on_x_path, _ = _up([x_node], users, set())
    weights = {n: p for p in params if p.requires_grad and (n := _node(p)) in users}
    groups: dict[Node, _Group] = {}
    for weight_node in weights:
        _, met = _up([weight_node], users, on_x_path)
        if not met:
            raise RuntimeError(
                f"a weight of shape {tuple(weights[weight_node].shape)} reaches the objective "
                "without passing the stage input: the backward split cannot defer its grad"
            )
        merged = {id(g): g for n in met if (g := groups.get(n)) is not None}
        group = _Group({weight_node}, sorted(met, key=id))
        for other in merged.values():
            group.params |= other.params
            group.intermediates = sorted(
                set(group.intermediates) | set(other.intermediates), key=id
            )
        for n in group.intermediates:
            groups[n] = group
    unique = list({id(g): g for g in groups.values()}.values())

    def keep(group: _Group, node: Node):
        def hook(grad_outputs):
            group.grads[node] = grad_outputs

        return hook

    handles = [n.register_prehook(keep(g, n)) for g in unique for n in g.intermediates]
    try:
        (dx,) = torch.autograd.grad(objective, [x], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, WeightGrads(unique, weights)
