"""Train the same model on the same global batches under a layout, without Lightning.

Used by the equivalence tests: every layout must reproduce the single-process run.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch
import torch.nn.functional as F
from nccl_strict import StrictStream, strict_links
from torch.utils.checkpoint import set_checkpoint_early_stop

from lightning_titan.checkpoint import load_sharded, save_sharded
from lightning_titan.model import compiled
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.model.lora import LoRA
from lightning_titan.model.moe.capacity import expert_capacity
from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.parallel import overlap
from lightning_titan.parallel.dp.zero import ZeroShards
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.parallel.pipeline.schedules import SPLIT_BACKWARD, V_SHAPED
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX, local_slice, tp_shards
from lightning_titan.tools.bench.memory import state_bytes
from lightning_titan.train import auto_split
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

CONFIG = ModelConfig(
    vocab_size=61, d_model=32, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=24, n_experts=4, top_k=2,
    seq_len=16, aux_loss_coef=0.05, z_loss_coef=0.01,
)  # fmt: skip
# aux-loss-free balancing on top (the aux loss stays on): the bias moves selections within STEPS
BIAS_CONFIG = replace(CONFIG, router_bias_update_rate=1e-3)
# deep enough for 2 chunks on each of 4 stages (interleaved pp4 x v2)
DEEP_CONFIG = replace(CONFIG, n_layers=8)
# recompute each block in backward: the same numbers as CONFIG
ACKPT_CONFIG = replace(CONFIG, activation_checkpointing=True)
# recompute the norms and the experts' activations in backward (model/recompute.py): the same too
SELECTIVE_CONFIG = replace(CONFIG, activation_checkpointing="selective")
# expert capacity: 16 tokens x top-2 / 4 experts x 0.5 = 4 of a sequence's 32 assignments per expert
# (about half dropped: 0.75 and 1.25 drift to ~1e-5 of the norm by step 5, rounding amplified)
CAPACITY_CONFIG = replace(CONFIG, capacity_factor=0.5)
# the options of the pretrained families, from scratch: OLMoE's whole-projection QK-norm (summed over
# TP ranks) with Qwen2-MoE's q/k/v biases (cut with the rows) and shared expert, under sigmoid routing
# without renormalisation; and Qwen3-MoE's per-head QK-norm with an explicit head_dim (init_std 0.1:
# the norm divides by the rms of a 6-wide q, which at std 0.02 is so small that wq's grads amplify the
# layouts' rounding ~5x a step, past rtol 1e-5 on the grad norm by step 5; the losses agree to 1e-7)
FAMILY_CONFIGS = {
    "qk_full": replace(
        CONFIG, qk_norm="full", qkv_bias=True, shared_expert_dim=16, router_score="sigmoid",
        router_norm_topk=False,
    ),
    "qk_head": replace(
        CONFIG, qk_norm="head", attn_head_dim=6, router_norm_topk=False, init_std=0.1
    ),
    # gpt-oss: sinks, window layers (5 back), biases, the clamped SwiGLU and YaRN
    "gpt_oss": replace(
        CONFIG, attn_sinks=True, qkv_bias=True, attn_out_bias=True, sliding_window=5,
        expert_proj_bias=True, router_bias=True, swiglu_limit=1.0,
        rope_yarn={"factor": 4.0, "original_max_position_embeddings": 16}, attn_head_dim=6,
        init_std=0.1,
    ),
    # DeepSeek-V3: latent attention with a low-rank query, group-limited sigmoid routing with a
    # moving expert bias, scaled combine weights, an ungated shared expert, a dense first layer
    "deepseek": replace(
        CONFIG, n_kv_heads=None, kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, router_score="sigmoid",
        router_expert_bias=True, router_bias_update_rate=1e-3, router_groups=2,
        router_topk_groups=1, routed_scaling=2.5, dense_layers=1, dense_ffn_dim=40,
        shared_expert_dim=24, shared_expert_gated=False,
    ),
}  # fmt: skip
# adapters on every projection kind a config has (``":lora"``); the base frozen
LORA = LoRA(rank=4, alpha=8.0, targets=("attention", "experts", "shared", "mlp", "router"))
GLOBAL_BATCH = 8
STEPS = 5
SEED = 7
STRICT_DEADLINE_S = 60.0  # the NCCL-strict stream's wait for one message, at most
MAX_NORM = 0.3  # small enough that clipping bites on every step (checked against the reference)


def stage_model(
    dims: ParallelDims,
    groups: ProcessGroups,
    config: ModelConfig,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
) -> StageModel:
    """This rank's stage of the model (its layers as ``split`` says), with the layout-free init
    every layout starts from."""
    model = StageModel(
        config,
        lora=lora,
        split=split,
        pp_rank=dims.pp_rank,
        pp=dims.pp,
        ep_rank=dims.expert_rank,  # fold_ep: the place in the folded EP group
        ep=dims.expert_world,
        ep_group=groups.ep,
        tp_group=groups.tp,
        cp_group=groups.cp,
        sequence_group=groups.sequence,
    )
    model.init_weights(SEED)
    return model


def loss_fn_for(model: StageModel, dims: ParallelDims):
    """The plain cross-entropy below for one vocabulary, our vocab-parallel one under TP (which the
    comparison with the plain one then checks)."""
    return model.token_loss_sum if dims.tp > 1 else token_loss_sum


def record(model: StageModel, dims: ParallelDims) -> dict:
    """What the comparison needs to know of this rank's slice of the model."""
    expert, _ = split_expert_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    tp_dims = {names[i]: shard.dim for i, shard in tp_shards(model).items()}  # biases too
    return {
        "expert_names": {n for n, _ in expert},
        "expert_range": model.expert_range,
        "tp_dims": tp_dims,
        "tp": (dims.tp, dims.tp_rank),
        "coords": tuple(dims.coords(dims.rank).values()),
    }


def expected_slice(result: dict, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the single process's ``full`` tensor ``name`` that this rank must hold."""
    start, end = result["expert_range"]
    if name in result["expert_names"]:
        return full[start:end]
    if name in result["tp_dims"]:
        return local_slice(full, result["tp_dims"][name], *result["tp"])
    return full


def token_loss_sum(logits_MSV: torch.Tensor, targets_MS: torch.Tensor) -> torch.Tensor:
    """The objective TitanLM hands the engine, stated again here: summed token cross-entropy."""
    return F.cross_entropy(logits_MSV.float().flatten(0, 1), targets_MS.flatten(), reduction="sum")


def global_batch(
    step: int, config: ModelConfig = CONFIG, batch: int = GLOBAL_BATCH, masked: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s sequences and targets; ``masked``: targets ``IGNORE_INDEX`` at random positions,
    a share growing with the row (row 0 keeps every target, the last row none), so each rank and
    microbatch counts another number of targets, as fine-tuning batches with prompts do."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if masked:
        share = torch.linspace(0, 1, batch).unsqueeze(1)
        targets[torch.rand(targets.shape, generator=g) < share] = IGNORE_INDEX
    return inputs, targets


def global_documents(step: int, config: ModelConfig = CONFIG, batch: int = GLOBAL_BATCH):
    """Step ``step``'s document ids [B, S] of packed sequences (``model/documents.py``): each row
    cut at 1 to 3 random places (documents of 1 token too), as packed records are."""
    g = torch.Generator().manual_seed(2000 + step)
    s = config.seq_len
    starts = torch.zeros(batch, s, dtype=torch.long)
    for row in range(batch):
        cuts = torch.randperm(s - 1, generator=g)[: 1 + row % 3] + 1
        starts[row, cuts] = 1
    return starts.cumsum(dim=1)


def packed_batch(step: int, config: ModelConfig, batch: int, masked: bool, packed: bool):
    """``global_batch`` and None, or ``packed``: with its documents, and no target that is the next
    document's first token (the data's packing leaves those out: ``data/records.py``)."""
    inputs, targets = global_batch(step, config, batch, masked)
    if not packed:
        return inputs, targets, None
    documents = global_documents(step, config, batch)
    targets = targets.clone()
    targets[:, :-1][documents[:, 1:] != documents[:, :-1]] = IGNORE_INDEX
    return inputs, targets, documents


def train(
    dims: ParallelDims,
    groups: ProcessGroups,
    schedule: str,
    num_microbatches: int,
    config: ModelConfig = CONFIG,
    steps: int = STEPS,
    bucket_cap_mb: float = 0.01,
    paired_p2p: bool = False,
    zero: int = 0,
    split: StageSplit | None = None,
    strict_p2p: float | None = None,
    compile: str | None = None,
    batch: int = GLOBAL_BATCH,
    adamw: str | None = None,
    masked: bool = False,
    lora: LoRA | None = None,
    save: tuple[int, str] | None = None,
    resume: tuple[int, str] | None = None,
    packed: bool = False,
    param_dtype: str = "fp32",
    offload: bool = False,
) -> dict:
    """Run ``steps`` optimizer steps on this rank; return per-step loss/aux/norm and the local weights.

    ``paired_p2p`` runs the pipeline transport CUDA gets (each exchange posts its receive with its
    send and waits for both) on gloo, so that CPU tests cover it too; ``strict_p2p`` runs it under
    NCCL's ordering (``nccl_strict``, a stream giving up after that many seconds). ``zero`` shards
    the optimizer state over the data-parallel groups; ``split`` cuts the layers over stages and
    chunks; ``compile`` names a ``torch.compile`` backend to compile the stage with (the result's
    ``graphs``: the graphs the first step compiled, ``recompiled``: those compiled after it,
    ``graph_breaks``: the breaks Dynamo traced in the steps);
    ``adamw``: the AdamW implementation (``"foreach"``, ``"fused"``; None: torch's default);
    ``masked``: targets partly ``IGNORE_INDEX`` (``global_batch``); ``packed``: several documents a
    sequence (``packed_batch``), attention and positions per document; ``lora``: adapters on a frozen
    base (the result's ``frozen_moved``: the frozen parameters that changed at all); ``save``: (n,
    path) stop after step n with a sharded checkpoint of model and optimizer at ``path``;
    ``resume``: (n, path) start at step n from the checkpoint at ``path`` (the losses from n on);
    ``param_dtype="bf16"``: bf16 weights over fp32 masters, the step under bf16 autocast as
    Lightning's bf16-mixed runs it (the result's ``weights`` are then the masters); ``offload``:
    the optimizer steps host copies (``offload_optimizer=True``; ``device_masters_at_step``: the
    bytes the device's fp32 masters held while it stepped)."""
    torch.manual_seed(dims.rank)  # a different global RNG per rank must not matter
    model = stage_model(dims, groups, config, split, lora)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    if compile is not None:  # the torch.compile backend
        compiled.compile_stage(model, split_backward=schedule in SPLIT_BACKWARD, backend=compile)
    engine = Engine(
        model, dims, groups, schedule=schedule, bucket_cap_mb=bucket_cap_mb, zero=zero,
        param_dtype=param_dtype, offload_optimizer=offload,
    )  # fmt: skip
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=param_dtype == "bf16")
    if paired_p2p:
        make_links = engine._links

        def paired_links(stage_model, device):
            links = make_links(stage_model, device)
            links.early = False
            return links

        engine._links = paired_links
    stream = None
    if strict_p2p is not None:
        stream = StrictStream(groups.pp, strict_p2p)
        engine._links = strict_links(engine._links, stream)
    engine.broadcast_replicated()
    rows_over_capacity = watch_rows(model, config, dims)
    # Adam divides by sqrt(v) + eps: a grad element whose last bits differ (summation order differs
    # between layouts) moves its weight by up to lr * (its rounding / eps), and 5 steps compound that.
    # One process against itself (the whole batch against 2, 4 or 8 microbatches) drifted on an
    # AVX-512 box to 1.0e-5 of the grad norm and 1.1e-5 in the weights with eps=1e-6 (the 8-layer
    # model), past these tolerances before any layout added its own sums; with eps=1e-3 to 1.3e-6
    # and 1.2e-7. The grads (~1e-3 an element after clipping) still get Adam's per-element scaling.
    variant = {} if adamw is None else {adamw: True}
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1, eps=1e-3, **variant)
    engine.shard_optimizers([optimizer])
    shards = ZeroShards(engine.zero_groups, engine.masters, engine.offload)
    if resume is not None:
        with engine.whole_params():  # zero=3: loaded into the whole parameters, then the rows
            load_sharded(resume[1], model, [optimizer], zero_shards=shards)
    train_step = TrainStep(engine, optimizer, max_norm=MAX_NORM)  # the step TitanLM runs
    # what `titan bench` measures (and `titan plan` predicts), read around the optimizer's update:
    # the grads it reads, the most held (before the update or after it, before zero_grad), and
    # the state bytes by part after it
    measured = {
        "grad_bytes": 0, "state": None, "held_param_bytes": 0, "gathered_peak": 0,
        "gathered_low": None, "with_leaves_peak": 0, "device_masters_at_step": None,
        "accumulated_bytes": 0,
    }  # fmt: skip

    def before_update(*_) -> None:
        measured["grad_bytes"] = held_grad_bytes(model, optimizer, engine)
        # between steps (the grads reduced, zero=3's blocks freed): the parameters' bytes held
        measured["held_param_bytes"] = held_param_bytes(model, optimizer)
        if engine.offload is not None:  # the device masters are freed while the host steps
            held = sum(t.untyped_storage().nbytes() for t in engine.offload.freed)
            measured["device_masters_at_step"] = max(measured["device_masters_at_step"] or 0, held)

    def after_update(*_) -> None:
        measured["grad_bytes"] = max(
            measured["grad_bytes"], held_grad_bytes(model, optimizer, engine)
        )
        measured["state"] = state_bytes(model, optimizer, engine)

    optimizer.register_step_pre_hook(before_update)
    optimizer.register_step_post_hook(after_update)
    watch_gathered(model, optimizer, measured)

    def accumulated(*_) -> None:  # the grads on the parameters, at each one's accumulation (after
        # the reducers' hooks, which take a grad of the step's last backward into its bucket)
        held = sum(p.grad.nbytes for p in reduced if p.grad is not None)
        measured["accumulated_bytes"] = max(measured["accumulated_bytes"], held)

    reduced = [p for r in engine.reducers if not r._trivial for p in r.params]
    for p in trained:  # a grad no group reduces stays whole: the state's
        p.register_post_accumulate_grad_hook(accumulated)
    b = batch // dims.data_world
    handovers = overlap.handovers()
    losses, auxes, norms, dropped = [], [], [], []
    # compiled: the model's own loss, a compiled region, as TitanLM runs it (the eager runs check
    # the vocab-parallel one against the plain one)
    loss_fn = model.token_loss_sum if compile is not None else loss_fn_for(model, dims)
    graphs_at_start = graphs_after_first = compiled.graphs_compiled()
    breaks_at_start = graph_breaks()
    for step in range(resume[0] if resume else 0, save[0] if save else steps):
        inputs, targets, documents = packed_batch(step, config, batch, masked, packed)
        rows = slice(dims.data_rank * b, (dims.data_rank + 1) * b)
        with autocast:
            result = train_step.run(
                model, inputs[rows], targets[rows], num_microbatches, loss_fn, index=step,
                documents=None if documents is None else documents[rows],
            )  # fmt: skip
        losses.append(result.loss)
        auxes.append(result.aux)
        norms.append(result.grad_norm)
        dropped.append(result.dropped)
        if step == 0:
            graphs_after_first = compiled.graphs_compiled()
    if save is not None:
        layout = {"dp": dims.dp, "pp": dims.pp, "ep": dims.ep, "tp": dims.tp, "cp": dims.cp}
        with engine.whole_params():  # zero=3: the checkpoint holds the whole model's tensors
            save_sharded(save[1], model, [optimizer], {}, layout=layout, zero_shards=shards)
    recompiled = compiled.graphs_compiled() - graphs_after_first  # before the eval's own graphs
    breaks = graph_breaks() - breaks_at_start
    # validation: the trained model's forward only (the schedule's forward-only order) on batch 0
    inputs, targets, documents = packed_batch(0, config, batch, masked, packed)
    rows = slice(dims.data_rank * b, (dims.data_rank + 1) * b)
    with autocast:
        val = engine.forward_only(
            model, inputs[rows], targets[rows], num_microbatches, loss_fn_for(model, dims),
            documents=None if documents is None else documents[rows],
        )  # fmt: skip
    held_after_eval = held_param_bytes(model, optimizer)  # zero=3: the rows only again
    if stream is not None:
        stream.close()
    with engine.whole_params():  # zero=3: gathered to be read (offload: the masters filled)
        weights = {n: shards.weight(p).detach().clone() for n, p in model.named_parameters()}
        # the masters hold more than bf16 can (every one of them rounded: the updates are lost)
        masters_finer = engine.masters is None or any(
            not torch.equal(m, m.bfloat16().float())
            for m in [m for _, m in engine.masters]
            + [s.leaf.detach() for g in engine.zero_groups for s in g.shards.values() if s.master]
        )
        params_are_masters_rounded = engine.masters is None or all(
            torch.equal(p.detach(), m.detach().to(p.dtype)) for p, m in engine.masters
        )
    # bf16 weights: what each parameter holds next to its master (the parameters are the fp32
    # masters again once the engine is removed)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    master_bytes = sum(m.numel() * m.element_size() for _, m in engine.masters or ()) + sum(
        s.leaf.numel() * s.leaf.element_size()
        for g in engine.zero_groups
        for s in g.shards.values()
        if s.master
    )  # whole masters, and under ZeRO the rows'
    moment_bytes = sum(
        v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
        if v.dim() > 0
    )  # fmt: skip
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    cut = {id(s.param) for g in engine.zero_groups for s in g.shards.values()}
    blocks_cut = [_nbytes(p for p in b.parameters() if id(p) in cut) for b in model.layers.values()]
    # zero=3's block gathers from its hooks: in flight already (prefetched) or run at once
    block_gathers = None if engine.sharded_params is None else dict(engine.sharded_params.counts)
    offloaded = 0 if engine.offload is None else len(engine.offload)  # tensors the host steps
    # in the dtype the step held them (bf16 weights: the parameters are fp32 after ``remove``)
    rest_bytes = _nbytes(p for p in model.parameters() if id(p) in cut) - sum(blocks_cut)
    uncut_bytes = _nbytes(p for p in model.parameters() if id(p) not in cut)
    engine.remove()
    # the model whole and trained once the engine is gone (zero=3 gathers it: a later use, an
    # export, reads the parameters as they are)
    # (bf16 weights: each the fp32 master of what it held, its rounding; ZeRO-cut ones gathered)
    whole_after = all(
        p.untyped_storage().nbytes() == p.numel() * p.element_size()
        and torch.equal(p.detach().to(weights[n].dtype), weights[n])
        for n, p in model.named_parameters()
    )
    if engine.masters is not None:  # bf16 weights: the result's weights are the fp32 masters
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "loss": losses,
        "aux": auxes,
        "val_loss": val.loss.item(),
        "norm": norms,
        "dropped": dropped,
        "rows_over_capacity": max(rows_over_capacity, default=0.0),
        "weights": weights,
        "biases": biases,
        "state_numel": sum(v.numel() for v in moments),
        "state": measured["state"],
        "grad_bytes": measured["grad_bytes"],
        # what `titan plan` adds to the state for the step's grads (plan/memory.py step_grad_bytes)
        "accumulated_bytes": measured["accumulated_bytes"],
        "param_bytes": param_bytes,
        "master_bytes": master_bytes,
        "moment_bytes": moment_bytes,
        "masters_finer": masters_finer,
        # the dtypes the reducers sum grads in (bf16 weights: fp32 buckets)
        "reduce_dtypes": {
            b.buffer.dtype for r in engine.reducers for b in r._buckets if b.buffer is not None
        },
        "params_are_masters_rounded": params_are_masters_rounded,
        "held_param_bytes": measured["held_param_bytes"],
        "held_after_eval": held_after_eval,
        "whole_after_remove": whole_after,
        # the most parameter storage whole at once in a forward or backward, beyond the rows
        "gathered_peak": measured["gathered_peak"],
        "gathered_low": measured["gathered_low"],  # and the least (None: never looked)
        "device_masters_at_step": measured["device_masters_at_step"],
        "offloaded": offloaded,
        "with_leaves_peak": measured["with_leaves_peak"],  # the optimizer's leaves' storages too
        # zero=3's units, whole, of the parameters ZeRO cuts: the rest of the stage (embedding,
        # norm, head) and the largest block; and the bytes of those it does not cut
        "rest_bytes": rest_bytes,
        "block_bytes": max(blocks_cut, default=0),
        "two_blocks_bytes": sum(sorted(blocks_cut)[-2:]),  # the two largest (a prefetch's peak)
        "n_blocks": len(blocks_cut),
        "block_gathers": block_gathers,
        "uncut_bytes": uncut_bytes,
        # zero=3's gathers run in the backward, while ZeRO-2's reducer has borrowed the kept
        # buffer for a reduce-scatter: they must gather through another (a race gloo may not show)
        "gather_buffer_borrowed": any(
            unit.untyped_storage()._cdata == kept.untyped_storage()._cdata
            for g in engine.zero_groups
            for unit in g.unit_kept.values()
            for kept in g.kept.values()
        ),
        # zero=3's gather buffers' dtypes (bf16 weights: bf16, the masters' rows cast as packed)
        "gather_dtypes": {b.dtype for g in engine.zero_groups for b in g.unit_kept.values()},
        # dense copies of strided rows, for an optimizer that steps views wrongly (AdamW fused)
        "dense_bytes": sum(
            s.leaf.numel() * s.leaf.element_size()
            for g in engine.zero_groups
            for s in g.dense_shards
        ),
        # the most batches of sends alive (their tensors held) at once (strict_p2p only)
        "sends_in_flight": 0 if stream is None else stream.most_live_sends,
        "graphs": graphs_after_first - graphs_at_start,  # those the first step compiled
        "recompiled": recompiled,
        "graph_breaks": breaks,
        "handovers": overlap.handovers() - handovers,  # an overlapped pair's switches (overlap.py)
        "frozen_moved": [n for n, w in frozen.items() if not torch.equal(w, weights[n])],
        "trained": len(trained),
        **record(model, dims),
    }


def graph_breaks() -> int:
    """How many graph breaks Dynamo has traced in this process so far (a cached graph adds none)."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def watch_rows(model: StageModel, config: ModelConfig, dims: ParallelDims) -> list[float]:
    """A list that each MoE forward appends to: the most rows one local expert received over the
    most the capacity allows it (capacity x the microbatch's sequences x the EP group's ranks: each
    sends its static slots, ``parallel/slots.py``, so under fold_ep a TP rank's slice of a sequence
    has its own); empty when dropless."""
    ratios: list[float] = []
    if config.capacity_factor is None:
        return ratios
    limit = expert_capacity(config.capacity_factor, config.seq_len, config.top_k, config.n_experts)

    def hook(layer: MoELayer, inputs: tuple, output: object) -> None:
        sequences = inputs[0].shape[0]
        ratios.append(max(layer.rows_per_local_expert) / (limit * sequences * dims.expert_world))

    for m in model.modules():
        if isinstance(m, MoELayer):
            m.register_forward_hook(hook)
    return ratios


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages ``tensors`` live in (zero=3 frees a parameter's: 0 bytes)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage._cdata] = storage.nbytes()  # the StorageImpl's address
    return sum(storages.values())


def held_param_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages the model's parameters and the optimizer's (ZeRO's leaves) live in."""
    leaves = [p for g in optimizer.param_groups for p in g["params"]]
    return storage_bytes([*model.parameters(), *leaves])


def watch_gathered(model: StageModel, optimizer: torch.optim.Optimizer, measured: dict) -> None:
    """``measured["gathered_peak"]`` (``"gathered_low"``): the most (least) bytes of the model's
    parameter storages seen at a block's forward (after its gather) and at each parameter's grad
    accumulation in a backward; ``"with_leaves_peak"``: the most with the optimizer's leaves (ZeRO's
    rows) counted too."""
    leaves = [p for g in optimizer.param_groups for p in g["params"]]

    def look(*_) -> None:
        now = storage_bytes(model.parameters())
        measured["gathered_peak"] = max(measured["gathered_peak"], now)
        low = measured["gathered_low"]
        measured["gathered_low"] = now if low is None else min(low, now)
        with_leaves = storage_bytes([*model.parameters(), *leaves])
        measured["with_leaves_peak"] = max(measured["with_leaves_peak"], with_leaves)

    for block in model.layers.values():
        block.register_forward_pre_hook(look)  # after the engine's (registered first): gathered
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(look)


def held_grad_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: Any) -> int:
    """Bytes of every distinct storage that a grad this rank holds lives in: the model's grads, the
    optimizer's (ZeRO shards) and, as the shard grads are views into it, a storage counted once;
    and the reducers' buckets (zero <= 1: the reduced grads are views of them), their grads only
    (the flags after them left out)."""
    tensors = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
    storages = {}
    for t in tensors:
        if t.grad is not None:
            storage = t.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    for r in engine.reducers:
        for b in r._buckets:
            if b.buffer is not None:
                storages[b.buffer.untyped_storage().data_ptr()] = b.numel * b.buffer.element_size()
    return sum(storages.values())


def reference(
    config: ModelConfig = CONFIG,
    steps: int = STEPS,
    batch: int = GLOBAL_BATCH,
    masked: bool = False,
    lora: LoRA | None = None,
    packed: bool = False,
    param_dtype: str = "fp32",
    offload: bool = False,
) -> dict:
    """The single-process run: one rank, whole batch, one microbatch, no process group."""
    dims = ParallelDims(1, 1, 1, 0)
    groups = ProcessGroups(None, None, None, None)
    return train(
        dims, groups, "gpipe", 1, config, steps, batch=batch, masked=masked, lora=lora,
        packed=packed, param_dtype=param_dtype, offload=offload,
    )  # fmt: skip


def run_layouts(
    rank: int, world_size: int, cases: list[tuple], ckpt_dir: str | None = None
) -> list[dict]:
    """Spawned: every case (layout (dp, pp, ep), (dp, pp, ep, tp) or (dp, pp, ep, tp, cp), schedule,
    M[, config]) in turn, on the same ranks; a schedule named ``"<name>:paired"`` runs with
    ``paired_p2p``, ``"<name>:strict"`` with ``strict_p2p``, ``"<name>:zero1"`` with ``zero=1`` (``zero2``...), ``"<name>:v2"`` with two
    chunks per rank, ``"<name>:layers=3-1"`` with ``stage_layers=[3, 1]``, ``"<name>:auto"`` with the
    split probed on rank 0, ``"<name>:compile=aot_eager"`` compiled with that backend, ``"<name>:batch=16"``
    on global batches of 16 sequences (``reference(batch=16)``), ``"<name>:adamw=fused"`` with
    ``AdamW(fused=True)`` (``foreach``), ``"<name>:masked"`` on targets partly ignored
    (``reference(masked=True)``), ``"<name>:packed"`` on packed documents (``reference(packed=True)``),
    ``"<name>:lora"`` with ``LORA``'s adapters on a frozen base (``reference(lora=LORA)``),
    ``"<name>:save=2"`` stopping after step 2 with a checkpoint in ``ckpt_dir``,
    ``"<name>:resume=2"`` starting at step 2 from it, ``"<name>:late_stop"`` with activation
    checkpointing's recompute running each block's whole forward (torch stops it early, after the
    last tensor the backward needs), ``"<name>:bf16"`` with bf16 weights over fp32 masters
    (``reference(param_dtype="bf16")``), ``"<name>:offload"`` with the optimizer on host copies,
    ``"<name>:fold"`` with ``fold_ep`` (the experts over the ep x cp x tp ranks); ``config``
    replaces CONFIG."""
    out, cpu = [], torch.device("cpu")
    for layout, schedule, m, *rest in cases:
        config = rest[0] if rest else CONFIG
        name, *options = schedule.split(":")
        dims = ParallelDims(*layout[:3], rank, *layout[3:], fold_ep="fold" in options)
        zero = next((int(o[-1]) for o in options if o.startswith("zero")), 0)
        batch = next((int(o[6:]) for o in options if o.startswith("batch=")), GLOBAL_BATCH)
        split = split_of(options, name)
        if split.stage_layers == "auto":  # probed on rank 0, the same counts everywhere
            microbatch = batch // dims.data_world // m
            counts, _ = auto_split.agree(config, dims.pp, split.virtual_stages, microbatch, cpu)
            split = StageSplit(split.virtual_stages, counts, split.v_shape)
        # late_stop: activation checkpointing's recompute runs each block's whole forward
        with set_checkpoint_early_stop("late_stop" not in options):
            result = train(
                dims, build_process_groups(dims), name, m, config,
                paired_p2p="paired" in options, zero=zero, split=split,
                strict_p2p=STRICT_DEADLINE_S if "strict" in options else None,
                compile=next((o.split("=")[1] for o in options if o.startswith("compile=")), None),
                batch=batch, adamw=next((o[6:] for o in options if o.startswith("adamw=")), None),
                masked="masked" in options, packed="packed" in options,
                lora=LORA if "lora" in options else None,
                save=checkpoint_option(options, "save", ckpt_dir),
                resume=checkpoint_option(options, "resume", ckpt_dir),
                param_dtype="bf16" if "bf16" in options else "fp32",
                offload="offload" in options,
            )  # fmt: skip
        result["split"] = split
        out.append(result)
    return out


def checkpoint_option(
    options: list[str], kind: str, ckpt_dir: str | None
) -> tuple[int, str] | None:
    """``["save=2"]`` -> (2, "<ckpt_dir>/harness.ckpt"): the step and the checkpoint's path."""
    step = next((int(o.split("=")[1]) for o in options if o.startswith(f"{kind}=")), None)
    if step is None:
        return None
    if ckpt_dir is None:
        raise ValueError(f"a {kind}= case needs run_layouts(..., ckpt_dir=...)")
    return step, f"{ckpt_dir}/harness.ckpt"


def split_of(options: list[str], schedule: str = "1f1b") -> StageSplit:
    """``["v2", "layers=2-1-1-0"]`` -> StageSplit(2, (2, 1, 1, 0)); ``"auto"``: stage_layers="auto";
    neither given: the even split. ``schedule="zbv"``: two chunks per rank in the V (as
    ``TrainOptions.split`` builds it)."""
    v_shape = schedule in V_SHAPED
    v = next((int(o[1:]) for o in options if o[:1] == "v" and o[1:].isdigit()), 2 if v_shape else 1)
    layers = next((o.split("=")[1] for o in options if o.startswith("layers=")), None)
    if "auto" in options:
        return StageSplit(v, "auto", v_shape)
    counts = None if layers is None else tuple(int(n) for n in layers.split("-"))
    return StageSplit(v, counts, v_shape)


def assert_matches_reference(ref: dict, results: list[dict], label: str) -> None:
    for r in results:
        where = f"{label} rank coords {r['coords']}"
        torch.testing.assert_close(
            r["loss"], ref["loss"], rtol=1e-5, atol=0, msg=lambda m, w=where: f"{w} loss: {m}"
        )
        torch.testing.assert_close(
            r["aux"], ref["aux"], rtol=1e-5, atol=1e-8, msg=lambda m, w=where: f"{w} aux: {m}"
        )
        torch.testing.assert_close(
            r["norm"], ref["norm"], rtol=1e-5, atol=0, msg=lambda m, w=where: f"{w} norm: {m}"
        )
        torch.testing.assert_close(
            r["val_loss"], ref["val_loss"], rtol=1e-5, atol=0,
            msg=lambda m, w=where: f"{w} forward-only loss: {m}",
        )  # fmt: skip
        # the same assignments dropped (integer counts), and no expert got more rows than it may
        assert r["dropped"] == ref["dropped"], (where, r["dropped"], ref["dropped"])
        assert r["rows_over_capacity"] <= 1.0, (where, r["rows_over_capacity"])
        for name, local in r["weights"].items():
            expected = expected_slice(r, name, ref["weights"][name])
            torch.testing.assert_close(
                local, expected, rtol=0, atol=1e-5, msg=lambda m, w=f"{where} {name}": f"{w}: {m}"
            )
        # the expert bias moves by integer loads: equal on every rank, bit for bit
        for name, bias in r["biases"].items():
            assert torch.equal(bias, ref["biases"][name]), (where, name, bias, ref["biases"][name])
    # every parameter (and expert bias) of the full model is held by some rank of the layout
    biases = set().union(*(r["biases"] for r in results))
    assert biases == set(ref["biases"]), f"{label}: biases nobody holds: {ref['biases'].keys()}"
    held = set().union(*(r["weights"] for r in results))
    assert held == set(ref["weights"]), (
        f"{label}: parameters nobody holds: {set(ref['weights']) - held}"
    )


def config_dict() -> dict:
    return asdict(CONFIG)


def grads_of_one_step(
    dims: ParallelDims,
    groups: ProcessGroups,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_microbatches: int,
    max_norms: tuple[float | None, ...],
    schedule: str = "1f1b",
) -> dict:
    """This rank's reduced gradients of one forward/backward on its rows of the global batch, once per
    ``max_norms`` entry (None = no clipping): {"grads": [{name: local grad}], "norm": [pre-clip norm],
    "loss"/"aux": global means, "expert_names", "expert_range", "coords"}."""
    model = stage_model(dims, groups, CONFIG)
    engine = Engine(model, dims, groups, schedule=schedule, bucket_cap_mb=0.01)
    engine.broadcast_replicated()
    # the production step, with an update that changes nothing (lr 0): the grads it would apply
    # are read just before it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = []
    optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    )
    b = inputs.shape[0] // dims.data_world
    rows = slice(dims.data_rank * b, (dims.data_rank + 1) * b)
    out = {"grads": grads, "norm": []}
    for max_norm in max_norms:
        step = TrainStep(engine, optimizer, max_norm=max_norm).run(
            model, inputs[rows], targets[rows], num_microbatches, loss_fn_for(model, dims)
        )
        out["norm"].append(step.grad_norm)
    out["loss"], out["aux"] = step.loss, step.aux
    engine.remove()
    out.update(record(model, dims))
    return out


def full_initial_weights(config: ModelConfig = CONFIG) -> dict[str, torch.Tensor]:
    """The whole model's initial weights under global names (one process, ``init_weights(SEED)``)."""
    model = StageModel(config)
    model.init_weights(SEED)
    return {n: p.detach().clone() for n, p in model.named_parameters()}
