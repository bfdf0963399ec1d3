"""Source of 01_mesh.ipynb (python examples/notebooks/build.py turns it into the notebook)."""

# %% [markdown]
# # 1. The mesh: who is who in a (dp, pp, ep) = (2, 2, 2) run
#
# `TitanStrategy(dp=2, pp=2, ep=2)` runs 8 processes ("ranks"). Each rank gets three coordinates:
#
# - **dp_rank** — which *replica* of the whole model it belongs to (data parallelism),
# - **pp_rank** — which *pipeline stage* (a contiguous slice of layers) it runs,
# - **ep_rank** — which *slice of the experts* it holds inside its stage (expert parallelism).
#
# The convention is fixed: `ep_rank` changes fastest, then `pp_rank`:
#
# $$\text{rank} = (\text{dp\_rank}\cdot PP + \text{pp\_rank})\cdot EP + \text{ep\_rank}$$
#
# (With `tp` and `cp` as well, `tp_rank` changes fastest, then `cp_rank`; here both are 1.) This notebook
# builds that layout, draws the four kinds of process groups that carry its traffic (of the nine kinds
# the strategy builds: `docs/concepts.md`), shows which parameters each rank owns, and then creates the
# groups for real on 8 CPU processes to check them. Nothing here trains.
#
# **Time:** about 20 s on a 2-core laptop CPU (18 s measured on 2 vCPUs).

# %%
import logging

import lightning as L
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from matplotlib.patches import Rectangle

from lightning_titan import ModelConfig, ParallelDims, StageModel, TitanStrategy
from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.parallel.mesh import GROUP_KINDS, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks

DP, PP, EP = 2, 2, 2
for logger in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(logger).setLevel(logging.ERROR)

# %% [markdown]
# ## Coordinates
#
# `ParallelDims` is pure logic: give it the degrees and a rank, it answers with coordinates and
# neighbours. `data_rank = dp_rank * EP + ep_rank` says which shard of the global batch a rank reads:
# all stages of one pipeline read the same shard (stage 0 uses the tokens, the last stage the targets),
# and the EP ranks of a stage read *different* shards — that is why EP also multiplies the data
# parallelism.

# %%
dims = [ParallelDims(DP, PP, EP, rank) for rank in range(DP * PP * EP)]
print("rank  (dp, pp, ep)  data_rank  prev_stage  next_stage")
for d in dims:
    coords = (d.dp_rank, d.pp_rank, d.ep_rank)
    print(
        f"{d.rank:>4}  {coords!s:>12}  {d.data_rank:>9}  {d.prev_stage_rank!s:>10}  "
        f"{d.next_stage_rank!s:>10}"
    )
assert all(d.rank_of(d.dp_rank, d.pp_rank, d.ep_rank) == d.rank for d in dims)

# %% [markdown]
# ## The group kinds
#
# Every collective runs inside one group. A group kind fixes some coordinates and lets the others vary
# (here tp = cp = 1; the tensor- and context-parallel axes, the fastest, add their own groups and
# widen some of these: see docs/concepts.md):
#
# | group | fixed | varies | used for |
# |---|---|---|---|
# | `ep` | dp, pp | ep | token all-to-all inside one stage of one replica |
# | `pp` | dp, ep | pp | activations forward, activation-grads backward |
# | `expert_dp` | pp, ep | dp (and tp) | all-reduce of expert grads (same experts, other replica) |
# | `non_expert_dp` | pp | dp, ep | all-reduce of everything else (attention, norms, router) |
# | `sequence_dp` | pp | dp, ep (and tp) | under TP: the norms and routers, whole on every TP rank |
# | `model` | dp (and cp) | pp, ep (and tp) | the gradient-norm sum over one replica |
# | `tp`, `cp`, `sequence` | | tp; cp; cp and tp | under TP / CP only (one rank each here) |
#
# The `non_expert_dp` line is the subtle one: attention weights are *replicated* across the EP ranks of
# a stage (only experts are split), so they are averaged over DP *and* EP. With tp = 1, `sequence_dp`
# is the same ranks as `non_expert_dp`; the pictures show the first four kinds.
#
# In the pictures below each column is a data rank and each row a pipeline stage; one color is one group.


# %%
def draw_groups(dims: ParallelDims, ax_row) -> None:
    colors = plt.get_cmap("tab10").colors
    for ax, kind in zip(ax_row, GROUP_KINDS[:4], strict=True):
        groups = dims.all_groups(kind)
        for g, ranks in enumerate(groups):
            for rank in ranks:
                d, p, e = dims.coords_of(rank)
                x, y = d * dims.ep + e, dims.pp - 1 - p
                ax.add_patch(
                    Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colors[g % 10], alpha=0.8)
                )
                ax.text(
                    x + 0.5,
                    y + 0.5,
                    f"r{rank}\n({d},{p},{e})",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
        for boundary in range(1, dims.dp):  # replica boundaries
            ax.axvline(boundary * dims.ep, color="black", linestyle="--", linewidth=1)
        ax.set_xlim(0, dims.dp * dims.ep)
        ax.set_ylim(0, dims.pp)
        ax.set_xticks([i + 0.5 for i in range(dims.dp * dims.ep)], range(dims.dp * dims.ep))
        ax.set_yticks(
            [i + 0.5 for i in range(dims.pp)], [f"stage {s}" for s in reversed(range(dims.pp))]
        )
        ax.set_xlabel("data rank (dashed: replica boundary)")
        ax.set_title(f"{kind}: {len(groups)} groups of {len(groups[0])}")


fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
draw_groups(dims[0], axes)
fig.suptitle("(dp, pp, ep) = (2, 2, 2): one color = one group", y=1.02)
plt.show()

for kind in GROUP_KINDS:
    print(f"{kind:>14}: {dims[0].all_groups(kind)}")

# %% [markdown]
# ## Which parameters each rank owns
#
# Every layout builds slices of **the same full model**, under global names: stage `p` of `PP` holds
# layers `[p*L/PP, (p+1)*L/PP)`, the embedding lives on the first stage and the LM head on the last; in
# every MoE layer, EP rank `e` holds experts `[e*E/EP, (e+1)*E/EP)` stacked on a leading dimension. The
# DP replicas hold identical copies. `StageModel` builds exactly one rank's slice, so we can build all
# eight here, in this one process.

# %%
config = ModelConfig()  # the default model: 4 layers, 8 experts, top-2
print(config)

rows = []
for d in dims:
    stage = StageModel(config, pp_rank=d.pp_rank, pp=d.pp, ep_rank=d.ep_rank, ep=d.ep)
    expert, non_expert = split_expert_parameters(stage)
    rows.append({
        "rank": d.rank,
        "coords": (d.dp_rank, d.pp_rank, d.ep_rank),
        "layers": stage.layer_range,
        "experts": stage.expert_range,
        "first/last": " ".join(name for name in ("embed", "lm_head") if hasattr(stage, name)),
        "expert": sum(p.numel() for _, p in expert),
        "non_expert": sum(p.numel() for _, p in non_expert),
    })  # fmt: skip

print(
    f"{'rank':>4} {'(dp,pp,ep)':>10} {'layers':>8} {'experts':>8} {'holds':>14} {'expert':>8} {'other':>8}"
)
for r in rows:
    print(
        f"{r['rank']:>4} {r['coords']!s:>10} {r['layers']!s:>8} {r['experts']!s:>8} "
        f"{r['first/last']:>14} {r['expert']:>8,} {r['non_expert']:>8,}"
    )

# %% [markdown]
# Check the bookkeeping against the full model: one replica's ranks together hold every expert parameter
# exactly once, and one EP rank per stage holds every other parameter exactly once.

# %%
full = StageModel(config)
full_expert, full_non_expert = (
    sum(p.numel() for _, p in group) for group in split_expert_parameters(full)
)
replica0 = [r for r in rows if r["coords"][0] == 0]
assert sum(r["expert"] for r in replica0) == full_expert
assert sum(r["non_expert"] for r in replica0 if r["coords"][2] == 0) == full_non_expert
print(
    f"full model: {full_expert:,} expert + {full_non_expert:,} other = {full_expert + full_non_expert:,}"
)

fig, ax = plt.subplots(figsize=(8, 3))
ranks = [r["rank"] for r in rows]
ax.bar(ranks, [r["non_expert"] for r in rows], label="non-expert (replicated over dp and ep)")
ax.bar(
    ranks,
    [r["expert"] for r in rows],
    bottom=[r["non_expert"] for r in rows],
    label="expert (split over ep)",
)
ax.axhline(
    full_expert + full_non_expert, color="black", linestyle=":", label="full model on one rank"
)
ax.set_xlabel("rank")
ax.set_ylabel("parameters")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **Layout-free initialisation.** Each parameter's initial value depends only on the seed, its global
# name and (for experts) its global expert id. So rank 5 = (dp 1, stage 0, ep 1), which holds experts
# 4..7 of layers 0 and 1, starts with exactly rows 4..7 of the single-process model's expert tensors.
# This is what lets every layout train *the same model* (notebook 4) and lets a checkpoint written under
# one layout load under another.

# %%
seed = 1234
full.init_weights(seed)
d5 = dims[5]
rank5 = StageModel(config, pp_rank=d5.pp_rank, pp=PP, ep_rank=d5.ep_rank, ep=EP)
rank5.init_weights(seed)
start, end = rank5.expert_range
for name, p in rank5.named_parameters():
    reference = full.get_parameter(name)
    if name.endswith(("w1", "w2", "w3")):
        reference = reference[start:end]
    assert torch.equal(p, reference), name
print(
    f"rank 5 holds {len(list(rank5.parameters()))} tensors, experts {start}..{end - 1}: equal to the full model's"
)

# %% [markdown]
# ## What the strategy builds
#
# `TitanStrategy` checks the layout when the `Trainer` is built, before any process starts, and exposes
# the same `ParallelDims` (for rank 0 here, in the notebook's process). One degree may be `-1`: it fills
# whatever the others leave of the world. A layout that does not multiply to the world size fails with
# the numbers in the message.

# %%
trainer = L.Trainer(accelerator="cpu", devices=8, strategy=TitanStrategy(dp=-1, pp=2, ep=2, start_method="fork"),
                    logger=False, enable_progress_bar=False)  # fmt: skip
print(trainer.strategy.parallel_dims)

try:
    L.Trainer(
        accelerator="cpu", devices=8, strategy=TitanStrategy(dp=3, pp=2, ep=2, start_method="fork")
    )
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# ## The groups, for real
#
# Now 8 forked CPU processes join a gloo process group and call `build_process_groups`, the function the
# strategy uses. Each rank discovers its group of each kind by summing one-hot vectors inside it
# (an `all_reduce` over that group only) and we compare with the picture above.
#
# `run_forked` starts gloo ranks with `lightning_titan.runtime.launch.run_on_ranks` by fork, so the ranks see
# functions defined in this notebook. Training launches through the Trainer instead.


# %%
def run_forked(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` on forked gloo ranks (they see this notebook's functions)."""
    return run_on_ranks(fn, world_size, *args, timeout_s=120, start_method="fork")


def discover_groups(rank: int, world_size: int) -> dict[str, list[int]]:
    groups = build_process_groups(ParallelDims(DP, PP, EP, rank))
    found = {}
    for kind in GROUP_KINDS:
        one_hot = torch.zeros(world_size)
        one_hot[rank] = 1
        dist.all_reduce(one_hot, group=getattr(groups, kind))
        found[kind] = one_hot.nonzero().flatten().tolist()
    return found


found = run_forked(discover_groups, DP * PP * EP)
for d, mine in zip(dims, found, strict=True):
    for kind in GROUP_KINDS:
        assert mine[kind] == d.group_ranks(kind), (d.rank, kind)
print("rank  " + "  ".join(f"{kind:>14}" for kind in GROUP_KINDS))
for d, mine in zip(dims, found, strict=True):
    print(f"{d.rank:>4}  " + "  ".join(f"{mine[kind]!s:>14}" for kind in GROUP_KINDS))

# %% [markdown]
# Every rank found exactly the group the convention predicts. Next: what the `pp` groups do with their
# activations ([02_pipeline_schedules](02_pipeline_schedules.ipynb)) and what the `ep` groups do with
# their tokens ([03_expert_parallelism](03_expert_parallelism.ipynb)).
