"""What a device and its links deliver, for the cost model (``plan/cost.py``).

GPUs come from a catalogue (the vendors' datasheets, named beside each number); ``--device cpu``
is this machine, measured by short probes: the matmul throughput one rank's threads get, the fixed
cost of one block's forward and backward (kernel launches, Python: what dominates a small model on
a CPU), and gloo over loopback.

    python -m lightning_titan.plan.devices     # prints this machine's probes
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from lightning_titan.model.flops import matmul_peak

GB = 1e9
PER_NODE = 8  # GPUs a node holds by default: an HGX / DGX board of 8, each with its own NIC


@dataclass(frozen=True)
class Link:
    """A collective's cost: ``latency_s`` per message step plus bytes at ``bandwidth`` bytes/s."""

    latency_s: float
    bandwidth: float


@dataclass(frozen=True)
class Device:
    name: str
    memory: float  # bytes per device
    flops: float  # FLOP/s one rank's matmuls sustain
    pass_s: float  # fixed cost of one block's forward + backward on one microbatch
    split_s: (
        float  # what a block pass costs more when its backward is split into B and W (zb_h1, zbv)
    )
    memory_bandwidth: float  # bytes/s the optimizer step streams state at
    intra: Link  # between devices of one node
    inter: Link | None  # between nodes (None: one node only)
    cores: int | None = None  # CPU: the ranks share these cores; None: one device per rank
    per_node: int = 8  # devices a node holds (PER_NODE for the catalogue's GPUs)
    dispatch: str = "all-to-all"  # how the EP dispatch is priced (plan/cost.py DISPATCHERS)
    # optimizer offload: bytes/s each way between the device and host memory, and the share of the
    # host's memory bandwidth the CPU optimizer step gets per device (None: the device is the host)
    host_link: float | None = None
    host_share: float | None = None
    host_memory_per_node: float | None = None  # bytes of host memory a node has (None: unknown)

    @property
    def host_link_bandwidth(self) -> float:
        return self.host_link if self.host_link is not None else self.memory_bandwidth

    @property
    def host_memory_bandwidth(self) -> float:
        return self.host_share if self.host_share is not None else self.memory_bandwidth


# The backward split's extra fixed cost on a GPU, an assumption (not measured: no GPU here): W's
# direct node calls and its second autograd call, about half of one block pass's launches.
GPU_SPLIT_SHARE = 0.5

# Share of the dense bf16 peak that large training matmuls reach: an assumption (published MFU of
# well-tuned MoE training runs is 30-50%), not a measurement on these cards.
MATMUL_EFFICIENCY = 0.5

# Datasheet peaks: NVIDIA H100 SXM5 (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s
# both directions = 450 GB/s each way) and A100 SXM4 80GB (312 TFLOP/s, 2.04 TB/s HBM2e, NVLink 3
# 600 GB/s both ways = 300 each way); across nodes one 400 Gb/s (H100, NDR) or 200 Gb/s (A100, HDR)
# InfiniBand adapter per GPU, 50 and 25 GB/s. Latencies are order-of-magnitude NCCL figures (about
# 10 us on NVLink, 20 us over InfiniBand), an assumption. Peaks, so predicted traffic is optimistic.
GPUS = {
    "h100-80gb": Device(
        "h100-80gb", 80 * GB, 989e12 * MATMUL_EFFICIENCY, 50e-6, 50e-6 * GPU_SPLIT_SHARE, 3.35e12,
        Link(10e-6, 450 * GB), Link(20e-6, 50 * GB),
    ),
    "a100-80gb": Device(
        "a100-80gb", 80 * GB, 312e12 * MATMUL_EFFICIENCY, 50e-6, 50e-6 * GPU_SPLIT_SHARE, 2.04e12,
        Link(10e-6, 300 * GB), Link(20e-6, 25 * GB),
    ),
}  # fmt: skip
# Optimizer offload's host side, datasheet peaks like the above. Host link: the PCIe slot each GPU
# sits on, Gen5 x16 for H100/H200 SXM (128 GB/s both directions = 64 each way) and Gen4 x16 for A100
# SXM4 (32 each way). Host memory: the reference boards' CPUs over their 8 GPUs: DGX H100, 2 x Xeon
# Platinum 8480C with 8 channels of DDR5-4800 each (2 x 307 = 614 GB/s, 77 GB/s a GPU) and 2 TB;
# DGX A100, 2 x EPYC 7742 with 8 channels of DDR4-3200 each (2 x 205 = 410 GB/s, 51 GB/s a GPU)
# and 1 TB. Peaks: a CPU AdamW that does not stream at memory speed (torch's for-loop one) is slower.
GPUS["h100-80gb"] = replace(
    GPUS["h100-80gb"], host_link=64 * GB, host_share=614 * GB / 8, host_memory_per_node=2000 * GB
)
GPUS["a100-80gb"] = replace(
    GPUS["a100-80gb"], host_link=32 * GB, host_share=410 * GB / 8, host_memory_per_node=1000 * GB
)
# the same chips with other memory: A100 40GB (1.56 TB/s HBM2), H200 (141 GB, 4.8 TB/s HBM3e)
GPUS["a100-40gb"] = replace(
    GPUS["a100-80gb"], name="a100-40gb", memory=40 * GB, memory_bandwidth=1.56e12
)
GPUS["h200-141gb"] = replace(
    GPUS["h100-80gb"], name="h200-141gb", memory=141 * GB, memory_bandwidth=4.8e12
)

# gloo over loopback on this 2-core box (python -m lightning_titan.plan.devices, 2026-12-01, load
# average 4-5 from other jobs): a 1 kB all-reduce on 2 ranks took 0.35 and 2.8 ms in two runs, a
# 16 MB one 10 and 15 ms (1.5 and 1.1 GB/s of ring traffic).
GLOO_LOOPBACK = Link(latency_s=3e-4, bandwidth=1.2 * GB)
CPU_MEMORY_BANDWIDTH = 4 * GB  # AdamW's foreach step over fp32 state, measured order of magnitude


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pass_seconds(n_experts: int, top_k: int, repeats: int = 5) -> tuple[float, float]:
    """Best times, per block, of a forward + backward on a tiny input (1 sequence of 8 tokens): the
    fixed cost a block pays per microbatch whatever its size (a small model with the same experts);
    and how much more the same pass costs with its backward split into B and W
    (``parallel/pipeline/backward_split.py``, what zb_h1 and zbv run) on a stage that takes hidden states."""
    from lightning_titan.model.decoder import ModelConfig, StageModel
    from lightning_titan.parallel.pipeline import backward_split

    config = ModelConfig(
        vocab_size=32,
        d_model=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=32,
        n_experts=n_experts,
        top_k=top_k,
        seq_len=8,
    )
    model = StageModel(config, pp_rank=0, pp=1)
    middle = StageModel(replace(config, n_layers=3), pp_rank=1, pp=3)  # one block, no ends
    tokens, hidden = torch.randint(0, 32, (1, 8)), torch.randn(1, 8, 32)

    def whole() -> None:
        logits, aux = model(tokens)
        (logits.float().sum() + aux.sum()).backward()

    def middle_pass(split: bool) -> None:
        x = hidden.clone().requires_grad_()
        out, aux = middle(x)
        objective = out.sum() + aux.sum()
        if split:
            backward_split.split(objective, x, list(middle.parameters()))[1].run()
        else:
            objective.backward()

    def best(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    pass_s = best(whole) / (config.n_layers + 1)  # the embedding and head count as about one block
    split_s = best(lambda: middle_pass(True)) - best(lambda: middle_pass(False))
    return pass_s, max(0.0, split_s)


def cpu_device(ranks: int, n_experts: int, top_k: int, memory: float) -> Device:
    """This machine for ``ranks`` ranks: each gets its share of the cores as threads (the launcher's
    split), and the ranks share the cores when there are more of them."""
    cores = cpu_cores()
    threads = max(1, cores // ranks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = matmul_peak(torch.device("cpu"), torch.float32, n=512, seconds=0.2)
        pass_s, split_s = pass_seconds(n_experts, top_k)
    finally:
        torch.set_num_threads(before)
    return Device(
        f"cpu ({threads} thread{'s' * (threads > 1)}/rank, {cores} cores)",
        memory,
        flops,
        pass_s,
        split_s,
        CPU_MEMORY_BANDWIDTH,
        GLOO_LOOPBACK,
        None,
        cores,
        per_node=ranks,
    )


def on_nodes(device: Device, devices: int, nodes: int) -> Device:
    """``device`` with ``devices / nodes`` of them per node; names what does not divide."""
    if nodes < 1 or devices % nodes:
        raise ValueError(f"--nodes={nodes} must divide --devices={devices} (devices per node)")
    if nodes > 1 and device.inter is None:
        raise ValueError(f"--nodes={nodes}: {device.name} has no inter-node link in the catalogue")
    return replace(device, per_node=devices // nodes)


def _gloo_probe(rank: int, world: int) -> tuple[float, float]:
    import torch.distributed as dist

    out = []
    for numel in (256, 4 * 2**20):
        t = torch.ones(numel)
        dist.all_reduce(t)
        best = float("inf")
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - start)
        out.append(best)
    return out[0], out[1]


def main() -> None:
    from lightning_titan.runtime.launch import run_on_ranks

    for ranks in (1, 2, 4):
        d = cpu_device(ranks, 8, 2, 0)
        print(
            f"{ranks} ranks: {d.name}: {d.flops / 1e9:.1f} GFLOP/s, pass {d.pass_s * 1e3:.2f} ms, "
            f"split backward +{d.split_s * 1e3:.2f} ms"
        )
    small, large = run_on_ranks(_gloo_probe, 2, timeout_s=120)[0]
    print(
        f"gloo 2 ranks: 1 kB all-reduce {small * 1e3:.3f} ms, 16 MB {large * 1e3:.1f} ms "
        f"({2 * 16e6 / 2 / large / GB:.2f} GB/s ring bus bandwidth)"
    )


if __name__ == "__main__":
    main()
