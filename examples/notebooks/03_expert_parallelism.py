"""Source of 03_expert_parallelism.ipynb (python examples/notebooks/build.py turns it into the notebook)."""

# %% [markdown]
# # 3. Expert parallelism: routing, the two all-to-alls, expert load
#
# A Mixture-of-Experts layer replaces one feed-forward network with `E` of them ("experts") and a
# **router** that sends each token to its top-`K`. Only `K` experts run per token, so compute stays
# small while parameters grow with `E`. Expert parallelism (EP) splits the experts over `EP` ranks:
# rank `e` owns experts `[e*E/EP, (e+1)*E/EP)`, every rank keeps its own tokens and a full copy of
# the router, and tokens travel to the rank that owns their expert and back.
#
# This notebook follows one small batch through that trip — route, pack, **count exchange**, **payload
# exchange**, compute, return — first in one process, then on 4 real EP ranks, and checks the result
# against the single-process layer. Then it trains the default model under `ep=2` and plots how evenly
# the router spreads tokens over the experts of each layer.
#
# **Time:** under a minute on a 2-core laptop CPU (39 s measured on 2 vCPUs).

# %%
import logging
import os
import warnings
from pathlib import Path

import lightning as L
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from lightning.pytorch.loggers import CSVLogger
from matplotlib.patches import Rectangle

from lightning_titan import ModelConfig, ParallelDims, TitanDataModule, TitanLM, TitanStrategy
from lightning_titan.lightning.callbacks import ExpertLoad
from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.model.moe.router import route
from lightning_titan.parallel.dispatch import combine, dispatch
from lightning_titan.parallel.mesh import build_process_groups
from lightning_titan.runtime.launch import run_on_ranks

QUICK = os.environ.get("TITAN_NOTEBOOK_QUICK") == "1"  # the test suite sets it: a few steps only
TRAIN_STEPS = 6 if QUICK else 100
RUNS = Path("runs/03_expert_parallelism")

D, FFN, E, K = 16, 32, 8, 2  # a toy layer: 8 experts, top-2
T = 12  # tokens per rank

# the forked ranks inherit these: keep their output to what matters here
for logger in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(logger).setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec).*")

# %% [markdown]
# ## 1. Routing
#
# The router is one linear map `D -> E`. A softmax over its logits gives each token a probability per
# expert; the top-`K` are kept and their probabilities renormalised to sum to 1 — these are the
# weights that mix the `K` expert outputs (Mixtral's recipe).

# %%
torch.manual_seed(0)
layer = MoELayer(D, FFN, E, K)  # every expert here: no EP group
x = torch.randn(1, T, D)
routing = route(layer.router(x), K)
probs = torch.softmax(layer.router(x).float(), dim=-1)[0].detach()

fig, ax = plt.subplots(figsize=(7, 4))
ax.imshow(probs, cmap="Blues")
for t in range(T):
    for k in range(K):
        e = int(routing.expert_ids[t, k])
        ax.add_patch(
            Rectangle((e - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="crimson", linewidth=2)
        )
        ax.text(e, t, f"{routing.weights[t, k]:.2f}", ha="center", va="center", fontsize=7)
ax.set_xlabel("expert")
ax.set_ylabel("token")
ax.set_title("router probabilities; boxes: top-2 with their mixing weights")
plt.show()

# %% [markdown]
# ## 2. Packing, in one process
#
# Each token has `K` assignments, `T*K` in all, in token order. `dispatch` sorts them by expert id (a
# stable sort, no Python loop over experts): the rows of expert 0 come first, then expert 1, and so on.
# Because experts are numbered by owner, **expert-major is also destination-rank-major** — exactly the
# layout an all-to-all wants. `combine` undoes the sort and sums each token's `K` outputs with its
# router weights.

# %%
tokens = x.reshape(T, D)
rows, plan = dispatch(tokens, routing.expert_ids, E)
token_of_row = (plan.order // K).tolist()
counts = plan.tokens_per_expert.tolist()
print("assignments per expert:", counts)
start = 0
for e, n in enumerate(counts):
    print(f"  expert {e}: tokens {token_of_row[start : start + n]}")
    start += n

out = combine(layer.experts(rows, plan.tokens_per_local_expert), routing.weights, plan)
reference, _ = layer(x)
torch.testing.assert_close(out, reference[0])
print("route -> dispatch -> experts -> combine == MoELayer.forward")

# %% [markdown]
# ## 3. The exchange on 4 EP ranks
#
# Now 4 forked processes form one EP group; each owns `E/4 = 2` experts and routes **its own 12
# tokens**. On every rank `dispatch`:
#
# 1. counts its assignments per global expert; viewed as `[EP, E/EP]` that is how many rows it sends
#    to each local expert of each rank (`send_matrix`);
# 2. **count exchange**: one small `all_to_all` of those counts, so every rank learns how many rows will
#    arrive from each source (`recv_matrix`) and can size its buffer;
# 3. **payload exchange**: `all_to_all` of the rows themselves, with those split sizes (differentiable: its
#    backward is the reverse exchange);
# 4. reorders the arrivals from source-major to local-expert-major, so each local expert's rows are
#    contiguous.
#
# `combine` runs 4 -> 3 in reverse. To *see* the payload we also dispatch each token's label
# `rank * 100 + token` through the same plan. Every rank builds the same full layer from the same seed
# and keeps only its experts, so we can compare the EP output with the full layer on the same tokens.
#
# `run_forked` starts gloo ranks with `lightning_titan.runtime.launch.run_on_ranks` by fork, so the ranks see
# functions defined in this notebook. Training launches through the Trainer instead.

# %%
EP = 4


def run_forked(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` on forked gloo ranks (they see this notebook's functions)."""
    return run_on_ranks(fn, world_size, *args, timeout_s=120, start_method="fork")


def exchange(rank: int, world_size: int) -> dict:
    group = build_process_groups(ParallelDims(1, 1, world_size, rank)).ep
    torch.manual_seed(0)
    full = MoELayer(D, FFN, E, K)  # the same full layer on every rank ...
    lo, hi = rank * E // world_size, (rank + 1) * E // world_size
    mine = MoELayer(
        D, FFN, E, K, expert_range=(lo, hi), ep_group=group
    )  # ... and this rank's slice
    mine.router.load_state_dict(full.router.state_dict())
    for name in ("w1", "w2", "w3"):
        getattr(mine.experts, name).data.copy_(getattr(full.experts, name)[lo:hi])

    x = torch.randn(
        1, T, D, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True
    )
    routing = route(mine.router(x), K)
    labels = (rank * 100 + torch.arange(T, dtype=torch.float32)).unsqueeze(1)
    arrived, plan = dispatch(labels, routing.expert_ids, E, group)

    out, _ = mine(x)  # route, dispatch, local experts, combine, over the group
    out.square().sum().backward()  # the gradient travels back through both all-to-alls
    grad_ep, x.grad = x.grad, None
    reference, _ = full(x)  # all experts, this rank's tokens, no communication
    reference.square().sum().backward()
    return {
        "send_matrix": plan.tokens_per_expert.view(world_size, -1).tolist(),
        "recv_splits": plan.recv_splits,
        "per_local_expert": plan.tokens_per_local_expert,
        "arrived": arrived.flatten().int().tolist(),
        "out_error": (out - reference).abs().max().item(),
        "grad_error": (grad_ep - x.grad).abs().max().item(),
    }


results = run_forked(exchange, EP)

# %% [markdown]
# **The count exchange.** Row `src`, column `dst`: rows rank `src` sends to rank `dst`. What each rank
# *receives* (`recv_splits`, learned through the count all-to-all) must be that matrix's column.

# %%
sent = np.array([[sum(per_expert) for per_expert in r["send_matrix"]] for r in results])
for dst, r in enumerate(results):
    assert r["recv_splits"] == sent[:, dst].tolist(), dst
per_expert = np.array([np.ravel(r["send_matrix"]) for r in results])  # [src, global expert]

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.5), gridspec_kw={"width_ratios": [1, 1.8]})
ax1.imshow(sent, cmap="Oranges")
for (src, dst), n in np.ndenumerate(sent):
    ax1.text(dst, src, n, ha="center", va="center")
ax1.set_xticks(range(EP))
ax1.set_yticks(range(EP))
ax1.set_xlabel("destination rank")
ax1.set_ylabel("source rank")
ax1.set_title(f"rows per (source, destination): {T * K} sent by each rank")
ax2.imshow(per_expert, cmap="Oranges")
for (src, e), n in np.ndenumerate(per_expert):
    ax2.text(e, src, n, ha="center", va="center")
for owner in range(1, EP):
    ax2.axvline(owner * E // EP - 0.5, color="black")
ax2.set_xticks(range(E))
ax2.set_yticks(range(EP))
ax2.set_xlabel("global expert (vertical lines: owner boundaries)")
ax2.set_title("the same rows per global expert: the send matrices")
plt.show()

# %% [markdown]
# **The payload exchange.** Each rank's arrivals, split by local expert. A label `r*100 + t` is token
# `t` of rank `r`: every local expert gets rows from every source, sources in rank order.

# %%
for rank, r in enumerate(results):
    lo = rank * E // EP
    start = 0
    for j, n in enumerate(r["per_local_expert"]):
        labels = [f"r{label // 100}:t{label % 100}" for label in r["arrived"][start : start + n]]
        print(f"rank {rank}, expert {lo + j}: {' '.join(labels)}")
        start += n

# %% [markdown]
# **Same numbers as one process.** The EP layer's output, and the gradient that flowed back through
# both all-to-alls to each rank's input, equal the full layer's on the same tokens.

# %%
for rank, r in enumerate(results):
    assert r["out_error"] < 1e-6 and r["grad_error"] < 1e-6, (rank, r["out_error"], r["grad_error"])
print(
    "max |EP - full| output:",
    max(r["out_error"] for r in results),
    "grad:",
    max(r["grad_error"] for r in results),
)

# %% [markdown]
# ## 4. Expert load per layer, while training
#
# Does the router spread tokens evenly? The default model adds Mixtral's load-balancing loss
# (`aux_loss_coef=0.01`), which pushes the share of assignments per expert towards `1/E`. The
# `ExpertLoad` callback (from `lightning_titan.lightning.callbacks`) counts each MoE layer's assignments per
# expert on every rank during the training forwards, sums them over the whole world in one all-reduce
# (each rank counts its own tokens in its own stage's layers), and logs every expert's share of every
# layer as `expert_load/layer{l}/expert{e}`, plus `expert_load/layer{l}/max_over_mean`.
#
# Training happens in this kernel on 2 forked ranks, `TitanStrategy(dp=1, pp=1, ep=2)`; the shares come
# back through the CSV log.

# %%
config = ModelConfig()
trainer = L.Trainer(
    accelerator="cpu", devices=2, max_steps=TRAIN_STEPS,
    strategy=TitanStrategy(dp=1, pp=1, ep=2, gradient_clip_norm=1.0, start_method="fork"),
    callbacks=[ExpertLoad(plot_path=None)], logger=CSVLogger(RUNS, name="ep2", version=0),
    log_every_n_steps=1, limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip
trainer.fit(
    TitanLM(config), datamodule=TitanDataModule(seq_len=config.seq_len, global_batch_size=16)
)

# %%
metrics = pd.read_csv(RUNS / "ep2" / "version_0" / "metrics.csv")
metrics = metrics.dropna(subset=["expert_load/layer0/expert0"]).set_index("step")
load = np.stack([
    metrics[[f"expert_load/layer{layer}/expert{e}" for e in range(config.n_experts)]].to_numpy()
    for layer in range(config.n_layers)
], axis=1)  # [step, layer, expert]  # fmt: skip
assert np.allclose(load.sum(axis=2), 1.0)

fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
for ax, index, title in ((axes[0], 0, "first step"), (axes[1], -1, f"step {metrics.index[-1]}")):
    image = ax.imshow(load[index], cmap="viridis", vmin=0, vmax=load.max())
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"share of assignments, {title}")
fig.colorbar(image, ax=axes[:2], shrink=0.8, label=f"share (even = 1/{config.n_experts})")
for layer in range(config.n_layers):
    imbalance = metrics[f"expert_load/layer{layer}/max_over_mean"]
    axes[2].plot(imbalance.index, imbalance, label=f"layer {layer}")
axes[2].axhline(1.0, color="black", linestyle=":")
axes[2].set_xlabel("step")
axes[2].set_ylabel("busiest expert / mean")
axes[2].set_title("imbalance per layer")
axes[2].legend(fontsize=8)
plt.show()

# %% [markdown]
# With top-2 routing one expert can take at most half of a layer's assignments: a busiest/mean of
# `E/2 = 4` is total collapse onto a few experts. Early in training the router drifts towards that; over
# a longer run (run without `TITAN_NOTEBOOK_QUICK=1`: 100 steps) the balancing loss pulls every layer back
# towards 1.
#
# The busiest expert sets the pace: its owner computes longest while the other EP ranks wait at the
# return all-to-all. That is why the balancing loss matters more under EP than in one process. Next:
# all three axes at once in [04_train_in_3d](04_train_in_3d.ipynb).
