"""Context parallelism: each sequence's positions split over the CP group, load-balanced for causal
attention, with exact attention by an all-gather of keys and values.

The sequence is cut into ``2 * cp`` chunks; CP rank ``r`` holds chunks ``r`` and ``2*cp - 1 - r``, so
every rank has as many early (cheap) as late (expensive) query positions and does the same attention
work. Everything per token (norms, MoE routing and experts, the loss) runs on the rank's positions;
attention all-gathers K and V over the CP group (the backward reduce-scatters their grads to their
owners) and masks by the tokens' global positions, which are also RoPE's. Keys arrive in rank order,
not position order: the mask, built from positions, makes the order irrelevant.

All-gather rather than ring attention: one collective per layer, exact softmax with no online merge,
and K/V memory of the whole sequence per rank (``2 * S * n_kv_heads * head_dim`` per sequence and
layer, small next to the ``S/cp``-token activations it saves under grouped-query attention).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.parallel.tensor_parallel import gather_along, tp_rank, tp_size


def positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The global positions CP rank ``rank`` holds, in its local order: chunks ``rank`` and
    ``2*cp - 1 - rank`` of ``2*cp`` (the whole sequence when ``cp`` is 1)."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second]) if cp > 1 else torch.arange(seq_len, device=device)


def local_positions(seq_len: int, group: ProcessGroup | None, device: torch.device) -> Tensor:
    return positions(seq_len, tp_size(group), tp_rank(group), device)


def all_positions(seq_len: int, group: ProcessGroup | None, device: torch.device) -> Tensor:
    """The positions of the keys ``gather_keys`` returns: every rank's, in rank order."""
    cp = tp_size(group)
    return torch.cat([positions(seq_len, cp, r, device) for r in range(cp)])


def take_local(tokens: Tensor, group: ProcessGroup | None) -> Tensor:
    """This CP rank's positions of ``tokens`` [b, S, ...] (dim 1)."""
    if tp_size(group) == 1:
        return tokens
    index = local_positions(tokens.shape[1], group, tokens.device)
    return tokens.index_select(1, index)


def gather_keys(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Keys or values [b, heads, S/cp, hd] -> [b, heads, S, hd] of every CP rank (differentiable)."""
    return gather_along(x, group, 2, kind="cp")
