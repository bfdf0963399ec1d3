"""``titan plan`` searches uneven pipeline splits: the split that balances the stages' predicted
compute (the last stage runs the head and the loss too), priced stage by stage (the slowest sets
the pace, the fullest the memory, with the state model the engine's measured bytes are held to),
shown in the table and written to ``--out`` as ``stage_layers``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_titan.cli import TitanCLI, check_config_files, cli_components
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.mesh import AXES, ParallelDims
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.activations import peak_bytes
from lightning_titan.plan.auto import _as_choice
from lightning_titan.plan.cost import StepOptions, balanced_split, predict, stage_flops
from lightning_titan.plan.devices import GPUS
from lightning_titan.plan.layouts import candidates, splits
from lightning_titan.plan.memory import rank_state
from lightning_titan.plan.rank import ranked, step_options
from lightning_titan.tools.plan_cli import main as plan_main
from lightning_titan.tools.plan_cli import overlay, shapes_of
from lightning_titan.train.options import TrainOptions

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK_V3_DIR = ROOT / "tests" / "support" / "fixtures" / "deepseek_v3"
H100 = GPUS["h100-80gb"]
SMALL = ModelConfig(vocab_size=257, d_model=64, n_layers=3, n_heads=4, ffn_dim=128, n_experts=4)


def _layout(**degrees: int) -> dict[str, int]:
    return {a: degrees.get(a, 1) for a in AXES}


def _naive(n_layers: int, pp: int) -> tuple[int, ...]:
    """The remainder on the first stages: what a split that ignores the head does."""
    base, extra = divmod(n_layers, pp)
    return tuple(base + (s < extra) for s in range(pp))


def _stage_seconds(config: ModelConfig, counts: tuple[int, ...], tokens: float) -> list[float]:
    """Each stage's forward + backward FLOPs over the device's throughput (the embedding is free)."""
    embed, layer, head = stage_flops(config)
    last = len(counts) - 1
    return [
        3 * tokens * (n * layer + (s == 0) * embed + (s == last) * head) / H100.flops
        for s, n in enumerate(counts)
    ]


def test_deepseek_v3_is_split_over_16_stages_better_than_naively(capsys):
    """61 layers (prime) allowed only pp=1 evenly; pp=16 (the published PP) now has a split that
    sums to 61, whose slowest stage is faster than the naive split's, and ``predict`` paces the
    pipeline by that slowest stage."""
    config = shapes_of(DEEPSEEK_V3_DIR, 4096)
    capsys.readouterr()
    (split,) = splits(config, 16)
    assert split is not None and len(split) == 16 and sum(split) == 61
    assert split[-1] < max(split)  # the head's stage holds fewer layers
    naive = _naive(61, 16)
    ours, theirs = _stage_seconds(config, split, 1), _stage_seconds(config, naive, 1)
    assert max(ours) < max(theirs)
    assert max(ours) - min(ours) < max(theirs) - min(theirs)
    # without EP (whose per-layer all-to-alls the split does not weigh) compute sets the pace
    degrees, options = _layout(pp=16, dp=16), StepOptions("1f1b", 16)
    balanced = predict(config, degrees, 0, options, 256, H100, (1, 1), stage_layers=split)
    naive_cost = predict(config, degrees, 0, options, 256, H100, (1, 1), stage_layers=naive)
    assert balanced.compute < naive_cost.compute and balanced.step < naive_cost.step
    tokens = 256 // 16 * config.seq_len  # a rank's 16 sequences' positions
    per_pass = 16 * 5 * H100.pass_s  # M=16 passes of the slowest stage's 4 layers and the embedding
    slowest = max(_stage_seconds(config, split, tokens))
    assert balanced.compute == pytest.approx(slowest + per_pass, rel=1e-6)
    # every pp from 2 to 32 now splits 61 layers; 64 stages cannot (each middle one needs a layer)
    assert all(splits(config, pp)[0] is not None for pp in (2, 4, 8, 16, 32))
    assert splits(config, 64) == [None]


def test_an_even_split_is_priced_as_before_and_kept_where_it_divides():
    """pp dividing the layers keeps the even split (None, the strategy's default), and the
    balanced one beside it only where it differs; an explicit even split prices as None does."""
    deep = ModelConfig(
        vocab_size=50000, d_model=64, n_layers=8, n_heads=4, ffn_dim=128, n_experts=4
    )
    assert splits(SMALL, 1) == [None]
    assert splits(deep, 2) == [None, balanced_split(deep, 2)] and balanced_split(deep, 2)[1] < 4
    flat = ModelConfig(vocab_size=64, d_model=64, n_layers=8, n_heads=4, ffn_dim=128, n_experts=4)
    assert splits(flat, 2) == [None]  # a tiny head: the balanced split is the even one
    degrees = _layout(pp=2, ep=2)
    for options in (StepOptions("1f1b", 2), StepOptions("gpipe", 4, recompute="full")):
        even = predict(deep, degrees, 0, options, 16, H100, (1, 1))
        explicit = predict(deep, degrees, 0, options, 16, H100, (1, 1), stage_layers=(4, 4))
        assert even == explicit
        assert peak_bytes(deep, degrees, options, 16) == peak_bytes(
            deep, degrees, options, 16, stage_layers=(4, 4)
        )
    # the last stage holds the head's large logits (a 50,000 vocabulary): a fifth layer there
    # raises the peak
    options = StepOptions("1f1b", 4)
    fuller = peak_bytes(deep, degrees, options, 16, stage_layers=(3, 5))
    assert fuller > peak_bytes(deep, degrees, options, 16)


def test_an_uneven_candidates_state_is_rank_state_of_its_split():
    """The planner's memory per stage is ``rank_state(config, dims, zero, split)``, the function
    tests/distributed/test_equivalence.py holds to the bytes measured under SPLIT cases: the
    candidate's state is that of its fullest rank over every rank, and differs from the even
    split's."""
    found, _ = candidates(SMALL, 4, 16)
    uneven = [c for c in found if c.stage_layers is not None]
    assert uneven and all(c.degrees["pp"] > 1 and sum(c.stage_layers) == 3 for c in uneven)
    for c in uneven:
        split = StageSplit(1, c.stage_layers)
        world = math.prod(c.degrees.values())
        every = [
            rank_state(SMALL, ParallelDims(**c.degrees, rank=r, fold_ep=c.fold_ep), c.zero, split)
            for r in range(world)
        ]
        peak = max(sum(s.values()) for s in every) + c.gathered_bytes  # zero=3: in the step
        assert c.state_bytes == peak, c.label
        assert c.parts in every
        layers = [0] * c.degrees["pp"]
        for r in range(world):
            dims = ParallelDims(**c.degrees, rank=r)
            ((start, end),) = split.chunk_ranges(3, dims.pp, dims.pp_rank)
            layers[dims.pp_rank] = end - start
        assert tuple(layers) == c.stage_layers


def test_uneven_splits_run_the_one_chunk_schedules_and_show_in_the_table(capsys):
    """An uneven split has one count per stage: 1F1B, GPipe and ZB-H1 run it, not the chunked or V
    schedules; its rows rank with the others and name the split."""
    found, _ = candidates(SMALL, 2, 16)
    uneven = next(c for c in found if c.stage_layers is not None)
    options = step_options(SMALL, uneven.degrees, 16, stage_layers=uneven.stage_layers)
    assert options and {o.virtual_stages for o in options} == {1}
    assert {o.schedule for o in options} == {"1f1b", "gpipe", "zb_h1"}
    rows = ranked(SMALL, [uneven], 16, H100)
    assert rows and all(r.candidate.stage_layers == uneven.stage_layers for r in rows)
    # LoRA's adapters over the split's stages (the reductions carry the first stage's)
    lora = ranked(SMALL, [uneven], 16, H100, lora=LoRA(rank=4, targets=("attention",)))
    assert lora and lora[0].cost.step > 0
    # layout="auto" takes the split with the layout
    options = _as_choice(rows[0]).applied_to(TrainOptions())
    assert options.stage_layers == uneven.stage_layers


def test_out_carries_stage_layers_to_titan_fit(tmp_path, monkeypatch, capsys):
    """A 3-layer model on pp=2: ``--only pp2`` prints the split in the table and ``--out`` writes it
    as ``stage_layers``, which ``titan fit`` builds its strategy with; an even row writes null."""
    base = tmp_path / "three.yaml"
    base.write_text(
        f"config: {ROOT / 'configs' / 'base.yaml'}\nmodel.model.init_args.n_layers: 3\n"
    )
    overlay = tmp_path / "layout.yaml"
    rows = plan_main(["--config", str(base), "--devices", "2", "--device", "h100-80gb",
                      "--only", "pp2", "--top", "1", "--out", str(overlay)])  # fmt: skip
    printed = capsys.readouterr().out
    split = rows[0].candidate.stage_layers
    assert split is not None and sum(split) == 3
    cell = ",".join(map(str, split))
    assert f"| 1 | pp2 [{cell}] |" in printed and f"stage_layers {cell} to " in printed
    keys = yaml.safe_load(overlay.read_text())
    assert keys["trainer.strategy.init_args.stage_layers"] == list(split)
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(base), "--config", str(overlay)]
    check_config_files(args)
    cli = TitanCLI(*cli_components(), run=False, args=args)
    assert cli.trainer.strategy.options.stage_layers == split
    assert cli.trainer.strategy.parallel_dims.pp == 2
    even = plan_main(["--config", str(base), "--devices", "2", "--device", "h100-80gb",
                      "--only", "ep2", "--top", "1", "--out", str(overlay)])  # fmt: skip
    assert even[0].candidate.stage_layers is None
    assert yaml.safe_load(overlay.read_text())["trainer.strategy.init_args.stage_layers"] is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_uneven_plan_trains_under_titan_fit(tmp_path):
    """`titan plan --out` of an uneven split, then `titan fit` with it: one step on 2 CPU ranks,
    the stages built with the planned layers."""
    base = tmp_path / "three.yaml"
    base.write_text(
        f"config: {ROOT / 'configs' / 'base.yaml'}\nmodel.model.init_args.n_layers: 3\n"
    )
    plan = ["plan", "--config", str(base), "--devices", "2", "--only", "pp2", "--top", "1",
            "--out", "layout.yaml"]  # fmt: skip
    fit = ["fit", "--config", str(base), "--config", "layout.yaml", "--trainer.max_steps=1",
           "--trainer.limit_val_batches=0"]  # fmt: skip
    said = []
    for args in (plan, fit):
        proc = subprocess.run([sys.executable, "-m", "lightning_titan", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=280)  # fmt: skip
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
        said.append(proc.stdout)
    split = yaml.safe_load((tmp_path / "layout.yaml").read_text())
    assert sum(split["trainer.strategy.init_args.stage_layers"]) == 3
    assert "final train_loss" in said[1], said[1][-2000:]


# ---- interleaved 1F1B on uneven splits: v = 2..8 --------------------------------------------------


def _rank_sums(split: StageSplit, n_layers: int, pp: int) -> tuple[int, ...]:
    return tuple(
        sum(end - start for start, end in split.chunk_ranges(n_layers, pp, r)) for r in range(pp)
    )


def test_interleaved_runs_uneven_splits_with_every_v_the_layers_allow():
    """DeepSeek-V3's 61 layers on pp=4 (16, 16, 15, 14 a rank): interleaved 1F1B with v = 2..8,
    each option's layers per virtual stage accepted by the engine's ``StageSplit.counts`` and
    summing per rank to the layout's split (the state and compute it is priced with); on 12 layers
    and pp=2 (even), v = 2..6 (v > 6 leaves a chunk without a layer), the uneven ones dealt."""
    from lightning_titan.tools.plan_published import DEEPSEEK_V3

    layers = (16, 16, 15, 14)
    offered = step_options(DEEPSEEK_V3, _layout(pp=4, ep=64), 8, ("full",), stage_layers=layers)
    chunked = {o.virtual_stages: o for o in offered if o.schedule == "interleaved_1f1b"}
    assert set(chunked) == set(range(2, 9))
    assert {o.microbatches for o in offered if o.schedule == "interleaved_1f1b"} == {4, 8}
    for v, o in chunked.items():
        split = StageSplit(v, o.virtual_layers)
        assert len(split.counts(61, 4)) == 4 * v and _rank_sums(split, 61, 4) == layers, v
    twelve = ModelConfig(vocab_size=257, d_model=64, n_layers=12, n_heads=4, ffn_dim=128,
                         n_experts=4)  # fmt: skip
    offered = step_options(twelve, _layout(pp=2, ep=2), 16, ("none",))
    chunked = {o.virtual_stages: o for o in offered if o.schedule == "interleaved_1f1b"}
    assert set(chunked) == {2, 3, 4, 5, 6}
    for v, o in chunked.items():
        assert (o.virtual_layers is None) == (12 % (2 * v) == 0), v  # even where it divides
        assert _rank_sums(StageSplit(v, o.virtual_layers), 12, 2) == (6, 6), v
    # --out and layout="auto" carry the per-virtual-stage counts
    found, _ = candidates(twelve, 4, 16)
    layout = [c for c in found if c.degrees == _layout(pp=2, ep=2) and c.stage_layers is None]
    rows = [r for r in ranked(twelve, layout, 16, H100) if r.options.virtual_layers is not None]
    assert rows
    counts = list(rows[0].options.virtual_layers)
    assert f"stage_layers: {counts}" in overlay(rows[0])
    assert _as_choice(rows[0]).applied_to(TrainOptions()).stage_layers == tuple(counts)


def test_61_layers_over_32_virtual_stages_are_balanced_within_a_layer():
    """The VP8 split of DeepSeek-V3 on pp=4: 32 counts summing to 61, each virtual stage's
    predicted compute (its layers, the head and loss on the last) within one layer of every other,
    and its slowest no slower than the best split of 61 layers over 32 stages (``balanced_split``)."""
    from lightning_titan.plan.cost import virtual_split
    from lightning_titan.tools.plan_published import DEEPSEEK_V3

    counts = virtual_split(DEEPSEEK_V3, 4, 8, (16, 16, 15, 14))
    assert counts is not None and len(counts) == 32 and sum(counts) == 61
    _, layer, head = stage_flops(DEEPSEEK_V3)

    def costs(split: tuple[int, ...]) -> list[float]:
        return [n * layer + (s == len(split) - 1) * head for s, n in enumerate(split)]

    assert max(costs(counts)) - min(costs(counts)) <= layer
    assert max(costs(counts)) <= max(costs(balanced_split(DEEPSEEK_V3, 32)))
    assert StageSplit(8, counts).counts(61, 4) == list(counts)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_interleaved_bubble_at_v_is_the_formula_and_the_replay(pp):
    """(pp-1)/v of fill over M microbatches, for v = 1..8: the planner's fraction, the replayed
    schedule's (``theory.ideal_bubble``), and ``predict``'s bubble over its compute, (pp-1)/(vM);
    the peak chunk-microbatches of ``held`` against the replay's live count."""
    from lightning_titan.parallel.pipeline.theory import ideal_bubble
    from lightning_titan.plan.activations import held, live_peak
    from lightning_titan.plan.cost import bubble_fraction

    config = ModelConfig(vocab_size=257, d_model=64, n_layers=64, n_heads=4, ffn_dim=128,
                         n_experts=4)  # fmt: skip
    for v in range(1, 9):
        for m in (pp, 2 * pp):
            schedule = "interleaved_1f1b" if v > 1 else "1f1b"
            formula = (pp - 1) / v / (m + (pp - 1) / v)
            assert bubble_fraction(schedule, pp, m, v) == pytest.approx(formula, rel=1e-12)
            assert ideal_bubble(schedule, pp, v, m) == pytest.approx(formula, rel=1e-9), (v, m)
            options = StepOptions(schedule, m, v)
            cost = predict(config, _layout(pp=pp), 0, options, 4 * m, H100, (10**6, 0))
            assert cost.bubble / cost.compute == pytest.approx((pp - 1) / (v * m), rel=1e-9)
            if v > 1:
                for r in range(pp):
                    live = live_peak(schedule, pp, r, v, m, [1] * v)[0]
                    assert held(options, pp, r) * v == pytest.approx(live), (v, m, r)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_wide_vocabulary_is_priced_from_two_narrow_ones(monkeypatch, precision):
    """The probe measures the embedding, head and loss at ``PROBE_VOCAB`` and twice it and draws the
    line through them (a 150k vocabulary's logits held it at 8.6 GB): at a vocabulary it can also
    measure whole, the line gives the measured bytes."""
    from lightning_titan.plan import activations
    from lightning_titan.plan.precision import Precision

    config = ModelConfig(
        vocab_size=1_000, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, n_experts=4, seq_len=64
    )
    whole = activations.per_sequence(config, Precision(precision))
    monkeypatch.setattr(activations, "_PER_SEQUENCE", {})
    monkeypatch.setattr(activations, "PROBE_VOCAB", 300)
    drawn = activations.per_sequence(config, Precision(precision))
    assert drawn[0] == whole[0]
    assert drawn[1] == pytest.approx(whole[1], rel=1e-12)
