"""The decoding loop of ``titan generate``: a model's next tokens, in one process or on the stages
of a pipeline (each rank its layers, experts and KV cache; the last stage picks each token).

``tools/generate.py`` is the command around it; ``tools/generate_layout.py`` runs it on a layout's
ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.model.decoder import StageModel
from lightning_titan.model.kv_cache import KVCache


def next_token(
    logits_V: Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """The next id from the last position's logits [V]: the argmax at ``temperature`` 0, else a
    sample of softmax(logits / temperature) restricted to the top-p nucleus."""
    if temperature == 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # keep each token whose preceding mass is below top_p (the first one always)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    nucleus = sorted_probs * keep
    choice = torch.multinomial(nucleus / nucleus.sum(), 1, generator=generator)
    return int(order[choice])


@torch.no_grad()
def generate(
    model: StageModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: tuple[int, ...] = (),
    seed: int = 0,
    kv_cache: bool = True,
    pp_group: ProcessGroup | None = None,
) -> list[int]:
    """The ids ``model`` continues ``prompt_ids`` with (not including the prompt).

    With ``kv_cache`` the prompt runs once and each new token alone, over the held keys; once the
    text is longer than ``seq_len``, each token is a forward over the last ``seq_len`` tokens, as
    without the cache (positions past ``seq_len`` are ones the model never saw).

    ``pp_group``: ``model`` is one pipeline stage (one chunk) of the ranks of this group, in stage
    order, each holding its own cache; every rank of the group calls this and gets the same ids
    (the last stage picks each token and broadcasts it). The EP ranks of a stage run the same text
    in their own pipelines, so their dispatches pair up."""
    if pp_group is not None and model.num_chunks > 1:
        raise ValueError(
            f"generation takes one chunk a pipeline rank, not {model.num_chunks}: build the stages "
            "without virtual stages"
        )
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    seq_len = model.config.seq_len
    cache = KVCache(seq_len) if kv_cache else None
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        if cache is not None and len(ids) <= seq_len:  # the tokens the cache does not hold yet
            window = torch.tensor([ids[cache.length :]], device=device)
        else:
            window, cache = torch.tensor([ids[-seq_len:]], device=device), None
        logits_V = _last_logits(model, window, cache, pp_group)
        token = -1
        if logits_V is not None:
            token = next_token(logits_V.float().cpu(), temperature, top_p, generator)
        if pp_group is not None:  # the last stage's pick, on every stage
            token = _from_last_stage(token, pp_group, device)
        if token in stop_ids:
            break
        ids.append(token)
        new.append(token)
    return new


def _last_logits(
    model: StageModel, ids: Tensor, cache: KVCache | None, pp_group: ProcessGroup | None
) -> Tensor | None:
    """The last position's logits [V] of ``ids`` [1, S] on the last stage, None on the others: each
    stage runs its layers on what the previous one sent ([1, S, D]) and sends its output on."""
    stage = 0 if pp_group is None else dist.get_rank(pp_group)
    x = ids
    if not model.is_first_stage:
        assert pp_group is not None  # a model without the embedding is a pipeline stage
        dtype = next(model.parameters()).dtype
        x = ids.new_empty(*ids.shape, model.config.d_model, dtype=dtype)
        dist.recv(x, src=dist.get_global_rank(pp_group, stage - 1), group=pp_group)
    out, _ = model(x, cache=cache)
    if model.is_last_stage:
        return out[0, -1]
    assert pp_group is not None
    dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, stage + 1), group=pp_group)
    return None


def _from_last_stage(token: int, pp_group: ProcessGroup, device: torch.device) -> int:
    held = torch.tensor([token], device=device)
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    dist.broadcast(held, src=last, group=pp_group)
    return int(held)
