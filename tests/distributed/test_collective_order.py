"""Collective order across groups, logged on 4 gloo ranks.

NCCL needs every rank to enqueue the collectives of different communicators in the same relative
order (a blocked kernel of one can stop the other's progress). gloo does not care, so here every
collective is logged with its group, and the logs are compared: per group, every member enters the
same sequence; per pair of groups, every rank in both interleaves them the same way. The layouts
include EP > 1 (all-to-alls in backward), a parameter that only some ranks use (its bucket cannot
become ready from a hook there), and dp2 x ep2 at zero=2 (reduce-scatters instead of all-reduces;
on gloo, all-to-alls).

Also, per step: the host reads (each a stream sync on CUDA) are a fixed number per MoE layer per
microbatch (dropless; none with expert capacity, whose dispatch sizes are static) and per bucket,
and there are no host-to-device copies (none per parameter, layer or microbatch); under CPU
autocast the all-to-all, p2p and TP sequence payloads travel in bf16.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from itertools import combinations

import pytest
import torch
import torch.distributed as dist
from engine_harness import loss_fn_for
from host_reads import HostReads, HostToDevice
from torch import nn

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

WORLD = 4
# (dp, pp, ep, zero[, tp]): zero=2 reduce-scatters its buckets in the same launch order
LAYOUTS = [(1, 2, 2, 0), (2, 1, 2, 0), (1, 1, 4, 0), (2, 2, 1, 0), (2, 1, 2, 2), (1, 1, 2, 0, 2)]
CONFIG = ModelConfig(
    vocab_size=31, d_model=16, n_layers=4, n_heads=2, ffn_dim=16, n_experts=4, top_k=2, seq_len=6
)
# the same layouts with expert capacity: the dispatch in static slots, no host read per MoE layer
CAPACITY_LAYOUTS = [(1, 1, 4, 0), (2, 1, 2, 0), (1, 2, 2, 0), (1, 1, 2, 0, 2)]
CAPACITY = replace(CONFIG, capacity_factor=1.0)
BATCH, M, STEPS = 8, 2, 3
SCATTERS = ("reduce_scatter_single", "all_to_all_single")
COLLECTIVES = (
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "reduce_scatter_single",
)
PAYLOADS = ("all_to_all_single", "all_gather_single", "isend")  # whose float dtypes are logged


class CollectiveLog:
    """Wraps torch.distributed's collectives (and the p2p sends, for their dtypes) while entered."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, tuple[int, ...]]] = []
        self.dtypes: dict[str, set[tuple[torch.dtype, tuple[int, ...]]]] = {
            name: set() for name in PAYLOADS
        }
        self._saved: dict[str, Callable] = {}

    def _wrap(self, name: str, func: Callable) -> Callable:
        signature = inspect.signature(func)

        def logged(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            tensor = next(iter(bound.arguments.values()))
            ranks = range(dist.get_world_size()) if group is None else None
            ranks = tuple(ranks or dist.get_process_group_ranks(group))
            if name in self.dtypes and tensor.is_floating_point():
                self.dtypes[name].add((tensor.dtype, ranks))
            if name in COLLECTIVES:
                self.entries.append((name, ranks))
            return func(*args, **kwargs)

        return logged

    def __enter__(self) -> CollectiveLog:
        for name in {*COLLECTIVES, *PAYLOADS}:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, func in self._saved.items():
            setattr(dist, name, func)


def _model_with_a_parameter_some_ranks_use(
    dims: ParallelDims, groups, config: ModelConfig
) -> StageModel:
    """The stage model plus ``layers.<last>.extra`` [D], added to the last local block's output on
    ranks with an even data rank only: its grad is ready there before that block's all-to-alls run
    backward, and never from a hook elsewhere. Registered last, so its bucket comes early."""
    model = StageModel(config, pp_rank=dims.pp_rank, pp=dims.pp, ep_rank=dims.ep_rank, ep=dims.ep,
                       ep_group=groups.ep, tp_group=groups.tp,
                       sequence_group=groups.sequence)  # fmt: skip
    model.init_weights(7)
    block = model.layers[str(model.layer_range[1] - 1)]
    block.extra = nn.Parameter(torch.zeros(config.d_model))
    if dims.data_rank % 2 == 0:
        block.register_forward_hook(lambda mod, args, out: (out[0] + mod.extra, out[1]))
    return model


def _run_layout(rank: int, layout: tuple[int, ...], config: ModelConfig = CONFIG) -> dict:
    dp, pp, ep, zero, *tp = layout
    dims = ParallelDims(dp, pp, ep, rank, *tp)
    groups = build_process_groups(dims)
    model = _model_with_a_parameter_some_ranks_use(dims, groups, config)
    # a bucket each
    engine = Engine(model, dims, groups, schedule="1f1b", bucket_cap_mb=1e-9, zero=zero)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.shard_optimizers([optimizer])
    train_step = TrainStep(engine, optimizer, max_norm=1.0)
    b = BATCH // dims.data_world
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))[dims.data_rank * b:][:b]  # fmt: skip
    logs, reads, copies = [], [], []
    loss_fn = loss_fn_for(model, dims)
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == STEPS - 1):
            with CollectiveLog() as log, HostReads() as step_reads, HostToDevice() as step_copies:
                marks: list[int] = []

                def forward_backward(marks=marks, reads=step_reads):
                    loss = engine.forward_backward(model, tokens[:, :-1], tokens[:, 1:], M, loss_fn)
                    marks.append(len(reads.calls))  # the reads of the forwards and backwards
                    return loss

                train_step.update(forward_backward, index=step)  # the step TitanLM runs
        logs.append(log.entries)
        fb_reads = marks[0]
        reads.append((fb_reads, len(step_reads.calls) - fb_reads))
        copies.append(step_copies.calls)
    engine.remove()
    return {
        "logs": logs,
        "reads": reads,
        "copies": copies,
        "buckets": sum(len(r.bucket_params) for r in engine.reducers),
        "layers": len(model.layers),
        "dtypes": {k: sorted((str(d), g) for d, g in v) for k, v in log.dtypes.items()},
    }


def _all_layouts(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    return [_run_layout(rank, layout) for layout in LAYOUTS] + [
        _run_layout(rank, layout, CAPACITY) for layout in CAPACITY_LAYOUTS
    ]


def _check_order(logs: list[list[tuple[str, tuple[int, ...]]]], label: str) -> None:
    """Per group, and per pair of groups, the same sequence on every rank that is in them. Groups are
    told apart by their ranks: groups with the same ranks count as one (a stricter check)."""
    groups = sorted({g for log in logs for _, g in log})
    for chosen in [*([g] for g in groups), *map(list, combinations(groups, 2))]:
        members = set(chosen[0]).intersection(*chosen[1:])
        if not members:
            continue
        seqs = {r: [e for e in logs[r] if e[1] in chosen] for r in members}
        first = seqs[min(members)]
        for r, seq in seqs.items():
            assert seq == first, f"{label}: rank {r} orders {chosen} unlike rank {min(members)}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_collective_order_host_reads_and_payload_dtypes():
    per_rank = run_on_ranks(_all_layouts, WORLD, timeout_s=360, start_method="fork")
    for i, layout in enumerate(LAYOUTS + CAPACITY_LAYOUTS):
        capacity = i >= len(LAYOUTS)
        results = [per_rank[r][i] for r in range(WORLD)]
        for step in range(STEPS):
            _check_order([r["logs"][step] for r in results], f"{layout} step {step}")
        dp, pp, ep, zero, *tp = layout
        # zero=2 reduce-scatters over a data-parallel group; on gloo as one all-to-all
        # (lightning_titan.parallel.collectives), which EP's token all-to-alls must not be taken for
        dims = ParallelDims(dp, pp, ep, 0, *tp)
        tp_groups = {tuple(g) for g in dims.all_groups("tp") if len(g) > 1}
        ep_groups = {tuple(g) for g in dims.all_groups("ep")}
        dp_groups = {tuple(g) for g in dims.all_groups("non_expert_dp") if len(g) > 1} - ep_groups
        entries = {entry for r in results for log in r["logs"] for entry in log}
        scattered = {g for name, g in entries if name in SCATTERS and g in dp_groups}
        assert bool(scattered) == (zero == 2), (layout, entries)
        for r in results:
            # one read per MoE layer per microbatch (the dispatch split sizes; with capacity none:
            # static sizes), none in backward; one per bucket to finish the gradients (its
            # used-flags), none for clipping, and the step's one read of its numbers (norm, loss,
            # aux, drops); none in the update
            per_layer = 0 if capacity else 1
            for fb, rest in r["reads"]:
                assert fb == per_layer * r["layers"] * M, (layout, capacity, r["reads"])
                assert rest == r["buckets"] + 1, (layout, capacity, r["reads"])
            # and nothing copied onto the device: no flag per parameter, no offsets per layer
            assert all(step == [] for step in r["copies"]), (layout, r["copies"])
            # the last step ran under autocast: tokens travel in bf16 (zero=2's grads stay fp32)
            tokens = {d for d, g in r["dtypes"]["all_to_all_single"] if g in ep_groups}
            if ep > 1:
                assert tokens == {"torch.bfloat16"}, (layout, r["dtypes"])
            if pp > 1:
                assert {d for d, _ in r["dtypes"]["isend"]} == {"torch.bfloat16"}, r["dtypes"]
            if tp_groups:  # sequence all-gathers and reduce-scatters (on gloo: all-to-alls)
                sequence = {
                    d for name in ("all_gather_single", "all_to_all_single")
                    for d, g in r["dtypes"][name] if g in tp_groups
                }  # fmt: skip
                assert sequence == {"torch.bfloat16"}, (layout, r["dtypes"])
