"""titan plan (issue 20): the layouts the strategy accepts, each one's model state, activations and
predicted step time.

The state model itself is checked against measured runs: every equivalence case's ranks
(tests/distributed/test_equivalence.py) and every quick-bench case (tests/distributed/test_bench.py). Here, in one process:
the enumeration against the strategy's own rules, a published parameter count, the cost terms and the
ranking, the overlay a user feeds back to `titan fit`, and the errors; in spawned ranks (slow): the
activation peaks against the bench's meter, and `--check` end to end.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_titan.cli import TitanCLI, check_config_files, cli_components
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import AXES, ParallelDims
from lightning_titan.parallel.pipeline.schedules import (
    CHUNKED,
    OVERLAPPED,
    SCHEDULES,
    V_SHAPED,
    check_microbatches,
)
from lightning_titan.parallel.pipeline.theory import ideal_bubble, live_peak
from lightning_titan.plan.activations import held, peak_bytes
from lightning_titan.plan.cost import (
    StepOptions,
    bubble_fraction,
    collective,
    paired_fraction,
    predict,
)
from lightning_titan.plan.devices import GPUS, Link
from lightning_titan.plan.layouts import PRICED, candidates, factorizations, total_params
from lightning_titan.plan.memory import (
    StatePolicy,
    gathered_bytes,
    host_bytes,
    layout_state,
    rank_state,
)
from lightning_titan.plan.precision import Precision
from lightning_titan.plan.rank import ranked, step_options
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools.bench.cases import OURS, Case, Settings
from lightning_titan.tools.bench.worker import run_world
from lightning_titan.tools.plan_check import _case, check, chosen, spearman
from lightning_titan.tools.plan_cli import _ms, model_and_batch, only_rows, table
from lightning_titan.tools.plan_cli import main as plan_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
FIXTURES = ROOT / "tests" / "support" / "fixtures"
DEFAULT = ModelConfig(vocab_size=257, d_model=64, n_layers=4, n_heads=4, ffn_dim=128, n_experts=8)


def test_factorizations_are_every_ordered_product():
    layouts = factorizations(12)
    assert all(math.prod(d.values()) == 12 and list(d) == list(AXES) for d in layouts)
    assert len({tuple(d.values()) for d in layouts}) == len(layouts)
    # ordered factorizations of 12 = 2^2 * 3 into 5 factors: C(2+4, 4) * C(1+4, 4) = 15 * 5
    assert len(layouts) == 75


def test_candidates_follow_the_strategy_rules():
    found, rejected = candidates(DEFAULT, 8, 16)
    layouts = {(tuple(c.degrees.values()), c.zero) for c in found}
    assert ((2, 2, 2, 1, 1), 0) in layouts and ((2, 2, 2, 1, 1), 2) in layouts
    assert not any(c.degrees["tp"] == 8 for c in found)  # 4 heads: tp <= 4
    assert not any(c.degrees["pp"] == 8 for c in found)  # 4 layers: pp <= 4
    assert ((1, 1, 1, 1, 1), 0) not in layouts  # 8 devices: no one-rank layout
    assert rejected["n_heads=4"] > 0 and rejected["n_layers=4"] > 0
    # zero > 0 only where a data-parallel group exists (pure pp has none)
    four = {(tuple(c.degrees.values()), c.zero) for c in candidates(DEFAULT, 4, 16)[0]}
    assert ((1, 4, 1, 1, 1), 0) in four and ((1, 4, 1, 1, 1), 1) not in four
    assert ((1, 2, 2, 1, 1), 1) in four  # ep: the non-expert state splits over it
    # a global batch of 12 sequences splits over 1, 2 or 4 data ranks (dp * ep), not 8
    twelve, rejected = candidates(DEFAULT, 8, 12)
    assert rejected["global_batch_size=12"] > 0
    assert {c.degrees["dp"] * c.degrees["ep"] for c in twelve} == {1, 2, 4}
    # more devices for the experts: less state on the fullest rank
    state = {(tuple(c.degrees.values()), c.zero): c.state_bytes for c in found}
    assert state[((1, 1, 8, 1, 1), 0)] < state[((2, 1, 4, 1, 1), 0)] < state[((8, 1, 1, 1, 1), 0)]
    assert state[((8, 1, 1, 1, 1), 1)] < state[((8, 1, 1, 1, 1), 0)]


def test_mixtral_8x7b_has_its_published_parameter_count():
    """46.7 B (Mistral's announcement; HF's MixtralForCausalLM at these sizes), built on meta."""
    mixtral = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          ffn_dim=14336, n_experts=8, top_k=2, seq_len=4096)  # fmt: skip
    assert total_params(mixtral) == 46_702_792_704


def test_a_hugging_face_config_json_is_planned(tmp_path, capsys):
    """gpt-oss's config.json: its parameters (sinks, biases) counted as transformers has them."""
    from hf_tiny import build

    theirs = build("gpt_oss", tmp_path, shard=False)
    rows = plan_main(["--config", str(tmp_path / "config.json"), "--seq-len", "16",
                      "--devices", "4", "--top", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"{sum(p.numel() for p in theirs.parameters()):,} parameters" in printed
    assert rows and "| 1 | " in printed


DEEPSEEK_V3 = ModelConfig(
    vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, ffn_dim=2048, n_experts=256, top_k=8,
    seq_len=4096, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_interleave=True, router_score="sigmoid", router_expert_bias=True,
    router_groups=8, router_topk_groups=4, routed_scaling=2.5, dense_layers=3, dense_ffn_dim=18432,
    shared_expert_dim=2048, shared_expert_gated=False, norm_eps=1e-6,
)  # fmt: skip


def test_deepseek_v3_has_its_published_parameter_count():
    """671 B without the multi-token-prediction layer (HF's DeepseekV3ForCausalLM: 671,026,419,200
    with the 58 x 256 expert biases, which are buffers here), built on meta."""
    assert total_params(DEEPSEEK_V3) == 671_026_419_200 - 58 * 256


def test_a_deepseek_v3_config_json_is_planned_with_the_latent_priced(tmp_path, capsys):
    from hf_tiny import hf_config

    (tmp_path / "config.json").write_text(hf_config("deepseek_v3").to_json_string())
    rows = plan_main(["--config", str(tmp_path / "config.json"), "--devices", "2"])
    assert rows and "| 1 | " in capsys.readouterr().out
    # context parallelism sends the latent and the shared RoPE key (512 + 64 a token), not 128
    # heads' keys and values
    degrees = {"dp": 1, "pp": 1, "ep": 1, "cp": 2, "tp": 1}
    cp_bytes = predict(DEEPSEEK_V3, degrees, 0, StepOptions(), 64, GPUS["h100-80gb"], (1, 1)).comm
    mha = dataclasses.replace(DEEPSEEK_V3, kv_lora_rank=0, n_kv_heads=128, attn_head_dim=192)
    mha_bytes = predict(mha, degrees, 0, StepOptions(), 64, GPUS["h100-80gb"], (1, 1)).comm
    assert 10 * cp_bytes["cp"] < mha_bytes["cp"]


KEPT = ["--precision", "bf16-mixed", "--param-dtype", "bf16", "--offload-optimizer"]


@pytest.mark.parametrize("kept", [[], KEPT], ids=["fp32", "bf16-offload"])
def test_the_overlay_is_the_layout_titan_fit_builds(tmp_path, monkeypatch, capsys, kept):
    overlay = tmp_path / "layout.yaml"
    config = str(CONFIGS / "dp_pp_ep.yaml")
    rows = plan_main(["--config", config, "--devices", "4", "--out", str(overlay), *kept])
    printed = capsys.readouterr().out
    assert "| 1 | " in printed and "step ms" in printed
    assert rows and all(a.cost.step <= b.cost.step for a, b in itertools.pairwise(rows))
    monkeypatch.chdir(tmp_path)
    args = ["--config", config, "--config", str(overlay)]
    check_config_files(args)  # what `titan fit` reads each file with before its parser
    cli = TitanCLI(*cli_components(), run=False, args=args)
    dims, options = cli.trainer.strategy.parallel_dims, cli.trainer.strategy.options
    assert dims.degrees == rows[0].candidate.degrees and cli.trainer.num_devices == 4
    assert options.zero == rows[0].candidate.zero
    assert options.schedule == rows[0].options.schedule
    assert options.num_microbatches == rows[0].options.microbatches
    assert cli.model.config.recompute == rows[0].options.recompute
    # bf16 weights (in bf16-mixed) and offload as planned, zero 0..2 as the strategy runs them
    assert options.param_dtype == ("bf16" if kept else "fp32")
    assert options.offload_optimizer == bool(kept)
    assert not kept or options.zero < 3
    assert cli.trainer.precision == ("bf16-mixed" if kept else "32-true")
    if kept:
        assert "host memory (optimizer offload, row 1)" in printed


# published config.json files (tests/support/fixtures), each with the options that make it fit 8 x
# H100 80GB, and whether it needs them (docs/choosing_a_layout.md shows the rows): Mixtral-8x7B's
# state fits no layout without offload (108 GB a rank at best with bf16 weights alone);
# Qwen3-30B-A3B's fits with bf16 weights, and offload only slows its step
PUBLISHED_ON_8_H100 = [
    ("mixtral_8x7b", StatePolicy("bf16", offload=True), True),
    ("qwen3_30b_a3b", StatePolicy("bf16"), False),
]


@pytest.mark.parametrize(
    "name, policy, needed", PUBLISHED_ON_8_H100, ids=[n for n, _, _ in PUBLISHED_ON_8_H100]
)
def test_published_moes_fit_8_h100_with_the_options_they_need(name, policy, needed):
    config, batch, _ = model_and_batch(str(FIXTURES / name / "config.json"))
    device = GPUS["h100-80gb"]
    found, _ = candidates(config, 8, batch, policy=policy)
    fits = [c for c in found if c.state_bytes <= device.memory]
    rows = ranked(config, fits, batch, device, precision=Precision("bf16-mixed"), keep=1)
    assert rows, name
    assert rows[0].candidate.zero < 3 and rows[0].memory_bytes <= device.memory
    assert (rows[0].candidate.host_bytes > 0) == policy.offload
    if needed:  # without offload (fp32 or bf16 weights) no layout's state fits
        for weaker in (StatePolicy(), StatePolicy(policy.param_dtype)):
            plain, _ = candidates(config, 8, batch, policy=weaker)
            assert all(c.state_bytes > device.memory for c in plain), (name, weaker)


def test_offload_prices_the_state_on_the_host_and_the_copies_in_the_step():
    """The device keeps weights and grads; the host every owned element's fp32 copy, moments and
    grad buffer (16 bytes); the step's optimizer term becomes PCIe copies plus a host-speed AdamW."""
    dims = ParallelDims(2, 1, 2, 1)  # rank 1 of dp2 x ep2
    for zero in (0, 1, 2):
        for dtype in ("fp32", "bf16"):
            kept = rank_state(DEFAULT, dims, zero, param_dtype=dtype)
            moved = rank_state(DEFAULT, dims, zero, param_dtype=dtype, offload=True)
            for part in ("expert", "non_expert"):
                assert moved[f"{part}_optimizer"] == 0
                assert moved[f"{part}_params"] == kept[f"{part}_params"]
                assert moved[f"{part}_grads"] == kept[f"{part}_grads"]
            moments = sum(kept[f"{p}_optimizer"] for p in ("expert", "non_expert"))
            owned = moments // (8 if dtype == "fp32" else 12)  # fp32 moments (+ a master)
            assert host_bytes(DEFAULT, dims, zero) == 16 * owned, (zero, dtype)
    h100, degrees = GPUS["h100-80gb"], {"dp": 8, "pp": 1, "ep": 1, "cp": 1, "tp": 1}
    params = (10**9, 0)
    on_device = predict(DEFAULT, degrees, 0, StepOptions(), 64, h100, params)
    offloaded = predict(DEFAULT, degrees, 0, StepOptions(), 64, h100, params, offload=True)
    expected = 10**9 * 8 / h100.host_link + 10**9 * 32 / h100.host_share
    assert offloaded.optimizer == pytest.approx(expected)
    assert offloaded.optimizer > on_device.optimizer
    assert offloaded.compute == on_device.compute and offloaded.comm == on_device.comm


def test_bf16_weights_need_bf16_mixed(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--config", str(CONFIGS / "dp_pp_ep.yaml"), "--devices", "2",
                   "--param-dtype", "bf16"])  # fmt: skip
    assert "--param-dtype bf16 multiplies bf16 weights" in capsys.readouterr().err


def _documented_flow() -> list[list[str]]:
    """The `titan plan ... --out layout.yaml` and `titan fit ... --config layout.yaml` lines of
    docs/choosing_a_layout.md, as argument lists."""
    text = (ROOT / "docs" / "choosing_a_layout.md").read_text()
    lines = [line.split("#")[0].split() for line in text.splitlines()]
    plan = [w for w in lines if w[:2] == ["titan", "plan"] and "--out" in w]
    fit = [w for w in lines if w[:2] == ["titan", "fit"] and "layout.yaml" in w]
    assert len(plan) == 1 and len(fit) == 1, (plan, fit)
    return [plan[0], fit[0]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_documented_plan_then_fit_flow_trains(tmp_path):
    """The docs' two commands as a user types them (`python -m lightning_titan` for `titan`, one
    step, no validation): fit accepts the plan's file and trains under its layout."""
    plan, fit = _documented_flow()
    fit += ["--trainer.max_steps=1", "--trainer.limit_val_batches=0"]
    said = []
    for words in (plan, fit):
        args = [str(ROOT / w) if w.startswith("configs/") else w for w in words[1:]]
        proc = subprocess.run([sys.executable, "-m", "lightning_titan", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=280)  # fmt: skip
        assert proc.returncode == 0, (words, proc.stderr[-3000:])
        said.append(proc.stdout)
    keys = yaml.safe_load((tmp_path / "layout.yaml").read_text())
    degrees = {a: keys[f"trainer.strategy.init_args.{a}"] for a in AXES}
    shown = [a for a in AXES if a in ("dp", "pp", "ep") or degrees[a] > 1]
    layout = " ".join(f"{a}={degrees[a]}" for a in shown)
    assert f"layout             {layout} ({keys['trainer.devices']} ranks)" in said[1], said[1]
    assert "final train_loss" in said[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "8", "--device", "tpu"], "--device='tpu' is unknown"),
        (["--devices", "0"], "--devices=0 must be a positive number"),
        (["--devices", "8", "--global-batch", "0"], "--global-batch=0 must be a positive"),
        (["--devices", "8", "--memory-gb", "0.001"], "nothing fits: the smallest model state"),
        (["--devices", "7"], "no layout of these devices splits this model"),
        (["--devices", "8", "--device", "h100-80gb", "--nodes", "3"], "--nodes=3 must divide"),
        (["--devices", "8", "--nodes", "2"], "--device cpu is this one machine"),
        (["--devices", "8", "--device", "h100-80gb", "--check"], "--check runs on this machine's"),
    ],
)
def test_bad_requests_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        plan_main(["--config", str(CONFIGS / "dp_pp_ep.yaml"), *args])
    said = capsys.readouterr().err + str(stop.value.code)  # argparse's usage error, or sys.exit's
    assert stop.value.code != 0 and message in said, said


def test_titan_plan_is_a_titan_command():
    cmd = [sys.executable, "-m", "lightning_titan", "plan", "--config",
           str(CONFIGS / "dp_pp_ep.yaml"), "--devices", "2", "--top", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "| 1 | " in proc.stdout, proc.stderr[-2000:]


MIXTRAL = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, n_experts=8, top_k=2, seq_len=4096)  # fmt: skip
H100 = GPUS["h100-80gb"]


def _layout(dp=1, pp=1, ep=1, cp=1, tp=1) -> dict[str, int]:
    return {"dp": dp, "pp": pp, "ep": ep, "cp": cp, "tp": tp}


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_bubble_is_the_schedule_formula(pp, m):
    assert (
        bubble_fraction("gpipe", pp, m) == bubble_fraction("1f1b", pp, m) == (pp - 1) / (m + pp - 1)
    )
    assert bubble_fraction("interleaved_1f1b", pp, m, 2) == pytest.approx(
        (pp - 1) / (2 * m + pp - 1)
    )
    # the predicted step carries it: bubble / (compute + bubble)
    cost = predict(MIXTRAL, _layout(pp=pp, ep=8 // pp if pp < 8 else 1), 0,
                   StepOptions("1f1b", m), 64, H100, (10**9, 10**10))  # fmt: skip
    assert cost.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


def test_traffic_is_the_steps_bytes_whatever_the_microbatches():
    """On a link without latency the PP, EP, TP and CP terms are the step's bytes over the
    bandwidth: the same for M = 2 and M = 8 of one global batch (each call's bytes times the calls),
    and for EP the all-to-alls' four passes of every token's K rows per MoE layer."""
    link = Link(latency_s=0.0, bandwidth=1e9)
    flat = dataclasses.replace(H100, intra=link, inter=None)
    layout = _layout(pp=2, ep=2, tp=2, cp=2)
    costs = [
        predict(MIXTRAL, layout, 0, StepOptions("1f1b", m), 64, flat, (10**9, 10**10))
        for m in (2, 8)
    ]
    for axis in ("pp", "ep", "tp", "cp"):
        assert costs[0].comm[axis] > 0 and costs[0].comm[axis] == pytest.approx(
            costs[1].comm[axis]
        ), axis
    tokens = 64 * MIXTRAL.seq_len // (layout["dp"] * layout["ep"] * layout["tp"] * layout["cp"])
    rows = tokens * MIXTRAL.top_k * MIXTRAL.d_model * 4 * MIXTRAL.n_layers // layout["pp"]
    assert costs[0].comm["ep"] == pytest.approx(4 * rows * (1 / 2) / link.bandwidth)


def test_bubble_and_held_activations_are_the_schedules_own_order():
    """For every schedule the planner offers, over P in {2, 3, 4} and every M the schedule takes, the
    predicted bubble and live microbatches per stage equal the replay of the schedule functions' own
    order (parallel/pipeline/theory.py): the closed forms where the pipeline fills, the replay before."""
    for schedule in SCHEDULES:
        v = 2 if schedule in {**CHUNKED, **V_SHAPED} else 1
        for pp in (1, 2, 3, 4) if schedule in ("1f1b", "1f1b_overlap") else (2, 3, 4):
            for m in range(1, 17):
                try:
                    check_microbatches(schedule, m, pp, v)
                except ValueError:
                    continue
                case = f"{schedule} pp={pp} M={m}"
                assert bubble_fraction(schedule, pp, m, v) == pytest.approx(
                    ideal_bubble(schedule, pp, v, m), abs=1e-9
                ), case
                options = StepOptions(schedule, m, v)
                for p in range(pp):
                    live = live_peak(schedule, pp, p, v, m, [1] * v)[1] / v
                    assert held(options, pp, p) == pytest.approx(live), f"{case} stage {p}"


def test_every_schedule_is_offered_with_its_chunks():
    offered = {
        (o.schedule, o.virtual_stages) for o in step_options(DEFAULT, _layout(pp=2, ep=2), 16)
    }
    assert {s for s, _ in offered} == set(SCHEDULES) - {"1f1b_overlap"}  # that one: pp=1 only
    assert ("zbv", 2) in offered and ("interleaved_1f1b", 2) in offered and ("zb_h1", 1) in offered
    assert ("dualpipev", 2) in offered
    alone = {o.schedule for o in step_options(DEFAULT, _layout(ep=2), 16)}
    assert alone == {"1f1b", "1f1b_overlap"}


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dualpipev_holds_2p_chunks_and_2p_plus_1_on_the_last_rank(pp):
    """The planner's count is the replay's of DualPipeV's own order, for M from 2P: ZBV's 2P
    chunk-microbatches of the full V (a pair holds its backward's microbatch), and on the last rank
    one more, where the turn's first forward and backward run apart."""
    for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp):
        options = StepOptions("dualpipev", m, 2)
        for p in range(pp):
            live = live_peak("dualpipev", pp, p, 2, m, [1, 1])[1]
            assert live == 2 * pp + (p == pp - 1) and held(options, pp, p) * 2 == live, (m, p)


def test_an_overlapped_schedule_hides_the_all_to_alls_it_pairs():
    """Against its twin (1F1B on pp=1, ZBV on the V): where the all-to-alls outlast the compute (a
    slow link), the step is shorter by the partner's compute under each paired pass; where the
    compute outlasts them, only the unpaired passes' all-to-alls are left. The price: nothing on one
    stage (the pair holds one microbatch), one more chunk-microbatch on the V's last rank."""
    params = (10**9, 10**10)
    slow = dataclasses.replace(H100, intra=Link(latency_s=1e-5, bandwidth=1e8), inter=None)
    busy = dataclasses.replace(H100, flops=1e10)
    twins = [(_layout(ep=8), "1f1b", "1f1b_overlap", 1, 4, 3 / 4),
             (_layout(pp=2, ep=4), "zbv", "dualpipev", 2, 8, 11 / 16)]  # fmt: skip
    for layout, plain, overlapped, v, m, paired in twins:
        assert paired_fraction(overlapped, layout["pp"], m) == paired  # 11 pairs of 16 chunk passes
        for device in (slow, busy):
            base, over = (
                predict(DEFAULT, layout, 0, StepOptions(s, m, v), 64, device, params)
                for s in (plain, overlapped)
            )
            assert (over.compute, over.bubble) == (base.compute, base.bubble)
            if device is slow:
                assert base.comm["ep"] > 2 * base.compute  # each pass's a2a outlasts its partner
                expected = base.comm["ep"] - paired * base.compute
            else:
                assert base.comm["ep"] < base.compute / 3  # each partner outlasts the a2a
                expected = (1 - paired) * base.comm["ep"]
            assert over.comm["ep"] == pytest.approx(expected), (overlapped, device.name)
            assert over.step == pytest.approx(base.step - (base.comm["ep"] - expected))
            assert over.step < base.step
        twin, more = (
            peak_bytes(DEFAULT, layout, StepOptions(s, m, v), 64) for s in (plain, overlapped)
        )
        if v == 1:  # the pair's backward frees faster than its forward saves: 1F1B's microbatch
            assert more == pytest.approx(twin), overlapped
        else:  # half a stage more on the last rank (fp32: no weight copies)
            assert twin <= more <= twin * (1 + 1 / (2 * layout["pp"])), overlapped


def test_the_overlapped_schedules_need_ep_and_no_recompute_or_compile():
    """Offered only where the strategy runs them (``check_overlap``, ``check_microbatches``)."""
    for pp, ep, compiled in itertools.product((1, 2), (1, 2), (False, True)):  # 4 layers
        for o in step_options(DEFAULT, _layout(pp=pp, ep=ep), 16, compiled=compiled):
            if o.schedule in OVERLAPPED:
                assert ep > 1 and not compiled and o.recompute != "full", (pp, ep, o)
                assert (pp == 1) == (o.schedule == "1f1b_overlap") and o.microbatches >= 2 * pp
        offered = {o.schedule for o in step_options(DEFAULT, _layout(pp=pp, ep=ep), 16, ("none",))}
        assert bool(offered & set(OVERLAPPED)) == (ep > 1), (pp, ep)


def test_collectives_move_the_ring_bytes():
    bandwidth_only = Link(latency_s=0.0, bandwidth=1e9)
    nbytes = 4e9
    for n in (2, 4, 8):  # all-reduce: 2 (n-1)/n of the data; all-gather / reduce-scatter: half
        assert collective(bandwidth_only, nbytes, n, 2) == pytest.approx(2 * (n - 1) / n * 4)
        assert collective(bandwidth_only, nbytes, n, 1) == pytest.approx((n - 1) / n * 4)
    assert collective(Link(1e-3, 1e9), 0, 4, 2, calls=10) == pytest.approx(10 * 6 * 1e-3)
    assert collective(bandwidth_only, nbytes, 1, 2) == 0.0


def test_cost_terms_grow_with_their_axis():
    # a small model on H100s: too little compute to hide the all-reduce behind
    params, options = (10**9, 10**10), StepOptions("1f1b", 8)

    def cost(**degrees):
        return predict(DEFAULT, _layout(**degrees), 0, options, 256, H100, params)

    # more data-parallel ranks, more all-reduce traffic for the same grads
    assert cost(dp=8, pp=2).comm["dp"] > cost(dp=2, pp=2).comm["dp"] > 0
    assert cost(pp=2).comm["dp"] == 0 and cost(pp=2).comm["ep"] == 0
    assert cost(ep=8).comm["ep"] > cost(ep=2, dp=4).comm["ep"] > 0
    assert cost(tp=4, dp=2).comm["tp"] > 0 and cost(cp=2, dp=4).comm["cp"] > 0
    assert cost(pp=4, dp=2).comm["pp"] > 0 and cost(dp=8).comm["pp"] == 0
    # crossing nodes costs: the same EP group on a slower link
    two_nodes = dataclasses.replace(H100, per_node=4)
    ep8 = predict(DEFAULT, _layout(ep=8), 0, options, 256, two_nodes, params)
    assert ep8.comm["ep"] > cost(ep=8).comm["ep"]
    # ZeRO-1 adds the weight all-gather to zero=0's all-reduce; ZeRO-2 halves the reduction
    z = [predict(DEFAULT, _layout(dp=8), zero, StepOptions(), 8, H100, params) for zero in PRICED]
    assert z[1].comm["dp"] > z[0].comm["dp"] and z[2].comm["dp"] < z[1].comm["dp"]
    # ZeRO-3 gathers each block for its forward and its backward too
    assert z[3].comm["dp"] > z[2].comm["dp"]
    # recompute: a third more compute
    again = predict(DEFAULT, _layout(dp=8), 0, StepOptions(recompute="full"), 8, H100, params)
    assert again.compute > z[0].compute


def test_zero3_prices_its_rows_between_steps_and_what_it_gathers_in_the_step():
    """zero=3 holds its rows of every parameter between steps (the optimizer's rows, in fp32: half
    its two moments); in the step at pp=1 the two largest blocks (one computing, the next
    prefetched) and the rest of the stage (embedding, norm, head) whole beside them, gathered for
    each block's forward and backward of every microbatch; under a pipeline the whole stage, the
    rows inside it, gathered once: zero=2's peak and bytes, so the planner offers zero=2 there."""
    dims = ParallelDims(dp=8, pp=1, ep=1, rank=0)
    state = rank_state(DEFAULT, dims, 3)
    assert 2 * state["non_expert_params"] == state["non_expert_optimizer"]
    assert 2 * state["expert_params"] == state["expert_optimizer"]
    with torch.device("meta"):
        model = StageModel(DEFAULT)
    nbytes = [sum(p.numel() * 4 for p in b.parameters()) for b in model.layers.values()]
    rest = sum(p.numel() * 4 for p in model.parameters()) - sum(nbytes)
    assert gathered_bytes(DEFAULT, dims) == sum(sorted(nbytes)[-2:]) + rest
    # pp=2: the stage whole for the step, each rank's rows inside it, as zero=2 holds it
    for r in range(8):
        staged = ParallelDims(dp=4, pp=2, ep=1, rank=r)
        rows = rank_state(DEFAULT, staged, 3)
        whole = rank_state(DEFAULT, staged, 2)
        kept = gathered_bytes(DEFAULT, staged, reshard_after_forward=False)
        assert kept + rows["non_expert_params"] + rows["expert_params"] == (
            whole["non_expert_params"] + whole["expert_params"]
        )
    # the candidates: zero=3 at pp=1 with the step's gathers on top of its rows; none at pp > 1
    found, _ = candidates(DEFAULT, 8, 16)
    zero3 = [c for c in found if c.zero == 3]
    assert zero3 and all(c.degrees["pp"] == 1 for c in zero3)
    for c in zero3:
        assert c.gathered_bytes > 0 and c.state_bytes == sum(c.parts.values()) + c.gathered_bytes
    dp8 = next(c for c in zero3 if c.degrees["dp"] == 8)
    assert dp8.gathered_bytes == sum(sorted(nbytes)[-2:]) + rest
    two = next(c for c in found if c.zero == 2 and c.degrees == dp8.degrees)
    assert dp8.state_bytes < two.state_bytes  # the weights split too
    # bf16 weights: zero=3 offered too, each rank's rows its fp32 masters (no bf16 rows: the same
    # 16 bytes a parameter over the group) and the units gathered in bf16 (half the bytes)
    bf16, _ = candidates(DEFAULT, 8, 16, policy=StatePolicy("bf16"))
    b8 = next(c for c in bf16 if c.zero == 3 and c.degrees == dp8.degrees)
    assert 2 * b8.gathered_bytes == dp8.gathered_bytes
    assert sum(b8.parts.values()) == sum(dp8.parts.values())
    assert b8.parts["non_expert_params"] == b8.parts["expert_params"] == 0
    offloaded, _ = candidates(DEFAULT, 8, 16, policy=StatePolicy("bf16", offload=True))
    assert not [c for c in offloaded if c.zero == 3]  # offload runs zero 0, 1 and 2
    # the bytes: per microbatch at pp=1 each block twice, but the last block's backward (its
    # forward's gather kept for it: each microbatch's under 1f1b, the last one's under gpipe); once
    # a step under a pipeline (zero=2's)
    params = (10**8, 10**9)

    def dp_seconds(zero: int, m: int, pp: int = 1, schedule: str = "1f1b") -> float:
        layout = _layout(dp=8 // pp, pp=pp)
        options = StepOptions(schedule, m)
        return predict(DEFAULT, layout, zero, options, 64, H100, params).comm["dp"]

    def extra_gathers(m: int, schedule: str = "1f1b") -> float:  # zero=2's one a step: 1
        return dp_seconds(3, m, schedule=schedule) - dp_seconds(2, m, schedule=schedule)

    layers = DEFAULT.n_layers
    one = extra_gathers(1) / ((2 * layers - 1) / layers - 1)  # a whole gather of the stage
    assert one > 0
    assert extra_gathers(4) == pytest.approx(one * ((8 * layers - 4) / layers - 1))
    assert extra_gathers(4, "gpipe") == pytest.approx(one * ((8 * layers - 1) / layers - 1))
    assert dp_seconds(3, 4, pp=2) == dp_seconds(2, 4, pp=2)
    # the step options of a zero=3 layout at pp=1: those it gathers per block under
    options = {r.options.schedule for r in ranked(DEFAULT, [dp8], 16, H100)}
    assert options == {"1f1b"}, options


def test_bf16_prices_each_payload_in_the_dtype_it_travels_in():
    """bf16-mixed: EP, PP, CP and TP payloads halve (TP's all-gathers and reduce-scatters travel in
    the autocast dtype, ``parallel/wire.py``); the gradients, the optimizer and the compute do not."""
    wire_only = dataclasses.replace(H100, intra=Link(latency_s=0.0, bandwidth=1e9), inter=None)
    params, options, bf16 = (10**9, 10**10), StepOptions("1f1b", 8), Precision("bf16-mixed")

    def both(**degrees):
        layout = _layout(**degrees)
        fp32 = predict(DEFAULT, layout, 0, options, 256, wire_only, params)
        mixed = predict(DEFAULT, layout, 0, options, 256, wire_only, params, bf16)
        return fp32, mixed

    for degrees in ({"ep": 8}, {"pp": 4, "dp": 2}, {"cp": 2, "dp": 4}, {"tp": 4, "dp": 2}):
        fp32, mixed = both(**degrees)
        for term in ("ep", "pp", "cp", "tp"):
            assert mixed.comm[term] == pytest.approx(fp32.comm[term] / 2), (degrees, term)
        assert mixed.comm["dp"] == fp32.comm["dp"] and mixed.optimizer == fp32.optimizer
        assert mixed.compute == fp32.compute
    assert both(ep=8)[0].comm["ep"] > 0 and both(tp=4, dp=2)[0].comm["tp"] > 0


def test_the_precision_comes_from_the_config_or_the_flag(tmp_path, capsys):
    base = str(CONFIGS / "dp_pp_ep.yaml")
    fp32 = plan_main(["--config", base, "--devices", "4", "--top", "1"])
    assert "global batch 16, 32-true:" in capsys.readouterr().out
    overlay = tmp_path / "bf16.yaml"
    overlay.write_text(f"config: {base}\ntrainer.precision: bf16-mixed\n")
    mixed = plan_main(["--config", str(overlay), "--devices", "4", "--top", "1"])
    printed = capsys.readouterr().out
    assert "global batch 16, bf16-mixed:" in printed and "priced as bf16-mixed:" in printed
    flagged = plan_main(["--config", base, "--devices", "4", "--top", "1",
                         "--precision", "bf16-mixed"])  # fmt: skip

    def activations(rows):  # by layout and options: the CPU probe's timings may reorder the rows
        return {(r.label, r.options_label): r.activation_bytes for r in rows}

    assert activations(flagged) == activations(mixed) != activations(fp32)
    with pytest.raises(SystemExit):
        plan_main(["--config", base, "--devices", "4", "--precision", "16-mixed"])


def test_layout_auto_plans_in_the_trainers_precision():
    from types import SimpleNamespace

    from lightning_titan.lightning.workload import hardware, workload
    from lightning_titan.plan import auto

    strategy = SimpleNamespace(num_nodes=1, num_processes=2, root_device=torch.device("cpu"),
                               precision_plugin=SimpleNamespace(precision="bf16-mixed"),
                               options=SimpleNamespace(param_dtype="bf16", offload_optimizer=False))  # fmt: skip
    seen = []
    original = auto.choose

    def spy(config, batch, world, device, precision=auto.FP32, compiled=False, policy=None):
        seen.append((precision.name, compiled, policy.param_dtype))
        return original(config, batch, world, device, precision, compiled, policy)

    auto.choose = spy
    try:
        work = workload(SimpleNamespace(config=DEFAULT, hparams={"compile": True}),
                        SimpleNamespace(global_batch_size=16))  # fmt: skip
        auto.choose_for(work, hardware(strategy))
    finally:
        auto.choose = original
    # compiled: no overlapped schedule to choose; the strategy's bf16 weights priced
    assert seen == [("bf16-mixed", True, "bf16")]


def test_rows_are_ranked_by_predicted_step_time(capsys):
    rows = plan_main(["--config", str(CONFIGS / "dp_pp_ep.yaml"), "--devices", "8",
                      "--device", "h100-80gb", "--nodes", "2", "--top", "10000"])  # fmt: skip
    printed = capsys.readouterr().out
    assert [r.cost.step for r in rows] == sorted(r.cost.step for r in rows)
    assert len({(r.options.schedule, r.options.recompute) for r in rows}) >= 6
    overlapped = [r for r in rows if r.options.schedule in OVERLAPPED]
    assert {r.options.schedule for r in overlapped} == set(OVERLAPPED)
    # an all-to-all to hide: ep > 1, or a fold's tp or cp ranks
    assert all(
        r.candidate.dims.expert_world > 1 and r.options.recompute != "full" for r in overlapped
    )
    assert any(r.candidate.degrees["ep"] == 1 for r in overlapped)
    shown = "\n".join(table(overlapped, H100.memory))  # named like the others, pp=1's too
    assert "| 1f1b_overlap M2 |" in shown and "| dualpipev v2 M4 |" in shown
    assert f"**{_ms(rows[0].cost.step)}**" in printed.split("| 1 |")[1].split("\n")[0]
    assert "inter-node 50 GB/s" in printed


def test_no_two_rows_are_the_same_step():
    """GPipe with one microbatch runs 1F1B's order: offered from two microbatches only."""
    found, _ = candidates(DEFAULT, 8, 16)
    seen: dict[tuple, str] = {}
    for r in ranked(DEFAULT, found, 16, H100):
        key = (r.label, r.options.recompute, r.cost.step, r.cost.bubble, r.activation_bytes)
        assert key not in seen, (r.label, r.options_label, seen[key])
        seen[key] = r.options_label
    assert {"1f1b M1", "gpipe M2"} <= set(seen.values()) and "gpipe M1" not in seen.values()


def _layout_of(r) -> str:
    return r.label.split(" ")[0]


def test_only_shows_every_layout_it_names(capsys):
    """A layout whose rows all rank after another's first --top is shown too: each named layout
    gets its own --top rows."""
    args = ["--config", str(CONFIGS / "dp_pp_ep.yaml"), "--devices", "8", "--device", "h100-80gb"]
    everything = plan_main([*args, "--top", "1000"])
    capsys.readouterr()
    fast = _layout_of(everything[0])
    slow = _layout_of(everything[-1])  # ranked after every one of fast's rows but its last
    order = [_layout_of(r) for r in everything if _layout_of(r) in (fast, slow)]
    assert order.index(slow) >= 2 and order.count(slow) >= 2, order  # cut by --top 2 as one list
    plan_main([*args, "--only", fast, slow, "dp3", "--top", "2"])
    printed = capsys.readouterr().out
    rows = [line.split(" | ") for line in printed.splitlines() if line.startswith("| ")]
    shown = [cells[1] for cells in rows if cells[0][2:].isdigit()]
    assert shown.count(fast) == 2 and shown.count(slow) == 2, shown
    assert "no row for dp3" in printed
    found, _ = candidates(DEFAULT, 8, 16)
    picked, lines = only_rows([fast, slow], DEFAULT, found, 16, H100, Precision(), 2)
    assert len(lines) == 2 and all(
        a.cost.step <= b.cost.step for a, b in itertools.pairwise(picked)
    )


def test_times_print_as_plain_milliseconds():
    assert [_ms(s) for s in (3.26012, 0.0355, 0.000921, 1.2e-5, 0.0, 123.456)] == [
        "3,260", "35.5", "0.921", "0.012", "0", "123,456"]  # fmt: skip
    (row,) = ranked(DEFAULT, candidates(DEFAULT, 8, 16)[0][:1], 16, H100)[:1]
    seconds = dataclasses.replace(row, cost=dataclasses.replace(row.cost, step=3.26012))
    (line,) = table([seconds], H100.memory)[2:]
    assert line.endswith("| **3,260** |") and "e+" not in line and "e-" not in line, line


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("pp", [2, 4])
def test_activation_peaks_match_the_measured_ones(pp):
    """Within 10% of what autograd saves (the bench's meter), on every stage's max, gpipe and 1F1B."""
    cases = [Case(pp=pp, schedule=s, impls=(OURS,)) for s in ("gpipe", "1f1b")]
    settings = Settings(config=DEFAULT, global_batch=16, warmup=1, steps=1, rounds=1,
                        traced_steps=0, timeout_s=360)  # fmt: skip
    per_rank = run_on_ranks(run_world, pp, cases, settings, timeout_s=360)
    for i, case in enumerate(cases):
        measured = max(results[i][OURS]["saved_peak_bytes"] for results in per_rank)
        options = StepOptions(case.schedule, settings.num_microbatches(case))
        predicted = peak_bytes(DEFAULT, _layout(pp=pp), options, 16)
        assert predicted == pytest.approx(measured, rel=0.10), (case.name, predicted, measured)


@pytest.mark.timeout(400)
def test_bf16_activation_peaks_match_the_measured_ones():
    """Under bf16-mixed (each step under CPU autocast, one region per step as Lightning's), within
    10% of what autograd saves: bf16 matmul outputs and weight copies, fp32 norms and losses. Priced
    as fp32 (the planner before it knew the precision), the data-parallel layouts miss by 30-45%."""
    bf16 = Precision("bf16-mixed")
    cases = [Case(pp=2, schedule="gpipe", impls=(OURS,)), Case(pp=2, schedule="1f1b", impls=(OURS,)),
             Case(ep=2, impls=(OURS,))]  # fmt: skip
    settings = Settings(config=DEFAULT, global_batch=16, warmup=1, steps=1, rounds=1,
                        traced_steps=0, timeout_s=360, precision=bf16.name)  # fmt: skip
    per_rank = run_on_ranks(run_world, 2, cases, settings, timeout_s=360)
    as_fp32 = {}
    for i, case in enumerate(cases):
        measured = max(results[i][OURS]["saved_peak_bytes"] for results in per_rank)
        options = StepOptions(case.schedule, settings.num_microbatches(case))
        layout = _layout(pp=case.pp, ep=case.ep)
        predicted = peak_bytes(DEFAULT, layout, options, 16, bf16)
        assert predicted == pytest.approx(measured, rel=0.10), (case.name, predicted, measured)
        as_fp32[case.name] = peak_bytes(DEFAULT, layout, options, 16) / measured
    assert as_fp32["ep2"] > 1.2, as_fp32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_runs_predicted_against_measured(capsys):
    tiny = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn_dim=32, n_experts=4,
                       seq_len=16)  # fmt: skip
    rho = check(tiny, 8, 2, 2e9, steps=1, rounds=1)
    printed = capsys.readouterr().out
    assert "| 1 | single |" in printed and "| 2 | " in printed
    assert -1.0 <= rho <= 1.0 and "Spearman rank correlation" in printed


def test_check_runs_each_layout_at_the_microbatch_count_planned():
    """The default model on 8 CPU ranks: the planner's first row is dp2 x pp4 at one microbatch (the
    bubble's idle ranks lend their cores), and --check runs it at that M, not the bench's own."""
    picked = chosen(ModelConfig(), 16, 8, 3e9, 3)
    assert [r.options.microbatches for r in picked] == [_case(r).microbatches for r in picked]
    first = picked[0]
    assert (first.candidate.degrees["pp"], first.options.microbatches) == (4, 1), first


@pytest.mark.parametrize("devices", [4, 8])
def test_the_fullest_rank_is_found_without_counting_every_rank(devices):
    """candidates() counts one rank per stage; every rank's count (layout_state) agrees."""
    for c in candidates(DEFAULT, devices, 16)[0]:
        every = layout_state(DEFAULT, c.degrees, c.zero, fold_ep=c.fold_ep)
        peak = max(sum(s.values()) for s in every) + c.gathered_bytes  # zero=3: during the step
        assert c.state_bytes == peak, c.label


# -- TitanStrategy(layout="auto") -----------------------------------------------------------------


def test_layout_auto_refuses_what_it_would_choose_itself():
    from lightning_titan import TitanStrategy

    with pytest.raises(ValueError, match=r"layout='auto' chooses dp, .*but \{'dp': 2\} was given"):
        TitanStrategy(layout="auto", dp=2)
    with pytest.raises(
        ValueError, match=r"layout='auto' chooses .*\{'zero': 1, 'schedule': 'gpipe'\}"
    ):
        TitanStrategy(layout="auto", zero=1, schedule="gpipe")
    with pytest.raises(ValueError, match="layout='best' is unknown; use 'auto'"):
        TitanStrategy(layout="best")


def test_layout_auto_takes_the_plans_first_row_and_names_what_is_short():
    from lightning_titan.plan.auto import choose
    from lightning_titan.plan.rank import ranked

    device = GPUS["h100-80gb"]  # the catalogue: no probe, the same choice every time
    choice = choose(DEFAULT, 16, 8, device)
    found, _ = candidates(DEFAULT, 8, 16)
    first = ranked(DEFAULT, found, 16, device, recompute=("none",))[0]
    assert choice.degrees == first.candidate.degrees and choice.zero == first.candidate.zero
    assert (choice.schedule, choice.num_microbatches) == (
        first.options.schedule,
        first.options.microbatches,
    )
    assert choice.summary.startswith(first.label.split(" ")[0])
    tiny = dataclasses.replace(device, memory=1e5)
    with pytest.raises(ValueError, match=r"layout='auto': nothing fits: the smallest model state"):
        choose(DEFAULT, 16, 8, tiny)
    with pytest.raises(
        ValueError, match="no layout of 7 devices splits this model and a global batch of 16"
    ):
        choose(DEFAULT, 16, 7, device)  # dp7 does not divide 16; no axis splits this model by 7


def _agree_on(rank, world):
    """Rank 0 holds a choice, then (second round) a module it cannot plan for; the others hold
    none: every rank ends with rank 0's choice, then with its error."""
    from lightning_titan.plan.auto import Choice, Hardware, agree
    from lightning_titan.train.options import Workload

    mine = Choice({"dp": 2}, 0, "1f1b", 1, 1, "dp2") if rank == 0 else None
    hardware = Hardware(nodes=1, processes=world, device=torch.device("cpu"))
    chosen = agree(mine, Workload(), hardware)
    try:
        agree(None, Workload(), hardware)  # a module without a ModelConfig
    except ValueError as error:
        return chosen, f"ValueError: {error}"
    return chosen, None


@pytest.mark.timeout(120)
def test_layout_auto_every_rank_takes_rank_0s_choice_or_its_error():
    (chosen0, error0), (chosen1, error1) = run_on_ranks(_agree_on, 2)
    assert chosen0 == chosen1 and chosen1.summary == "dp2"
    assert error0 == error1 and "plans from the model's ModelConfig" in error1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_titan_fit_with_layout_auto_trains_under_the_choice(tmp_path):
    """configs/auto.yaml on 2 CPU ranks (script launch): the launcher chooses and says so once,
    every rank takes that layout (their groups match: the step runs), and the loss is logged."""
    cmd = [sys.executable, "-m", "lightning_titan", "fit", "--config", str(CONFIGS / "auto.yaml"),
           "--trainer.devices=2", "--trainer.max_steps=2", "--trainer.limit_val_batches=0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "layout='auto' chose" in line
    ]
    assert len(said) == 1, said
    layout = said[0].split("chose ")[1].split(" ")[0]
    assert layout in {c.label.split(" ")[0] for c in candidates(ModelConfig(), 2, 16)[0]}
    (metrics,) = (tmp_path / "runs" / "auto").glob("version_*/metrics.csv")
    header, *rows = metrics.read_text().splitlines()
    column = header.split(",").index("train_loss")
    assert any(r.split(",")[column] for r in rows)  # a loss was logged
