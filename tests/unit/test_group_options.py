"""Every group the mesh builds gets backend options of its own: a communicator split may keep or
change the object it is given (torch's split_group deep-copies it for that reason), so one object
shared by every group is a bug waiting for NCCL. Without NCCL: a one-rank gloo world, the factory
injected, and torch's group constructors wrapped to see what each group received."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
from torch._C._distributed_c10d import Backend as C10dBackend

from lightning_titan.parallel.mesh import AXES, GROUPS, ParallelDims, build_process_groups


def test_each_group_gets_a_fresh_options_object(tmp_path, monkeypatch):
    made: list[C10dBackend.Options] = []
    received: list[object] = []

    def factory(timeout: timedelta) -> C10dBackend.Options:
        made.append(C10dBackend.Options("gloo", timeout))
        return made[-1]

    for name in ("new_group", "split_group"):
        real = getattr(device_mesh, name)

        def wrapped(*args, _real=real, **kwargs):
            received.append(kwargs.get("pg_options"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(device_mesh, name, wrapped)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        # a timeout of its own: groups are cached per (layout, rank, timeout, device type)
        timeout = timedelta(seconds=1234.5)
        build_process_groups(ParallelDims(1, 1, 1, 0), timeout, options_factory=factory)
    finally:
        dist.destroy_process_group()
    flattened = sum(len(axes) > 1 for axes in GROUPS.values())
    assert len(made) == len(AXES) + flattened, len(made)
    assert all(o._timeout == timeout for o in made)
    # one group per axis and per flattened kind, each with an object nobody else got
    assert len(received) == len(made), (len(received), len(made))
    assert len({id(o) for o in received}) == len(received), "an options object was shared"
    assert {id(o) for o in received} == {id(o) for o in made}
