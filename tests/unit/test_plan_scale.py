"""``titan plan`` at cluster scale: the causal FLOPs it prices, the pruned search (the same first
rows as pricing everything, 2,048 devices in seconds), the topology of its collectives, and its
messages (``--only``, "nothing fits", a quantised config.json)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest

from lightning_titan.model import flops
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import AXES, GROUP_KINDS, ParallelDims
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.cost import (
    RING_BASE_S,
    RING_HOP_S,
    TREE_HOP_S,
    StepOptions,
    dispatch_seconds,
    members_per_node,
    predict,
    reduction,
    virtual_split,
)
from lightning_titan.plan.devices import GPUS
from lightning_titan.plan.layouts import candidates
from lightning_titan.plan.memory import group_place
from lightning_titan.plan.precision import FP32
from lightning_titan.plan.rank import _Prices, _undominated, ranked
from lightning_titan.tools.plan_cli import main as plan_main

FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures"
DEEPSEEK_V3_JSON = FIXTURES / "deepseek_v3" / "config.json"
H100 = GPUS["h100-80gb"]
SMALL = ModelConfig(vocab_size=257, d_model=64, n_layers=4, n_heads=4, ffn_dim=128, n_experts=8)


def _layout(**degrees: int) -> dict[str, int]:
    return {a: degrees.get(a, 1) for a in AXES}


# ---- 1. the causal count, the same in the planner as in flops.py --------------------------------


@pytest.mark.parametrize("window", [0, 24])
def test_the_planner_prices_the_flops_count(window):
    """Compute of a one-rank step (no fixed costs) is flops.py's training FLOPs over the device's:
    the causal (and windowed) attention the same in both."""
    config = dataclasses.replace(SMALL, seq_len=64, sliding_window=window)
    device = dataclasses.replace(H100, pass_s=0.0, split_s=0.0)
    cost = predict(config, _layout(), 0, StepOptions(), 8, device, (1, 1))
    assert cost.compute * device.flops == pytest.approx(flops.step_flops(config, 8 * 64))


# ---- 2. the search --------------------------------------------------------------------------------


def test_group_place_is_the_strategys_group():
    for degrees in (_layout(dp=2, ep=2, tp=2), _layout(dp=2, pp=2, cp=2), _layout(ep=4, tp=2)):
        dims = ParallelDims(**degrees)
        for rank in range(math.prod(degrees.values())):
            placed = ParallelDims(**degrees, rank=rank)
            for kind in GROUP_KINDS:
                group = placed.group_ranks(kind)
                assert group_place(placed, kind) == (len(group), group.index(rank)), (dims, kind)


def test_zero1_is_dominated_by_its_zero2_twin():
    found, _ = candidates(SMALL, 8, 16)
    kept = _undominated(found)
    assert not any(c.zero == 1 for c in kept) and any(c.zero == 1 for c in found)
    rows = {(r.label, r.options_label): r for r in ranked(SMALL, found, 16, H100)}
    for (label, options), r in rows.items():
        if r.candidate.zero == 1:
            twin = rows[(label.replace("zero1", "zero2"), options)]
            assert (
                twin.cost.step <= r.cost.step
                and twin.candidate.state_bytes <= r.candidate.state_bytes
            )
            # in the step too at one microbatch (over several the twin's grads accumulate whole
            # beside its rows, where zero=1 sums them into its buckets: the pruning's margin)
            if r.options.microbatches == 1:
                assert twin.memory_bytes <= r.memory_bytes


@pytest.mark.parametrize("devices, per_node", [(8, 8), (16, 4), (16, 2)])
def test_the_pruned_search_finds_the_full_rankings_first_rows(devices, per_node):
    """keep=K prices layouts by their lower bound and stops once it passes the K-th row: the same
    K rows as pricing every undominated layout (zero=1 beside zero=2, a layout beside the folded
    twin that dominates it), having priced fewer of them."""
    device = dataclasses.replace(H100, per_node=per_node, memory=2e8)
    found, _ = candidates(SMALL, devices, 32)
    undominated = _undominated(found, _Prices(SMALL, 32, device, ("none", "full"), FP32, False))
    everything = ranked(SMALL, undominated, 32, device)
    priced = []
    top = ranked(SMALL, found, 32, device, keep=10, progress=lambda n, of, best: priced.append(n))
    key = [(r.label, r.options_label, r.cost.step) for r in top]
    assert key == [(r.label, r.options_label, r.cost.step) for r in everything[:10]]
    assert max(priced) < len(undominated), (max(priced), len(found))


def test_the_search_says_where_it_is_on_stderr(capsys):
    plan_main(["--config", str(Path(__file__).resolve().parents[2] / "configs" / "dp_pp_ep.yaml"),
               "--devices", "8", "--device", "h100-80gb", "--top", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert "titan plan: priced " in err and " layouts in " in err and "fastest so far" in err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_2048_devices_of_deepseek_v3_plan_in_a_minute(capsys):
    # CPU seconds of this process, not wall time: the planner is one thread, and on a shared box other
    # jobs stretch the wall clock (572-623 s of wall for 30-33 s of CPU at load 40-67)
    start = time.process_time()
    rows = plan_main(["--config", str(DEEPSEEK_V3_JSON), "--devices", "2048", "--device",
                      "h100-80gb", "--global-batch", "8192", "--precision", "bf16-mixed",
                      "--top", "3"])  # fmt: skip
    seconds = time.process_time() - start
    printed = capsys.readouterr().out
    assert len(rows) == 3 and "on 256 node(s)" in printed
    assert seconds < 60, seconds  # before pruning and memoising: > 900 s


# ---- 4. topology ----------------------------------------------------------------------------------


def test_members_per_node_follow_the_mesh_order():
    degrees = tuple(_layout(dp=4, pp=2, ep=8, tp=2).items())  # 128 ranks, tp fastest
    assert members_per_node(degrees, ("tp",), 8) == 2
    assert members_per_node(degrees, ("ep",), 8) == 4  # ep strides by tp=2: 4 of 8 in a node
    assert members_per_node(degrees, ("dp",), 8) == 1  # dp strides by 32
    assert members_per_node(degrees, ("dp", "ep", "cp"), 8) == 4


def test_ep_dispatch_is_priced_by_tier():
    """ep=16 over 2 nodes of 8: of K copies, 7/16 on NVLink and 8/16 on the network, at once."""
    degrees, k, nbytes, experts = _layout(ep=16), 8, 1e9, 256
    one_call = dispatch_seconds(H100, degrees, k, nbytes, experts, 1)
    near, far = (
        k * 7 / 16 * nbytes / H100.intra.bandwidth,
        k * 8 / 16 * nbytes / H100.inter.bandwidth,
    )
    assert one_call == pytest.approx(H100.inter.latency_s + max(near, far))
    # in one node (ep=8): only NVLink
    inside = dispatch_seconds(H100, _layout(ep=8), k, nbytes, experts, 1)
    assert inside == pytest.approx(H100.intra.latency_s + k * 7 / 8 * nbytes / H100.intra.bandwidth)
    # one copy per destination node: a remote node of 128 of 256 experts gets a top-8 token with
    # probability 1 - C(128, 8) / C(256, 8)
    dedup = dataclasses.replace(H100, dispatch="node-dedup")
    hit = 1 - math.comb(128, 8) / math.comb(256, 8)
    far = hit * nbytes / H100.inter.bandwidth
    near = k * 7 / 8 * nbytes / H100.intra.bandwidth
    expected = H100.inter.latency_s + max(near, far)
    assert dispatch_seconds(dedup, degrees, k, nbytes, experts, 1) == pytest.approx(expected)
    assert dispatch_seconds(dedup, degrees, k, nbytes, experts, 1) < one_call / 3


def test_reductions_are_nccls_ring_or_tree_whichever_is_cheaper():
    nbytes, bucket = 1e10, 25 * 2**20
    buckets = math.ceil(nbytes / bucket)
    # one node of 8: the ring, at NVLink
    ring = RING_BASE_S + 14 * RING_HOP_S[0] + 2 * 7 / 8 * (nbytes / buckets) / H100.intra.bandwidth
    assert reduction(H100, _layout(dp=8), ("dp",), nbytes, 2, buckets) == pytest.approx(
        buckets * ring
    )
    # 1,024 ranks, one a node: the tree's log2(1024) network hops beat the ring's 2,046 steps
    big = dataclasses.replace(H100, per_node=8)
    degrees = _layout(dp=1024, tp=8)
    per = nbytes / buckets
    tree = 2 * (0 * TREE_HOP_S[0] + 10 * TREE_HOP_S[1]) + 2 * per / H100.inter.bandwidth
    ring = RING_BASE_S + 2046 * RING_HOP_S[1] + 2 * 1023 / 1024 * per / H100.inter.bandwidth
    assert tree < ring
    got = reduction(big, degrees, ("dp",), nbytes, 2, buckets)
    assert got == pytest.approx(buckets * min(tree, ring))
    # eight ranks of the group in each node drive eight network adapters
    spread = reduction(big, _layout(dp=1024), ("dp",), nbytes, 1, buckets)
    ring8 = RING_BASE_S + 896 * RING_HOP_S[0] + 127 * RING_HOP_S[1]
    ring8 += 1023 / 1024 * per / (8 * H100.inter.bandwidth)
    assert spread == pytest.approx(buckets * ring8)


def test_link_flags_and_nodes_reach_the_prices(capsys):
    base = ["--config", str(Path(__file__).resolve().parents[2] / "configs" / "dp_pp_ep.yaml"),
            "--devices", "16", "--device", "h100-80gb", "--only", "ep8xtp2", "--top", "1"]  # fmt: skip
    plain = plan_main(base)
    assert "on 2 node(s)" in capsys.readouterr().out  # 16 H100s: 8 a node by default
    slow = plan_main([*base, "--network-gbs", "5"])
    out = capsys.readouterr().out
    assert "inter-node 5 GB/s" in out and slow[0].cost.comm["ep"] > plain[0].cost.comm["ep"]
    one = plan_main([*base, "--per-node", "16"])
    assert "on 1 node(s)" in capsys.readouterr().out
    assert one[0].cost.comm["ep"] < plain[0].cost.comm["ep"]
    with pytest.raises(SystemExit):
        plan_main([*base, "--nodes", "2", "--per-node", "4"])
    assert "is not --devices=16" in capsys.readouterr().err


# ---- 3. messages ----------------------------------------------------------------------------------


def test_only_prints_each_layout_with_its_reason_or_its_cost(capsys):
    """A refused layout says the strategy's rule; one that does not fit still shows its rows,
    time and memory."""
    rows = plan_main(["--config", str(DEEPSEEK_V3_JSON), "--devices", "256", "--device",
                      "h100-80gb", "--global-batch", "1024", "--precision", "bf16-mixed",
                      "--only", "pp64xep4", "ep128xtp2", "dp3", "ep2xfoo", "--top", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "no row for pp64xep4: the strategy refuses it: n_layers=61" in out
    assert "no row for dp3: 3 devices, not the 256 planned for" in out
    assert "no row for ep2xfoo: not a layout" in out
    line = next(x for x in out.splitlines() if x.startswith("titan plan: ep128xtp2: fastest"))
    assert "does not fit" in line and "GB of 80.00 GB (state" in line, line
    assert len(rows) == 1 and rows[0].memory_bytes > 80e9
    assert "| 1 | ep128xtp2 |" in out


def test_nothing_fits_names_the_term_and_a_remedy_the_model_allows(capsys):
    """DeepSeek-V3 on 64 H100: the smallest is zero3 (the weights split too, at pp=1); the largest
    term is named, and the next ep, pp and tp. Below zero=3, the smallest is folded (the experts
    over tp32, zero3 is not built with a fold), its next ep and tp those the fold divides 256
    experts by. Unfolded, the smallest is zero2 with 2 layers a stage (pp32, split unevenly):
    neither zero=1/2 nor pp=33 (still 2 layers a stage) is advised, but the first pp whose stages
    hold one layer."""
    from lightning_titan.plan.layouts import shortfall
    from lightning_titan.tools.plan_cli import shapes_of

    with pytest.raises(SystemExit) as stop:
        plan_main(["--config", str(DEEPSEEK_V3_JSON), "--devices", "64", "--device",
                   "h100-80gb", "--global-batch", "1024"])  # fmt: skip
    said = str(stop.value.code)
    assert "nothing fits" in said and "(ep32xtp2 zero3)" in said
    assert "its largest term is expert_optimizer" in said
    assert "zero=1" not in said and "zero=2 (" not in said
    assert "ep=64 (128 devices)" in said
    config = shapes_of(DEEPSEEK_V3_JSON.parent, 4096)
    found, _ = candidates(config, 64, 1024)
    folded = min((c for c in found if c.zero < 3), key=lambda c: c.state_bytes)
    said = shortfall(folded, H100.memory, config)
    assert "(pp2xtp32xfold zero2)" in said and "divided by ep (folded, ep x cp x tp)" in said
    assert "ep=2 (128 devices)" in said and "tp=64 (128 devices)" in said
    best = min((c for c in found if c.zero < 3 and not c.fold_ep), key=lambda c: c.state_bytes)
    said = shortfall(best, H100.memory, config)
    assert "(pp32xep2 zero2)" in said and "its largest term is expert_optimizer" in said
    assert "zero=1" not in said and "zero=2 (" not in said
    assert "pp=61 (122 devices)" in said and "pp=33" not in said
    assert "ep=4 (128 devices)" in said


def test_nothing_fits_advises_zero2_where_the_smallest_is_below_it():
    from lightning_titan.plan.layouts import shortfall

    found, _ = candidates(SMALL, 2, 16)
    zero0 = next(c for c in found if c.degrees["dp"] == 2 and c.zero == 0)
    said = shortfall(zero0, 1e3, SMALL)
    assert "try zero=2" in said and "pp=2 (4 devices)" in said


def test_a_quantised_config_json_is_planned_from_its_shapes_with_a_note(tmp_path, capsys):
    from hf_tiny import hf_config

    tiny = hf_config("deepseek_v3").to_dict()
    tiny["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    import json

    (tmp_path / "config.json").write_text(json.dumps(tiny))
    rows = plan_main(["--config", str(tmp_path / "config.json"), "--devices", "2", "--top", "1"])
    out = capsys.readouterr().out
    assert rows and "quantization_config (fp8) is ignored: planning reads the shapes only" in out


# ---- 5. every layout the engine runs: virtual stages; published runs ------------------------------


def test_interleaved_is_offered_with_every_v_up_to_8_a_chunk_of_layers_each():
    from lightning_titan.plan.rank import step_options

    sixteen = dataclasses.replace(SMALL, n_layers=16)
    offered = step_options(sixteen, _layout(pp=2, ep=2), 16, ("none",))
    chunks = {o.virtual_stages for o in offered if o.schedule == "interleaved_1f1b"}
    assert chunks == set(range(2, 9))  # 16 layers on 2 ranks: 2 v chunks, dealt where uneven
    even = {o.virtual_stages for o in offered if o.virtual_layers is None and o.virtual_stages > 1}
    assert even == {2, 4, 8}  # where 2 v divides 16, the even split
    twelve = dataclasses.replace(SMALL, n_layers=12)
    offered = step_options(twelve, _layout(pp=2, ep=2), 16, ("none",))
    assert {o.virtual_stages for o in offered if o.schedule == "interleaved_1f1b"} == set(
        range(2, 7)
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_within_node_published_run_is_predicted_within_a_quarter():
    """Qwen3-30B-A3B on one node of 8 H100 (NeMo AutoModel: EP8 FSDP8, 21.8 s at a global batch
    of 512): the planner's prediction for that layout, and it fits the memory model."""
    from lightning_titan.tools.plan_published import RUNS, predict_run

    (run,) = [r for r in RUNS if r.devices <= 8]
    p = predict_run(run, search=False)
    assert p.fits and 0.75 <= p.ratio <= 1.25, (p.theirs.options_label, p.ratio)


def test_the_cross_node_published_runs_are_the_model_their_publisher_counts():
    """AutoModel's DeepSeek-V3 rows publish Model TFLOPs/sec/GPU beside the step time (250 at
    8.18 s on 256 H100, 216 at 37.87 s on 1,024): the table's config.json shapes and the causal
    FLOP count give the same rate within 1 %, so a ratio in the table compares like with like."""
    from lightning_titan.tools.plan_published import RUNS

    rows = {r.devices: r for r in RUNS if r.model == "DeepSeek-V3"}
    for devices, tflops in ((256, 250), (1024, 216)):
        run = rows[devices]
        assert math.prod(run.layout.values()) == devices and sum(run.stage_layers) == 61
        # VP8 as published: the layout's split dealt over 32 virtual stages the engine accepts
        assert run.schedules == ("interleaved_1f1b",) and run.virtual_stages == 8
        counts = virtual_split(run.config, 4, 8, run.stage_layers)
        assert counts is not None and len(StageSplit(8, counts).counts(61, 4)) == 32
        tokens = run.global_batch * run.config.seq_len
        rate = flops.step_flops(run.config, tokens) / (devices * run.seconds[0])
        assert rate == pytest.approx(tflops * 1e12, rel=0.01), (devices, rate)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_folded_published_run_is_priced_as_published():
    """Qwen3-235B-A22B on 256 H100 (Megatron-Bridge: TP2 PP8 VP4 EP32 ETP1): EP32 over the TP2 x
    DP16 ranks of a stage is our pp8 x ep16 x tp2 folded (32 expert ranks, 16 data ranks), VP4 on
    94 layers split unevenly. It fits; its published time is FP8, so it has no ratio; the docs'
    row says the bf16 prediction."""
    from lightning_titan.tools.plan_published import RUNS, predict_run

    (run,) = [r for r in RUNS if r.fold_ep]
    p = predict_run(run, search=False)
    assert p.theirs is not None and p.theirs.label == "pp8xep16xtp2xfold zero1"
    dims = p.theirs.candidate.dims
    assert (dims.expert_world, dims.data_world, sum(run.stage_layers)) == (32, 16, 94)
    assert p.theirs.options.virtual_stages == 4 and p.fits and p.ratio is None
    docs = (Path(__file__).resolve().parents[2] / "docs" / "choosing_a_layout.md").read_text()
    assert f"| {p.theirs.cost.step:.2f} | none: no bf16 run is published, only FP8 |" in docs


def test_tp_pp_and_cp_groups_that_span_nodes_use_the_network():
    params, options = (10**9, 10**10), StepOptions("1f1b", 8)
    for degrees, term in ((_layout(tp=4, dp=2), "tp"), (_layout(cp=4, dp=2), "cp"),
                          (_layout(pp=4, dp=2), "pp")):  # fmt: skip
        inside = predict(SMALL, degrees, 0, options, 256, H100, params).comm[term]
        spread = dataclasses.replace(H100, per_node=2)  # dp=2 x 4: the group crosses 2 nodes
        across = predict(SMALL, degrees, 0, options, 256, spread, params).comm[term]
        assert across > inside > 0, (term, across, inside)
