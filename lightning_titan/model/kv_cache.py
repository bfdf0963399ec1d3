"""The keys and values of the tokens a generation has already run, kept per attention layer, so that
each new token is one forward of that token alone (``tools/decoding.py``).

A ``KVCache`` goes to ``StageModel.forward`` only when generating; training passes none, and then no
line of this file runs. With one, the new tokens take the positions after the held ones: RoPE by
those positions, and a mask by them (causal, and gpt-oss's window on its window layers; the sink
column as without a cache). Each attention layer appends its new keys to its ``LayerCache`` and
attends over all it holds:

- GQA (``model/attention.py``): k (rotated) and v per KV head, before the heads are repeated;
- MLA (``model/mla.py``): the normalised latent and the rotated shared key, ``kv_rank + rope``
  channels a token (what context parallelism gathers too); the heads' keys and values are expanded
  from them at every step;
- window layers hold every key as well (the mask hides the old ones): the cache holds at most
  ``capacity`` (the model's ``seq_len``) positions, and refuses more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_titan.model.sinks import attend_mask


class LayerCache:
    """One attention layer's held tensors, each [b, h, positions, channels], in buffers of
    ``capacity`` positions allocated at the first ``extend``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffers: tuple[Tensor, ...] = ()
        self._filled = 0

    def extend(self, *new: Tensor) -> tuple[Tensor, ...]:
        """Append ``new`` [b, h, S_new, c] (one per held tensor) after the held positions; returns
        every position held, [b, h, held + S_new, c] each (views of the buffers)."""
        end = self._filled + new[0].shape[2]
        if end > self.capacity:
            raise ValueError(
                f"the cache holds {self.capacity} positions; {end} do not fit: start a new cache "
                "(generate re-reads the last seq_len tokens)"
            )
        if not self._buffers:
            self._buffers = tuple(t.new_empty(*t.shape[:2], self.capacity, t.shape[3]) for t in new)
        for buffer, t in zip(self._buffers, new, strict=True):
            buffer[:, :, self._filled : end] = t
        self._filled = end
        return tuple(buffer[:, :, :end] for buffer in self._buffers)


class KVCache:
    """Every attention layer's ``LayerCache`` of one generation, and how many positions they hold
    (``length``): the next token's position. ``capacity``: the most positions, the model's
    ``seq_len`` (RoPE and YaRN are fitted to it, and the uncached path sees no more)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self._layers: dict[int, LayerCache] = {}

    def layer(self, index: int) -> LayerCache:
        """Layer ``index``'s (global index) held keys."""
        if index not in self._layers:
            self._layers[index] = LayerCache(self.capacity)
        return self._layers[index]

    def step(
        self, new: int, cos: Tensor, sin: Tensor, window: int, cacheable: bool = True
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """For ``new`` tokens after the held ones: their rows of the RoPE tables ``cos``/``sin``
        [capacity, dim], and the bool masks [new, length + new] (True: attend) of every layer and of
        the window layers (None without a ``window``); then counts them as held. ``cacheable``:
        False where the forward is one of packed documents, or of a model cut by tp, cp or chunks
        (each rank would hold a slice of the keys), which a cache refuses."""
        if not cacheable:
            raise ValueError(
                "a KV cache takes one document a sequence on a model of one chunk without tp or "
                "cp (generation's); run this forward without cache"
            )
        end = self.length + new
        if end > self.capacity:
            raise ValueError(
                f"{end} positions do not fit a cache of {self.capacity} (the model's seq_len)"
            )
        positions = torch.arange(self.length, end, device=cos.device)
        keys = torch.arange(end, device=cos.device)
        self.length = end
        window_mask = attend_mask(positions, keys, window) if window else None
        return cos[positions], sin[positions], attend_mask(positions, keys, 0), window_mask
