"""Degrees of parallelism, this rank's coordinates, and the group kinds, all named by mesh axis.

The mesh convention is fixed (docs/concepts.md, "The mesh"): axes from slowest to fastest are ``AXES``; a rank's
coordinates are its mixed-radix digits in that order. With the five axes the code has today::

    rank = (((dp_rank * pp + pp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank

``tp`` varies fastest, then ``cp``: on GPUs a TP group (two collectives in every block) and then a
CP group (a K/V all-gather in every block) sit inside one node.

A group kind is the set of axes that vary inside one group (the others are fixed):

| group         | varies     | used for                                                      |
|---------------|------------|---------------------------------------------------------------|
| ep            | ep             | token all-to-all inside one stage                         |
| pp            | pp             | activation send/recv                                      |
| tp            | tp             | sequence all-gather / reduce-scatter; vocab-parallel loss |
| cp            | cp             | K/V all-gather of context parallelism                     |
| sequence      | cp, tp         | the ranks holding one sequence's tokens: router counts    |
| expert_dp     | dp, cp, tp     | all-reduce of expert grads (CP/TP ranks: their own tokens)|
| non_expert_dp | dp, ep, cp     | all-reduce of TP-sharded grads (attention, embedding, head)|
| sequence_dp   | dp, ep, cp, tp | all-reduce of the norms' and routers' grads: every rank   |
|               |                | holds them whole and sees its own tokens                  |
| model         | pp, ep, tp     | the grad-norm sum over everything one DP replica holds    |

CP ranks, like DP ranks, hold the same weights and see different tokens (the same sequences' other
positions): every reduction group includes cp, and the norm needs none of it.

MoE Parallel Folding (``fold_ep=True``, Megatron's arXiv 2504.14960) folds the cp and tp ranks of a
stage into expert parallelism: each of them already holds its own tokens (its sequence-parallel
slice), so it can send them to experts on any rank of the fold. Three kinds change (``FOLDED``): the
all-to-all group ``ep`` varies in (ep, cp, tp), the experts split over its ep * cp * tp ranks
(``expert_world``, this rank's place in it ``expert_rank``); their grads reduce over dp only; and
the norm's ``model`` group spans cp too (a replica's experts now lie on its cp ranks as well).

A new axis is one more name in ``AXES`` (and a field below) plus the groups it joins in ``GROUPS``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("dp", "pp", "ep", "cp", "tp")  # slowest to fastest
GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "pp": ("pp",),
    "expert_dp": ("dp", "cp", "tp"),
    "non_expert_dp": ("dp", "ep", "cp"),
    "tp": ("tp",),
    "sequence_dp": ("dp", "ep", "cp", "tp"),
    "model": ("pp", "ep", "tp"),
    "cp": ("cp",),
    "sequence": ("cp", "tp"),
}
GROUP_KINDS = tuple(GROUPS)
# fold_ep: the kinds that change when the cp and tp ranks of a stage join expert parallelism
FOLDED: dict[str, tuple[str, ...]] = {
    "ep": ("ep", "cp", "tp"),
    "expert_dp": ("dp",),
    "model": ("pp", "ep", "cp", "tp"),
}


def check_degrees(**degrees: int) -> dict[str, int]:
    """Type and sign of each degree, before the world size is known; at most one may be -1."""
    for name, value in degrees.items():
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise ValueError(
                f"{name}={value!r} is not valid: use a positive int, or -1 to fill the rest"
            )
    free = [name for name, value in degrees.items() if value == -1]
    if len(free) > 1:
        raise ValueError(
            f"{' and '.join(free)} are -1: at most one degree may be -1 (fill the rest)"
        )
    return dict(degrees)


# where a launcher that fixes the world itself (set_world_size is ignored) takes it from
WORLD_SIZE_FROM = {
    "TorchElasticEnvironment": "WORLD_SIZE from torchrun",
    "SLURMEnvironment": "SLURM_NTASKS",
}


def check_launched_world(environment: Any, devices: int, num_nodes: int) -> None:
    """The processes the launcher started are the ranks the Trainer was given (every rank raises the
    same, before any process group); else a rank outside the layout would fail alone and the others wait."""
    launched = environment.world_size() if environment is not None else None
    if launched is None or launched == devices * num_nodes:
        return
    source = WORLD_SIZE_FROM.get(type(environment).__name__, "the cluster environment's world size")
    raise ValueError(
        f"{source} is {launched} but the Trainer has devices x num_nodes = {devices} x {num_nodes} = "
        f"{devices * num_nodes}: start {devices} processes per node on {num_nodes} node(s) (torchrun "
        f"--nproc_per_node={devices} --nnodes={num_nodes}), or set Trainer devices and num_nodes so "
        f"that devices x num_nodes = {launched}"
    )


def resolve_degrees(degrees: dict[str, int], world_size: int) -> dict[str, int]:
    """Fill the one degree given as -1 so that the product is ``world_size``, and check the product."""
    degrees = check_degrees(**degrees)
    fixed = math.prod(v for v in degrees.values() if v != -1)
    free = [name for name, value in degrees.items() if value == -1]
    if free:
        if world_size % fixed:
            raise ValueError(
                f"cannot fill {free[0]}=-1: world size {world_size} is not divisible by the other "
                f"degrees' product {fixed}; choose degrees whose product divides {world_size}"
            )
        degrees[free[0]] = world_size // fixed
    product = math.prod(degrees.values())
    if product != world_size:
        formula = "*".join(degrees)
        values = "*".join(str(v) for v in degrees.values())
        raise ValueError(
            f"{formula} = {values} = {product} but the world size is {world_size} "
            "(devices x num_nodes); make the product equal the world size, or set one degree to -1"
        )
    return degrees


@dataclass(frozen=True)
class ParallelDims:
    """The layout (a degree per axis) and the coordinates of one rank in it. Pure logic, no collectives."""

    dp: int
    pp: int
    ep: int
    rank: int = 0
    tp: int = 1  # after rank: ParallelDims(dp, pp, ep, rank) reads as before
    cp: int = 1
    # MoE Parallel Folding: the EP group spans the cp and tp ranks of a stage too (``FOLDED``).
    # True or False; typed int so that ``ParallelDims(**degrees)`` with a dict of ints type-checks
    fold_ep: int = False

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not isinstance(self.fold_ep, bool):
            raise ValueError(f"fold_ep={self.fold_ep!r} must be True or False")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} is outside the world of {self.world_size} ranks "
                f"({'*'.join(AXES)}); with torchrun, start as many processes as devices x nodes"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    def label(self, rank: int | None = None) -> str:
        """``"dp=2 pp=2 ep=2"`` (the degrees, then ``fold_ep`` if set), or a rank's coordinates with
        ``rank``; cp and tp only when they are used, so a layout without them reads as it always did."""
        values = self.degrees if rank is None else self.coords(rank)
        shown = [a for a in AXES if a in ("dp", "pp", "ep") or self.degrees[a] > 1]
        folded = " fold_ep" if self.fold_ep and rank is None else ""
        return " ".join(f"{a}={values[a]}" for a in shown) + folded

    def rank_of(
        self, dp_rank: int, pp_rank: int, ep_rank: int, tp_rank: int = 0, cp_rank: int = 0
    ) -> int:
        coords = {"dp": dp_rank, "pp": pp_rank, "ep": ep_rank, "cp": cp_rank, "tp": tp_rank}
        return self.rank_at(coords)

    def rank_at(self, coords: dict[str, int]) -> int:
        """The global rank at the given coordinates (one per axis)."""
        rank = 0
        for axis in AXES:
            rank = rank * getattr(self, axis) + coords[axis]
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of a global rank, one per axis."""
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, getattr(self, axis))
        return {axis: coords[axis] for axis in AXES}

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, ep_rank) of a global rank."""
        c = self.coords(rank)
        return c["dp"], c["pp"], c["ep"]

    @property
    def dp_rank(self) -> int:
        return self.coords(self.rank)["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords(self.rank)["pp"]

    @property
    def ep_rank(self) -> int:
        return self.coords(self.rank)["ep"]

    @property
    def tp_rank(self) -> int:
        return self.coords(self.rank)["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coords(self.rank)["cp"]

    def group_axes(self, kind: str) -> tuple[str, ...]:
        """The axes that vary inside a group of ``kind`` (``GROUPS``; ``FOLDED`` under fold_ep)."""
        if kind not in GROUPS:
            raise ValueError(f"unknown group kind {kind!r}; choose one of {GROUP_KINDS}")
        return FOLDED[kind] if self.fold_ep and kind in FOLDED else GROUPS[kind]

    def copied_over(self, kind: str) -> tuple[str, ...]:
        """The axes on which one data-parallel replica (the ``model`` group) holds a parameter whose
        grads reduce over ``kind`` as identical copies: the norm counts it on their first rank only."""
        return tuple(a for a in self.group_axes("model") if a in self.group_axes(kind))

    @property
    def expert_world(self) -> int:
        """The ranks a stage's experts are split over: ep, or ep * cp * tp under fold_ep."""
        return math.prod(getattr(self, a) for a in self.group_axes("ep"))

    @property
    def expert_rank(self) -> int:
        """This rank's place in its EP group (the order of the group's global ranks): it owns experts
        ``[expert_rank * n, (expert_rank + 1) * n)`` with ``n = n_experts // expert_world``."""
        coords, rank = self.coords(self.rank), 0
        for axis in self.group_axes("ep"):
            rank = rank * getattr(self, axis) + coords[axis]
        return rank

    @property
    def data_rank(self) -> int:
        """Which shard of the global batch this rank reads; all stages of one pipeline, and all CP and
        TP ranks of one stage, read the same."""
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

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of stage ``pp_rank`` of this rank's pipeline (same dp, ep, cp, tp)."""
        return self.rank_at({**self.coords(self.rank), "pp": pp_rank})

    def _stage_neighbour(self, offset: int) -> int | None:
        pp_rank = self.pp_rank + offset
        return self.stage_rank(pp_rank) if 0 <= pp_rank < self.pp else None

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous stage of this pipeline, None on the first stage."""
        return self._stage_neighbour(-1)

    @property
    def next_stage_rank(self) -> int | None:
        return self._stage_neighbour(+1)

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as sorted global ranks, in the same order on every rank."""
        varying = self.group_axes(kind)
        fixed = [a for a in AXES if a not in varying]
        groups = []
        for outer in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, outer, strict=True))
            ranks = [
                self.rank_at({**base, **dict(zip(varying, inner, strict=True))})
                for inner in itertools.product(*(range(getattr(self, a)) for a in varying))
            ]
            groups.append(sorted(ranks))
        return groups

    def group_ranks(self, kind: str) -> list[int]:
        """The global ranks of this rank's group of one kind."""
        return next(g for g in self.all_groups(kind) if self.rank in g)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process group of each kind (see the table at the top of this file)."""

    ep: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    expert_dp: dist.ProcessGroup | None
    non_expert_dp: dist.ProcessGroup | None
    # after the four above: ProcessGroups(None, None, None, None) is one process, as before
    tp: dist.ProcessGroup | None = None
    sequence_dp: dist.ProcessGroup | None = None
    model: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    sequence: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = None  # the named-axis mesh they come from


def build_process_groups(
    dims: ParallelDims,
    timeout: timedelta | None = None,
    device_type: str = "cpu",
    *,
    options_factory: Callable[[timedelta], C10dBackend.Options] | None = None,
) -> ProcessGroups:
    """The mesh of ``dims`` as one ``DeviceMesh`` with the axes as named dims, and every group kind
    from it: a one-axis kind is the mesh's dim, a kind of several axes its flattened sub-mesh
    (``mesh["dp", "cp", "tp"]``: the axes need not be adjacent). Collective: every rank builds the
    same dims and kinds in the same order.

    ``timeout``: the collective timeout of the groups (None: torch's default, 30 min, whatever the
    world group's is), how long a stalled peer holds the others. ``options_factory``: makes each
    group's backend options from ``timeout``, one new object per group (default: the backend's own
    options class, NCCL's for NCCL).

    Built once per layout and world group in a process: a notebook's second ``trainer.fit`` (or a
    test's next case) on the same layout gets the same groups. Each new gloo group would keep its
    threads polling for the rest of the process: 200 idle groups cost a fifth of a core per rank
    here. Every rank builds the same layouts in the same order, so all of them find or all build."""
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed initialised first")
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but the layout "
            f"{dims.degrees} has {dims.world_size}"
        )
    options_factory = options_factory or group_options
    key = (tuple(dims.degrees.values()), dims.fold_ep, dims.rank, timeout, device_type)
    world, built = _BUILT.get(key, (None, None))
    if built is not None and world is dist.group.WORLD:
        return built

    # a fresh options object per group: a communicator split may keep or change the one it is given
    # (torch's own split_group deep-copies it for that reason), so groups never share one
    def fresh() -> C10dBackend.Options | None:
        return None if timeout is None else options_factory(timeout)

    overrides: (
        dict[int | str, str | C10dBackend.Options | tuple[str, C10dBackend.Options]] | None
    ) = None if timeout is None else {axis: options_factory(timeout) for axis in AXES}
    shape = tuple(dims.degrees[a] for a in AXES)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES, backend_override=overrides)
    mine = {}
    for kind in GROUPS:
        axes = dims.group_axes(kind)
        # _flatten: torch's (private) way to one group over several dims; its test is this module's
        # (a name apart from the mesh's own dims: fold_ep's "ep" spans several)
        name = f"{kind}_folded" if kind in AXES else kind
        sub = mesh[axes[0]] if len(axes) == 1 else mesh[axes]._flatten(name, fresh())
        mine[kind] = sub.get_group()
    _BUILT[key] = (dist.group.WORLD, ProcessGroups(**mine, mesh=mesh))
    return _BUILT[key][1]


def group_options(timeout: timedelta) -> C10dBackend.Options:
    """Backend options that carry ``timeout`` into every group the mesh creates (NCCL takes only its
    own options class)."""
    if dist.get_backend() != "nccl":
        return C10dBackend.Options(dist.get_backend(), timeout)
    nccl = dist.ProcessGroupNCCL.Options()
    nccl.is_high_priority_stream = False
    nccl._timeout = timeout
    return nccl


# (degrees, rank, timeout, device type) -> (the world group they were built in, the groups)
_BUILT: dict[tuple, tuple[Any, ProcessGroups]] = {}


@functools.cache
def group_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh over ``group`` (for DTensors that tell a checkpoint where a shard goes),
    built once per group."""
    return DeviceMesh.from_group(group, device_type)
