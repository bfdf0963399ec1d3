"""Packed documents: several records in one sequence, each attending only to itself.

A packed batch carries ``documents`` [b, S]: each token's document id within its sequence (ids
change where a document starts; the padding after the last document is one more document). From it
the forward builds, once for every layer:

- the positions RoPE reads: each document's tokens from 0 (``document_positions``), so a document
  rotates as it would alone;
- a block-diagonal causal mask: a query sees the earlier tokens of its own document only (and on a
  sliding-window layer only the last ``window`` of them).

So running a packed sequence equals running each document alone (``tests/unit/test_packed_documents.py``).
Under context parallelism the ids are whole on every CP rank (the batch is), and both sides are cut
like the tokens: the queries are this rank's positions (``context_parallel.local_positions``), the
keys every rank's in ``gather_keys`` order (``all_positions``). Later pipeline stages read the same
ids from their own copy of the batch: nothing extra travels between stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.parallel import context_parallel
from lightning_titan.parallel.tensor_parallel import tp_size


def document_positions(documents_BS: Tensor) -> Tensor:
    """[b, S] each token's position within its document: 0 where the id changes from the token
    before (and at the sequence's start), counting up to the next change."""
    b, s = documents_BS.shape
    index = torch.arange(s, device=documents_BS.device).expand(b, s)
    starts = torch.ones_like(documents_BS, dtype=torch.bool)
    starts[:, 1:] = documents_BS[:, 1:] != documents_BS[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_masks(
    documents_BS: Tensor, cp_group: ProcessGroup | None, window: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(positions [b, S/cp] of this CP rank's queries within their documents, the causal mask
    [b, 1, S/cp, S] bool (True: attend) of each query over every key of its own document, and the
    same within ``window`` positions back, or None when ``window`` is 0). Keys in ``gather_keys``
    order under CP."""
    seq_len, device = documents_BS.shape[1], documents_BS.device
    if tp_size(cp_group) > 1:
        mine = context_parallel.local_positions(seq_len, cp_group, device)
        keys = context_parallel.all_positions(seq_len, cp_group, device)
    else:
        mine = keys = torch.arange(seq_len, device=device)
    positions = document_positions(documents_BS)
    same_BQK = documents_BS[:, mine].unsqueeze(2) == documents_BS[:, keys].unsqueeze(1)
    back_QK = mine.unsqueeze(1) - keys.unsqueeze(0)  # how far back each key is, by global position
    causal = same_BQK & (back_QK >= 0)
    windowed = None if window <= 0 else causal & (back_QK < window)
    return (
        positions[:, mine],
        causal.unsqueeze(1),
        None if windowed is None else windowed.unsqueeze(1),
    )


def check_documents(documents: Tensor, inputs_shape: torch.Size) -> None:
    """A ``documents`` tensor fits the batch it came with: [b, S] integer ids."""
    if documents.shape != inputs_shape or documents.dtype.is_floating_point:
        raise ValueError(
            f"documents must be integer ids shaped like the token ids {tuple(inputs_shape)}, got "
            f"{documents.dtype} {tuple(documents.shape)}; give each token its document's id"
        )


QUERY_CHUNK = 128  # queries a masked attention call takes at a time (``masked_attention``)


def chunk_key_starts(documents_BS: Tensor) -> tuple[int, ...]:
    """For each ``QUERY_CHUNK`` of queries, the first key any of them can see: the start of the
    document of the chunk's first query, the earliest over the batch's sequences (a later query's
    document starts no earlier). One read of [S / QUERY_CHUNK] ids to the host a forward (a sync
    on CUDA), for every layer."""
    starts = torch.arange(documents_BS.shape[1], device=documents_BS.device)
    first_BS = starts - document_positions(documents_BS)
    return tuple(first_BS[:, ::QUERY_CHUNK].amin(dim=0).tolist())


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    scale: float | None = None,
    key_starts: tuple[int, ...] | None = None,
) -> Tensor:
    """``scaled_dot_product_attention`` of ``q`` [b, H, S, hd] over ``k``, ``v`` with an additive
    causal ``mask`` [..., S, S_k]; where the keys are the queries' positions in order (``S_k == S``:
    no CP), ``QUERY_CHUNK`` queries at a time, each over the keys up to its last query only, and
    from ``key_starts`` (``chunk_key_starts``: the first key the chunk's documents reach) when
    given. With ``is_causal`` the kernel skips the blocks above the diagonal; with an explicit mask
    it computes them all (1.6x the causal kernel's time at 1,024 tokens on CPU): the chunks leave
    them out, and the key starts the blocks of earlier documents too. Each query's softmax runs
    over the same keys as in one call, less ones its mask hides."""
    s = q.shape[2]
    if s <= QUERY_CHUNK or mask.shape[-1] != s:  # short, or keys in another order (CP): one call
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = []
    for i, start in enumerate(range(0, s, QUERY_CHUNK)):
        end = min(start + QUERY_CHUNK, s)
        first = 0 if key_starts is None else key_starts[i]
        queries, mask_QK = q[:, :, start:end], mask[..., start:end, first:end]
        keys, values = k[:, :, first:end], v[:, :, first:end]  # a query sees no later key
        out.append(
            F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask_QK, scale=scale)
        )
    return torch.cat(out, dim=2)
