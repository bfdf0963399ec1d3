"""bf16 weights over fp32 master weights (``param_dtype="bf16"``), as Megatron's distributed
optimizer and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` keep them.

The model's trainable parameters are stored in bf16: forward and backward read them (2 bytes a
parameter instead of 4, and no autocast copy of each weight per forward). The optimizer steps an
fp32 master copy of each instead, so that small updates are not rounded away: a bf16 weight of 1.0
cannot move by less than 2^-8. A step then is:

    backward        bf16 grads on the parameters
    reduce          the reducers copy them into fp32 buckets, reduce, and write the fp32 result to
                    the master's grad (the bf16 grad is dropped): ``GradReducer(masters=...)``
    clip            over the masters' fp32 grads
    optimizer.step  on the masters (AdamW's moments are fp32 as the masters are)
    write back      each parameter takes its master rounded to bf16 (``write_back``)

Masters are taken from the parameters before they are cast, so they start at the fp32 init (or the
fp32 checkpoint), not at its bf16 rounding. Under ZeRO (``ZeroGroup.take_masters``) a rank keeps
the master of only its rows: the ZeRO shard's leaf, which the optimizer steps, becomes a dense fp32
copy of them (``ZeroShard.master``), the whole fp32 master goes, and after the step the group's
all-gather of the updated rows into the parameters runs in bf16 (half the bytes). At zero=1 the
reduced fp32 grad of such a parameter is whole until the step, held by a stand-in of its shape with
one element of storage (``grad_holder``), which the clip reads; at zero=2 the reducer
reduce-scatters it in fp32 straight into the leaf's grad (``parallel/dp/zero_grads.py``). A
checkpoint saves the masters under the parameters' names (``checkpoint/state.py``): it is the same
fp32 checkpoint a run with fp32 weights writes, and either run resumes from the other's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MasterWeights:
    """The fp32 masters of ``params``'s trainable floating parameters, which are cast to
    ``dtype`` here (the frozen ones, with no optimizer, keep their dtype)."""

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
        self._master: dict[int, nn.Parameter] = {}  # whole masters (rows: the ZeRO leaves)
        self._param: dict[int, nn.Parameter] = {}  # id(master) -> its parameter
        self._holder: dict[int, nn.Parameter] = {}  # a ZeRO-cut parameter's fp32 grad holder
        self.params: list[nn.Parameter] = []
        for p in params:
            if not (p.requires_grad and p.is_floating_point()) or id(p) in self._master:
                continue
            master = nn.Parameter(p.detach().to(torch.float32, copy=True))
            p.data = p.data.to(dtype)
            self._master[id(p)], self._param[id(master)] = master, p
            self.params.append(p)

    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """(parameter, its whole master) pairs (not the ZeRO-cut ones: their leaves are rows)."""
        return ((p, self._master[id(p)]) for p in self.params if id(p) in self._master)

    def of(self, param: Tensor) -> nn.Parameter | None:
        """The master of model parameter ``param``, None for one without (frozen, or not bf16)."""
        return self._master.get(id(param))

    def grad_holder(self, param: nn.Parameter) -> nn.Parameter:
        """Where ``param``'s reduced grad lives: its master's ``.grad`` (fp32), the stand-in of a
        ZeRO-cut one, or its own."""
        holder = self._holder.get(id(param))
        return holder if holder is not None else self._master.get(id(param), param)

    def pop(self, param: nn.Parameter) -> nn.Parameter | None:
        """Hand ``param``'s whole master over (None: it has none) to a ZeRO shard, which keeps
        this rank's rows of it (``ZeroGroup.take_masters``); its reduced fp32 grad is held from
        then on by a stand-in of its shape with one element of storage (a grad must match its
        tensor's shape, and the clip reads it whole)."""
        master = self._master.pop(id(param), None)
        if master is not None:
            del self._param[id(master)]
            stand_in = torch.zeros((), dtype=torch.float32, device=param.device)
            self._holder[id(param)] = nn.Parameter(stand_in.expand(param.shape))
        return master

    def drop_held_grads(self) -> None:
        """After the step: the stand-ins' whole fp32 grads go (the optimizer's zero_grad does not
        see them)."""
        for holder in self._holder.values():
            holder.grad = None

    def param_of(self, tensor: Tensor) -> Tensor:
        """The model parameter an optimizer's ``tensor`` stands for (itself unless a master)."""
        return self._param.get(id(tensor), tensor)

    def step_masters(self, optimizer: Optimizer) -> None:
        """Point ``optimizer`` at the masters in place of the parameters (before it has state)."""
        if optimizer.state:
            raise RuntimeError(
                "param_dtype='bf16' points an optimizer at the fp32 masters before its first "
                "step; this one already has state"
            )
        for group in optimizer.param_groups:
            group["params"] = [self._master.get(id(p), p) for p in group["params"]]

    @torch.no_grad()
    def write_back(self) -> None:
        """Every parameter with a whole master takes it, rounded to the parameter's dtype (a
        ZeRO-cut one takes its rows by the group's gather: ``ZeroGroup.gather``)."""
        whole = [(p, self._master[id(p)]) for p in self.params if id(p) in self._master]
        if whole:
            torch._foreach_copy_([p.data for p, _ in whole], [m for _, m in whole])

    @torch.no_grad()
    def restore(self) -> None:
        """Every parameter with a whole master becomes it (the engine is removed: the model after
        training is the fp32 one the optimizer stepped, and a new engine takes its masters from
        it; ZeRO-cut ones: ``ZeroGroup.restore_masters``)."""
        for p, master in self:
            p.data = master.data


def parameter_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``param_dtype`` option, refused by name."""
    if name not in PARAM_DTYPES:
        raise ValueError(
            f"param_dtype={name!r} is not a parameter dtype; choose one of {sorted(PARAM_DTYPES)}"
        )
    return PARAM_DTYPES[name]


def masters_of(masters: MasterWeights | None, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` with each replaced by where its reduced grad lives (``grad_holder``)."""
    params = list(params)
    return params if masters is None else [masters.grad_holder(p) for p in params]
