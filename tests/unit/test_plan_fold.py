"""``titan plan`` searches and prices folded layouts (``fold_ep``, MoE Parallel Folding: the experts
over a stage's ep x cp x tp ranks): offered where a stage has cp or tp ranks, refused as the
strategy refuses them, priced with the folded groups (the experts' bytes, the dispatch, the expert
FLOPs, each against numbers worked out here from the shapes), pruned where a twin dominates, and
written to ``--out`` as ``fold_ep``, which ``titan fit`` builds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from lightning_titan import TitanStrategy
from lightning_titan.cli import TitanCLI, check_config_files, cli_components
from lightning_titan.lightning.layout import Layout
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import AXES, ParallelDims
from lightning_titan.plan.auto import _as_choice, choose
from lightning_titan.plan.cost import StepOptions, predict
from lightning_titan.plan.devices import GPUS
from lightning_titan.plan.layouts import candidate, candidates
from lightning_titan.plan.memory import layout_state
from lightning_titan.plan.precision import FP32
from lightning_titan.plan.rank import _Prices, _undominated, ranked
from lightning_titan.tools.plan_cli import main as plan_main
from lightning_titan.tools.plan_cli import only_rows, overlay, parse_folded
from lightning_titan.train.options import TrainOptions

ROOT = Path(__file__).resolve().parents[2]
H100 = GPUS["h100-80gb"]
SMALL = ModelConfig(vocab_size=257, d_model=64, n_layers=4, n_heads=4, ffn_dim=128, n_experts=8)


def _layout(**degrees: int) -> dict[str, int]:
    return {a: degrees.get(a, 1) for a in AXES}


def _pair(config: ModelConfig, degrees: dict[str, int], zero: int = 0, batch: int = 16):
    """(the layout, its folded twin) as ``candidates`` offers them."""
    plain, folded = (candidate(config, degrees, zero, batch, None, f) for f in (False, True))
    assert not isinstance(plain, str) and not isinstance(folded, str), (plain, folded)
    return plain, folded


# ---- the search -----------------------------------------------------------------------------------


def test_folded_layouts_are_offered_where_a_stage_has_tp_or_cp_ranks():
    found, rejected = candidates(SMALL, 8, 16)
    folded = [c for c in found if c.fold_ep]
    assert folded and all(c.degrees["tp"] * c.degrees["cp"] > 1 for c in folded)
    # every unfolded layout with tp or cp has its folded twin (zero 0..2), named with xfold
    twins = {(tuple(c.degrees.values()), c.zero) for c in folded}
    for c in found:
        if not c.fold_ep and c.degrees["tp"] * c.degrees["cp"] > 1 and c.zero < 3:
            assert (tuple(c.degrees.values()), c.zero) in twins, c.label
    assert "dp2xep2xtp2xfold zero2" in {c.label for c in folded}
    # the strategy's refusals: zero=3 with fold_ep (counted under its rule), and a folded expert
    # world that does not divide the experts (8 experts over ep4 x cp4 = 16 ranks)
    assert not any(c.zero == 3 for c in folded) and rejected["fold_ep=True"] > 0
    wide, refused = candidates(SMALL, 16, 16)
    assert all(8 % c.dims.expert_world == 0 for c in wide)
    assert refused["n_experts=8"] > 0
    assert any(c.label == "ep4xcp4" for c in wide)
    assert not any(c.label == "ep4xcp4xfold" for c in wide)  # 16 expert ranks, 8 experts


def test_only_names_a_folded_layout():
    assert parse_folded("pp8xep16xtp2xfold") == (_layout(pp=8, ep=16, tp=2), True)
    assert parse_folded("ep2xtp2") == (_layout(ep=2, tp=2), False)
    assert parse_folded("ep2xfoldxtp2xfold") is None and parse_folded("fold") is None
    found, _ = candidates(SMALL, 4, 16)
    rows, lines = only_rows(["ep2xtp2xfold", "ep4xfold"], SMALL, found, 16, H100, FP32, 1)
    assert [r.label for r in rows] == ["ep2xtp2xfold"] and rows[0].candidate.fold_ep
    assert lines[0].startswith("ep2xtp2xfold: fastest")
    assert "no row for ep4xfold: folding joins a stage's cp and tp ranks" in lines[1]


# ---- the prices, worked out from the shapes --------------------------------------------------------


def test_folded_expert_state_is_the_experts_over_ep_cp_tp():
    """Expert bytes per rank: 3 matrices of D x F per expert, E / (ep*cp*tp) experts (E / ep
    unfolded, whole on each TP rank); AdamW's two moments beside; under zero=1 the folded experts'
    moments split over dp only (their grads reduce over dp: the other ranks of the fold own other
    experts), the unfolded ones' over dp x tp."""
    d, f, e, layers = SMALL.d_model, SMALL.ffn_dim, SMALL.n_experts, SMALL.n_layers
    expert = 3 * d * f * 4  # fp32 bytes of one expert of one layer
    degrees = _layout(dp=2, ep=2, tp=2)
    for zero in (0, 1):
        plain, folded = _pair(SMALL, degrees, zero)
        assert plain.parts["expert_params"] == layers * e // 2 * expert
        assert folded.parts["expert_params"] == layers * e // 4 * expert
        assert folded.parts["expert_grads"] == layers * e // 4 * expert
        moments = 2 * layers * e // 4 * expert
        assert folded.parts["expert_optimizer"] == (moments // 2 if zero else moments)
        assert plain.parts["expert_optimizer"] == 2 * layers * e // 2 * expert // (4 if zero else 1)
        # the non-expert state is the layout's, folded or not
        assert folded.parts["non_expert_params"] == plain.parts["non_expert_params"]
        # the fullest rank found without counting every rank is every rank's fullest
        every = layout_state(SMALL, degrees, zero, fold_ep=True)
        assert folded.state_bytes == max(sum(s.values()) for s in every)


def test_folded_expert_flops_are_the_stages_tokens_over_the_fold():
    """Expert GEMMs per rank: the stage's tokens (its ep data ranks' sequences) x K copies x 6 D F
    FLOPs, forward and backward (x3), over the ep*cp*tp ranks the experts split over, each expert
    whole on one (no TP cut of its own): the same count as unfolded, where a rank's experts see its
    ep group's copies of its own sequence slice."""
    device = dataclasses.replace(H100, pass_s=0.0, split_s=0.0)
    batch, seq, k, d = 16, SMALL.seq_len, SMALL.top_k, SMALL.d_model
    wider = dataclasses.replace(SMALL, ffn_dim=2 * SMALL.ffn_dim)  # only the experts grow
    for degrees in (_layout(ep=2, tp=2), _layout(dp=2, ep=2, cp=2), _layout(tp=4)):
        dims = ParallelDims(**degrees, fold_ep=True)
        stage_tokens = batch // degrees["dp"] * seq  # the ep ranks' sequences, one pipeline
        extra = 3 * stage_tokens * k * 6 * d * SMALL.ffn_dim * SMALL.n_layers / dims.expert_world
        for fold in (True, False):
            costs = [
                predict(c, degrees, 0, StepOptions(), batch, device, (1, 1), fold_ep=fold).compute
                for c in (SMALL, wider)
            ]
            assert (costs[1] - costs[0]) * device.flops == pytest.approx(extra), (degrees, fold)


def test_folded_dispatch_runs_over_the_fold_by_tier():
    """Dispatch bytes per rank: its own positions (b S / (tp cp)) x D x 4 bytes x K copies a layer,
    of which (n-1)/n leave it for the other ranks of the n = ep*cp*tp fold; in one node all on
    NVLink. Each layer a step: dispatch and combine forward and backward, and a count exchange."""
    batch, seq, k, d, layers = 16, SMALL.seq_len, SMALL.top_k, SMALL.d_model, SMALL.n_layers
    degrees = _layout(ep=2, tp=2)
    own = batch // 2 * seq / 2 * d * 4 * layers  # bytes of one copy of the rank's positions
    link = H100.intra
    expected = 4 * (layers * link.latency_s + k * 3 / 4 * own / link.bandwidth)
    expected += layers * link.latency_s
    folded = predict(SMALL, degrees, 0, StepOptions(), batch, H100, (1, 1), fold_ep=True)
    assert folded.comm["ep"] == pytest.approx(expected)
    plain = predict(SMALL, degrees, 0, StepOptions(), batch, H100, (1, 1))
    assert plain.comm["ep"] == pytest.approx(
        4 * (layers * link.latency_s + k / 2 * own / link.bandwidth) + layers * link.latency_s
    )
    # across nodes of 2: the tp pair in a node, 6 of the 8 fold ranks on the network; unfolded the
    # 4 ep ranks each in a node of their own, 3 of 4 on it: the same network bytes
    spread = dataclasses.replace(H100, per_node=2)
    wide = _layout(ep=4, tp=2)
    own = batch // 4 * seq / 2 * d * 4 * layers
    net = H100.inter
    far = 4 * (layers * net.latency_s + k * 6 / 8 * own / net.bandwidth) + layers * net.latency_s
    for fold in (True, False):
        cost = predict(SMALL, wide, 0, StepOptions(), batch, spread, (1, 1), fold_ep=fold)
        assert cost.comm["ep"] == pytest.approx(far), fold


def test_folded_expert_grads_reduce_over_dp_only():
    """The DP term of the expert parameters: folded, over the dp ranks (one here: nothing to
    reduce); unfolded, over dp x tp. The optimizer's zero=1 rows follow the same groups."""
    degrees = _layout(ep=2, tp=2)

    def cost(params: tuple[int, int], fold: bool):
        return predict(SMALL, degrees, 1, StepOptions(), 16, H100, params, fold_ep=fold)

    for fold in (True, False):
        experts = cost((0, 10**8), fold).comm["dp"] - cost((0, 0), fold).comm["dp"]
        assert (experts == 0) == fold, (fold, experts)
    assert cost((0, 10**8), True).optimizer == pytest.approx(10**8 * 32 / H100.memory_bandwidth)
    assert cost((0, 10**8), False).optimizer == pytest.approx(10**8 * 16 / H100.memory_bandwidth)


# ---- pruning --------------------------------------------------------------------------------------


def test_a_twin_that_is_no_faster_in_any_term_is_pruned():
    """Across nodes of 2 the fold's dispatch costs what the unfolded one does (above), and folding
    saves state, expert reductions and optimizer: the unfolded layout is dominated, and dropped.
    In one node the fold sends more over NVLink: both kept."""
    found, _ = candidates(SMALL, 8, 16)
    for per_node, dropped in ((2, True), (8, False)):
        device = dataclasses.replace(H100, per_node=per_node)
        prices = _Prices(SMALL, 16, device, ("none", "full"), FP32, False)
        kept = {c.label for c in _undominated(found, prices)}
        assert "ep4xtp2xfold zero2" in kept
        assert ("ep4xtp2 zero2" not in kept) == dropped, per_node
    # the search with keep=K still finds the first K rows of pricing every undominated layout
    device = dataclasses.replace(H100, per_node=2, memory=2e8)
    prices = _Prices(SMALL, 16, device, ("none", "full"), FP32, False)
    everything = ranked(SMALL, _undominated(found, prices), 16, device)
    top = ranked(SMALL, found, 16, device, keep=10)
    key = [(r.label, r.options_label, r.cost.step) for r in top]
    assert key == [(r.label, r.options_label, r.cost.step) for r in everything[:10]]


# ---- --out, titan fit, layout="auto" ---------------------------------------------------------------


def test_out_writes_fold_ep_and_titan_fit_builds_it(tmp_path, monkeypatch, capsys):
    config = str(ROOT / "configs" / "dp_pp_ep.yaml")
    layout = tmp_path / "layout.yaml"
    rows = plan_main(["--config", config, "--devices", "4", "--device", "h100-80gb",
                      "--only", "ep2xtp2xfold", "--top", "1", "--out", str(layout)])  # fmt: skip
    printed = capsys.readouterr().out
    assert rows[0].candidate.fold_ep and "| 1 | ep2xtp2xfold |" in printed
    assert "wrote ep2xtp2xfold" in printed
    keys = yaml.safe_load(layout.read_text())
    assert keys["trainer.strategy.init_args.fold_ep"] is True
    monkeypatch.chdir(tmp_path)
    args = ["--config", config, "--config", str(layout)]
    check_config_files(args)
    cli = TitanCLI(*cli_components(), run=False, args=args)
    dims = cli.trainer.strategy.parallel_dims
    assert (dims.ep, dims.tp, dims.fold_ep, dims.expert_world) == (2, 2, True, 4)
    # an unfolded row writes false (over a config that folds)
    assert "trainer.strategy.init_args.fold_ep: false" in overlay(
        ranked(SMALL, [_pair(SMALL, _layout(ep=2, tp=2))[0]], 16, H100)[0]
    )


def test_layout_auto_takes_a_folded_first_row():
    """One layer and one sequence on 4 devices: only tp and cp split the model, and unfolded every
    rank holds all the experts. On a device just short of that, only folded layouts fit:
    layout='auto' chooses the planner's first row, folded, and the strategy's layout takes fold_ep
    with it; fold_ep given beside layout='auto' is a contradiction."""
    one = dataclasses.replace(SMALL, n_layers=1, ffn_dim=1024)
    found, _ = candidates(one, 4, 1)
    device = dataclasses.replace(
        H100, memory=min(c.state_bytes for c in found if not c.fold_ep) - 1
    )
    choice = choose(one, 1, 4, device)
    assert choice.fold_ep and "xfold" in choice.summary
    fits = [c for c in found if c.state_bytes <= device.memory]
    assert fits and all(c.fold_ep for c in fits)
    assert _as_choice(ranked(one, fits, 1, device, ("none",), keep=1)[0]) == choice
    layout = Layout(dict.fromkeys(AXES, 1) | {"dp": -1}, "auto", TrainOptions())
    layout.take(choice)
    layout.resolve(4, 0)
    assert layout.dims.fold_ep and layout.dims.expert_world == 4
    with pytest.raises(
        ValueError, match=r"layout='auto' chooses .*fold_ep itself, but \{'fold_ep': True\}"
    ):
        TitanStrategy(layout="auto", fold_ep=True)
