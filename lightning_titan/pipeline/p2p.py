"""Point-to-point transfers of ``[m, S, D]`` activations and their grads between neighbouring stages.

Every method is a no-op at the end of the pipeline where it has no neighbour, so a schedule reads the same
on every stage. Paired calls (``send_forward_recv_backward`` on stage p, ``send_backward_recv_forward`` on
stage p+1) go through ``batch_isend_irecv`` so neither blocks the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_titan import faults
from lightning_titan.parallel_dims import ParallelDims


class StageLinks:
    """This rank's links to the previous and next stage of its pipeline (its PP group)."""

    def __init__(
        self,
        dims: ParallelDims,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.prev, self.next = dims.prev_stage_rank, dims.next_stage_rank
        self.group, self.dtype, self.device = group, dtype, device

    def _buffer(self, shape: tuple[int, ...]) -> Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _run(self, ops: list[dist.P2POp]) -> None:
        if ops:
            faults.inject("p2p")
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _send(self, tensor: Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.isend, tensor.detach().to(self.dtype).contiguous(), peer, self.group)

    def _recv(self, buffer: Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.irecv, buffer, peer, self.group)

    def recv_forward(self, shape: tuple[int, ...]) -> Tensor | None:
        if self.prev is None:
            return None
        buffer = self._buffer(shape)
        self._run([self._recv(buffer, self.prev)])
        return buffer

    def send_forward(self, activation: Tensor | None) -> None:
        if self.next is not None:
            self._run([self._send(activation, self.next)])

    def recv_backward(self, shape: tuple[int, ...]) -> Tensor | None:
        if self.next is None:
            return None
        buffer = self._buffer(shape)
        self._run([self._recv(buffer, self.next)])
        return buffer

    def send_backward(self, grad: Tensor | None) -> None:
        if self.prev is not None:
            self._run([self._send(grad, self.prev)])

    def send_forward_recv_backward(
        self, activation: Tensor | None, shape: tuple[int, ...]
    ) -> Tensor | None:
        if self.next is None:
            return None
        buffer = self._buffer(shape)
        self._run([self._send(activation, self.next), self._recv(buffer, self.next)])
        return buffer

    def send_backward_recv_forward(
        self, grad: Tensor | None, shape: tuple[int, ...]
    ) -> Tensor | None:
        if self.prev is None:
            return None
        buffer = self._buffer(shape)
        self._run([self._send(grad, self.prev), self._recv(buffer, self.prev)])
        return buffer
