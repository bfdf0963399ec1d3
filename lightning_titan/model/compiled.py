"""``torch.compile`` of a stage, region by region (``TitanLM(compile=True)``).

Each block compiles in three regions, as torchtitan compiles its blocks with the MoE's token counts
kept out of the graph, and the last stage in two more:

- ``Block.attend``: RMSNorm, q/k/v, RoPE, attention, the output projection, the residual add and the
  MoE's RMSNorm; one graph per block shape, shared by the blocks (the parameters are its inputs).
  Under selective recompute (``model/recompute.py``) the training forward does not run it: the
  norms' discard and refill are Python around the attention, which stays eager.
- ``route`` (``model/moe/router.py``): the router's scores, the top-K and the auxiliary losses.
- ``gated`` (``model/moe/activation.py``): the experts' activation between their grouped GEMMs
  (SwiGLU, or gpt-oss's clamped form), compiled with ``dynamic=True``: its row count, which the
  routing changes every step, is a symbol from the first trace on, so a new count does not recompile.
  Under selective recompute it runs inside the recompute's Function: without grad in the forward,
  with it when the backward recomputes it (a graph each).
- ``StageModel.head`` (the final RMSNorm and the LM head) and ``StageModel.token_loss_sum`` (the
  cross-entropy, vocab-parallel under TP), on the stage that holds the head.

The MoE's dispatch, the expert GEMMs and the combine run eagerly: their row counts depend on the
routing, the all-to-all moves them, and ``torch._grouped_mm`` takes its offsets from a tensor.
Graph breaks on purpose: every collective inside a region (the TP sequence gather and
reduce-scatter, the vocab-parallel loss's all-reduces, the CP key gather, OLMoE's QK-norm sum, the
routing counts' all-reduce) runs eagerly between two graphs, so a region works under any TP x CP
layout.

Backward: each region is one autograd node that computes its input's and its weights' grads
together, which the zero-bubble schedules' split (``parallel/pipeline/backward_split.py``) cannot
take apart; under those schedules (``SPLIT_BACKWARD``) only the regions that hold no weight are
compiled: ``route``, ``gated`` and the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_titan.model.decoder import Block, StageModel
from lightning_titan.model.moe.activation import gated
from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.model.moe.router import route

# Dynamo's per-code cache: one entry per region and per distinct input shape (the first stage's
# blocks, a V's two chunks and forward-only evaluation see the same shapes; TP/CP change them)
_CACHE_SIZE = 16


def compile_stage(model: StageModel, *, split_backward: bool = False, **options: Any) -> None:
    """Replace the regions of ``model`` by their compiled forms, in place (module doc).
    ``split_backward``: the schedule defers the weight grads (the attention and the head stay eager).
    ``options`` go to ``torch.compile`` (e.g. ``backend="aot_eager"`` in tests)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _CACHE_SIZE)
    if split_backward:  # B keeps the graph for W (retain_graph): a compiled backward may not
        # reuse ("donate") its saved buffers then; read when a region compiles, so set for the process
        torch._functorch.config.donated_buffer = False
    compiled_route = torch.compile(route, **options)
    # the row count changes with the routing every step: traced as a symbol from the first call on
    compiled_gated = torch.compile(gated, dynamic=True, **options)
    for module in model.modules():
        if isinstance(module, Block):
            if not split_backward:
                module.attend = torch.compile(module.attend, **options)  # type: ignore[method-assign]
            if module.moe is not None:  # not a dense layer (DeepSeek-V3's first ones)
                module.moe.route = compiled_route
        if isinstance(module, GroupedExperts):
            module.gated = compiled_gated
    if model.is_last_stage:
        if not split_backward:  # the LM head holds a weight: the split needs it eager
            model.head = torch.compile(model.head, **options)  # type: ignore[method-assign]
        model.token_loss_sum = torch.compile(model.token_loss_sum, **options)  # type: ignore[method-assign]


def graphs_compiled() -> int:
    """How many graphs Dynamo has compiled in this process so far (a recompile adds one)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compile_report(first_step_s: float) -> str:
    """One line for the log after the step that compiled."""
    return (
        f"compile: the first step took {first_step_s:.1f} s, compiling {graphs_compiled()} graphs "
        "(each with its backward); later steps reuse them"
    )
