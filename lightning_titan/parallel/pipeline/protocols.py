"""What each side of a pipeline step needs of the other, as types.

``StageModule`` is what a stage runs (``model.decoder.StageModel`` is one). The schedules drive a
stage through one of three interfaces, by schedule family; ``stage.PipelineStage`` serves all three:

- ``Stage``: one model chunk per rank (``schedules.py``: gpipe, 1f1b, zb_h1, forward-only), with
  paired sends and receives;
- ``ChunkedStage``: several chunks per rank round a ring (``interleaved.py``), whose messages are
  filed by (chunk, microbatch) as they arrive;
- ``VStage``: two chunks per rank along a V (``zbv.py``), one exchange after every action.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from torch import Tensor, nn
from torch.distributed import ProcessGroup


class _Width(Protocol):
    @property
    def d_model(self) -> int: ...


class StageModule(Protocol):
    """The stage-local model: its chunks (virtual stages), which of them embed and which hold the
    head, and a forward per chunk returning ``(output, aux loss per sequence)``."""

    @property
    def config(self) -> _Width: ...
    @property
    def num_chunks(self) -> int: ...
    @property
    def stage_ids(self) -> Sequence[int]: ...  # each chunk's virtual stage
    @property
    def is_last_stage(self) -> bool: ...
    @property
    def v_shape(self) -> bool: ...  # chunks linked down and back up the ranks (ZBV)
    @property
    def cp_group(self) -> ProcessGroup | None: ...

    def embeds(self, chunk: int) -> bool: ...
    def heads(self, chunk: int) -> bool: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def __call__(
        self, x: Tensor, chunk: int = 0, documents: Tensor | None = None
    ) -> tuple[Tensor, Tensor]: ...


class _Placed(Protocol):
    pp: int  # pipeline ranks
    pp_rank: int


class Stage(_Placed, Protocol):
    """One chunk per rank; ``i``/``j`` are microbatches. A None tensor is "nothing to send" (the
    last stage's output, the first stage's input grad)."""

    def forward(self, i: int, x: Tensor | None, chunk: int = 0) -> Tensor | None: ...
    def backward(self, i: int, grad: Tensor | None, chunk: int = 0) -> Tensor | None: ...
    def backward_input(self, i: int, grad: Tensor | None, chunk: int = 0) -> Tensor | None: ...
    def backward_weight(self, i: int, chunk: int = 0) -> None: ...
    def recv_forward(self, i: int) -> Tensor | None: ...
    def send_forward(self, i: int, y: Tensor | None) -> None: ...
    def recv_backward(self, i: int) -> Tensor | None: ...
    def send_backward(self, i: int, dx: Tensor | None) -> None: ...
    def send_forward_recv_backward(self, i: int, y: Tensor | None, j: int) -> Tensor | None: ...
    def send_backward_recv_forward(self, j: int, dx: Tensor | None, i: int) -> Tensor | None: ...
    def forward_backward(
        self, i: int, x: Tensor | None, j: int, grad: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]: ...


class ChunkedStage(_Placed, Protocol):
    """Chunks round a ring: each action's input comes from the messages filed so far."""

    num_chunks: int

    def forward_chunk(self, chunk: int, i: int) -> None: ...
    def backward_chunk(self, chunk: int, i: int) -> None: ...
    def exchange(
        self,
        send_forward: tuple[int, int] | None = None,
        send_backward: tuple[int, int] | None = None,
        recv_forward: bool = False,
        recv_backward: bool = False,
    ) -> None: ...


class VStage(_Placed, Protocol):
    """Two chunks along a V, with the backward split into input (B) and weight (W) halves."""

    def forward_chunk(self, chunk: int, i: int) -> None: ...
    def backward_input_chunk(self, chunk: int, i: int) -> None: ...
    def backward_weight_chunk(self, chunk: int, i: int) -> None: ...
    def backward_chunk(self, chunk: int, i: int) -> None: ...  # B and W at once
    def overlap_chunks(self, f: tuple[int, int], b: tuple[int, int]) -> None: ...
    def exchange_messages(
        self,
        done: tuple[tuple[str, int, int], ...] | None,
        take: list[tuple[int, tuple[str, int, int]]],
    ) -> None: ...
