"""Joining the job's process group: the CPU thread policy, the rendezvous store and the backend."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)

from lightning_titan.runtime.launch import cpu_threads_per_rank, rank_store, restart_store
from lightning_titan.train.options import TrainOptions


def connect(
    env: ClusterEnvironment,
    device: torch.device,
    backend: str | None,
    options: TrainOptions,
    num_processes: int,
) -> None:
    """Init the default process group on this rank (``backend`` None: nccl on CUDA, gloo on CPU)."""
    if device.type == "cpu":  # ranks on one machine share its cores: no oversubscription
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
        forked = options.start_method == "fork"
        torch.set_num_threads(cpu_threads_per_rank(local_world, forked=forked))
    backend = backend or _get_default_process_group_backend_for_device(device)
    timeout = timedelta(minutes=options.timeout_minutes)  # the subgroups' too
    # a forked rank's store: rank 0 serves it on its launcher's socket (launch.hosted_rendezvous)
    store = rank_store(env.global_rank(), env.world_size(), timeout) or restart_store(timeout)
    extra: dict[str, Any] = {} if store is None else {"store": store}
    device_id = device if device.type == "cuda" else None
    _init_dist_connection(env, backend, timeout=timeout, device_id=device_id, **extra)
