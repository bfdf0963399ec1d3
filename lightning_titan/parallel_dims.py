"""Degrees of parallelism, this rank's coordinates, and the four group kinds.

The convention is fixed (see DESIGN.md): ``ep_rank`` changes fastest, then ``pp_rank``::

    rank = (dp_rank * pp + pp_rank) * ep + ep_rank

| group         | fixed   | varies  | used for                                  |
|---------------|---------|---------|-------------------------------------------|
| ep            | dp, pp  | ep      | token all-to-all inside one stage         |
| pp            | dp, ep  | pp      | activation send/recv; grad-norm sum       |
| expert_dp     | pp, ep  | dp      | all-reduce of expert grads                |
| non_expert_dp | pp      | dp, ep  | all-reduce of non-expert grads (router)   |
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

GROUP_KINDS = ("ep", "pp", "expert_dp", "non_expert_dp")


def resolve_degrees(dp: int, pp: int, ep: int, world_size: int) -> tuple[int, int, int]:
    """Fill the one degree given as -1 so that dp * pp * ep == world_size, and check the product."""
    degrees = {"dp": dp, "pp": pp, "ep": ep}
    for name, value in degrees.items():
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise ValueError(
                f"{name}={value!r} is not valid: use a positive int, or -1 to fill the rest"
            )
    free = [name for name, value in degrees.items() if value == -1]
    if len(free) > 1:
        raise ValueError(
            f"{' and '.join(free)} are both -1: at most one degree may be -1 (fill the rest)"
        )
    if free:
        fixed = 1
        for value in degrees.values():
            if value != -1:
                fixed *= value
        if world_size % fixed:
            raise ValueError(
                f"cannot fill {free[0]}=-1: world size {world_size} is not divisible by the other degrees' "
                f"product {fixed}; choose degrees whose product divides {world_size}"
            )
        degrees[free[0]] = world_size // fixed
    product = degrees["dp"] * degrees["pp"] * degrees["ep"]
    if product != world_size:
        raise ValueError(
            f"dp*pp*ep = {degrees['dp']}*{degrees['pp']}*{degrees['ep']} = {product} but the world size is "
            f"{world_size} (devices x num_nodes); make the product equal the world size, or set one degree to -1"
        )
    return degrees["dp"], degrees["pp"], degrees["ep"]


@dataclass(frozen=True)
class ParallelDims:
    """The (dp, pp, ep) layout and the coordinates of one rank in it. Pure logic, no collectives."""

    dp: int
    pp: int
    ep: int
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} is outside the world of {self.world_size} ranks (dp*pp*ep)"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.ep

    def rank_of(self, dp_rank: int, pp_rank: int, ep_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.ep + ep_rank

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, ep_rank) of a global rank."""
        return rank // (self.pp * self.ep), (rank // self.ep) % self.pp, rank % self.ep

    @property
    def dp_rank(self) -> int:
        return self.coords_of(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.coords_of(self.rank)[1]

    @property
    def ep_rank(self) -> int:
        return self.coords_of(self.rank)[2]

    @property
    def data_rank(self) -> int:
        """Which shard of the global batch this rank reads; all stages of one pipeline read the same."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def data_world(self) -> int:
        return self.dp * self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous stage of this pipeline, None on the first stage."""
        if self.is_first_stage:
            return None
        return self.rank_of(self.dp_rank, self.pp_rank - 1, self.ep_rank)

    @property
    def next_stage_rank(self) -> int | None:
        if self.is_last_stage:
            return None
        return self.rank_of(self.dp_rank, self.pp_rank + 1, self.ep_rank)

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as sorted global ranks, in the same order on every rank."""
        d, p, e = range(self.dp), range(self.pp), range(self.ep)
        if kind == "ep":
            return [[self.rank_of(i, j, k) for k in e] for i, j in itertools.product(d, p)]
        if kind == "pp":
            return [[self.rank_of(i, j, k) for j in p] for i, k in itertools.product(d, e)]
        if kind == "expert_dp":
            return [[self.rank_of(i, j, k) for i in d] for j, k in itertools.product(p, e)]
        if kind == "non_expert_dp":
            return [[self.rank_of(i, j, k) for i in d for k in e] for j in p]
        raise ValueError(f"unknown group kind {kind!r}; choose one of {GROUP_KINDS}")

    def group_ranks(self, kind: str) -> list[int]:
        """The global ranks of this rank's group of one kind."""
        return next(g for g in self.all_groups(kind) if self.rank in g)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process group of each kind (see the table at the top of this file)."""

    ep: dist.ProcessGroup
    pp: dist.ProcessGroup
    expert_dp: dist.ProcessGroup
    non_expert_dp: dist.ProcessGroup


def build_process_groups(dims: ParallelDims) -> ProcessGroups:
    """Create every group of every kind, on every rank in the same order (``new_group`` is collective)."""
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed initialised first")
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but dp*pp*ep = {dims.world_size}"
        )
    mine = {}
    for kind in GROUP_KINDS:
        group, _ = dist.new_subgroups_by_enumeration(dims.all_groups(kind))
        mine[kind] = group
    return ProcessGroups(**mine)
