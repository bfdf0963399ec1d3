"""Which layers each pipeline rank holds (``pipeline.split``), without processes: every layer once, in
model order over the virtual stages, under global names; a chain of the ranks' chunks in virtual-stage
order computes the single model's logits; a split that does not fit is refused with the fix."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from engine_harness import CONFIG, FAMILY_CONFIGS, SEED

from lightning_titan.model.decoder import StageModel
from lightning_titan.parallel.pipeline.split import StageCosts, StageSplit, balance
from lightning_titan.train.auto_split import agree, probe_costs, probe_models
from lightning_titan.train.options import TrainOptions


def test_round_robin_chunks_megatron_order():
    split = StageSplit(virtual_stages=2)
    assert split.chunk_ranges(4, 2, 0) == [(0, 1), (2, 3)]
    assert split.chunk_ranges(4, 2, 1) == [(1, 2), (3, 4)]
    uneven = StageSplit(virtual_stages=2, stage_layers=[2, 1, 1, 0])
    assert uneven.chunk_ranges(4, 2, 0) == [(0, 2), (3, 4)]
    assert uneven.chunk_ranges(4, 2, 1) == [(2, 3), (4, 4)]  # the head chunk holds no layer
    assert StageSplit(stage_layers=[3, 1]).chunk_ranges(4, 2, 1) == [(3, 4)]


@pytest.mark.parametrize(
    "pp,v,layers",
    [(2, 1, None), (4, 1, None), (2, 2, None), (4, 2, None), (3, 2, [1, 2, 1, 1, 2, 1]),
     (2, 1, [7, 1]), (2, 2, [0, 3, 3, 2]), (4, 1, [2, 2, 3, 1])],
)  # fmt: skip
def test_every_layer_once_in_model_order(pp, v, layers):
    split = StageSplit(v, layers)
    by_virtual_stage = {
        chunk * pp + p: r for p in range(pp) for chunk, r in enumerate(split.chunk_ranges(8, pp, p))
    }
    ranges = [by_virtual_stage[s] for s in range(pp * v)]
    assert [start for start, _ in ranges] == [0] + [end for _, end in ranges[:-1]]
    assert ranges[-1][1] == 8
    if layers is not None:
        assert [end - start for start, end in ranges] == list(layers)


@pytest.mark.parametrize(
    "pp,v,layers",
    [
        (2, 1, [3, 1]),
        (4, 1, [2, 1, 1, 0]),
        (4, 1, [0, 2, 1, 1]),
        (2, 2, None),
        (2, 2, [2, 1, 1, 0]),
    ],
)
def test_the_ranks_chunks_chained_compute_the_single_model(pp, v, layers):
    """Virtual stage s = chunk s // pp of rank s % pp, run in order, gives the full model's logits and
    aux; together the ranks hold every parameter of the full model once, under its global name."""
    config = replace(CONFIG, n_layers=4)
    split = StageSplit(v, layers)
    full = StageModel(config)
    full.init_weights(SEED)
    ranks = [StageModel(config, pp_rank=p, pp=pp, split=split) for p in range(pp)]
    for model in ranks:
        model.init_weights(SEED)
    names = [n for model in ranks for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    tokens = torch.randint(
        0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0)
    )
    x, aux = tokens, torch.zeros(2)
    for s in range(pp * v):
        x, chunk_aux = ranks[s % pp](x, chunk=s // pp)
        aux = aux + chunk_aux
    want_logits, want_aux = full(tokens)
    torch.testing.assert_close(x, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(aux, want_aux, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "pp,v,layers,match",
    [
        (2, 1, [3, 2], r"stage_layers=\[3, 2\] sums to 5 but the model has n_layers=4; make the "
                       r"counts sum to 4"),
        (2, 1, [4], r"stage_layers=\[4\] has 1 entries but there are pp=2 = 2 stages"),
        (2, 2, [2, 2], r"has 2 entries but there are pp \* virtual_stages = 2 \* 2 = 4 virtual "
                       r"stages.*chunk s // pp of rank s % pp"),
        (3, 1, [2, 0, 2], r"stage_layers=\[2, 0, 2\] leaves stage 1 without layers; only the first "
                          r"\(embedding\) and the last \(head\) stage may hold 0"),
        (3, 1, None, r"n_layers=4 is not divisible by pp=3; choose pp dividing 4"),
        (2, 3, None, r"n_layers=4 is not divisible by pp \* virtual_stages = 2 \* 3 = 6"),
    ],
)  # fmt: skip
def test_a_split_that_does_not_fit_is_named_with_the_fix(pp, v, layers, match):
    with pytest.raises(ValueError, match=match):
        CONFIG.validate_layout(pp, 1, split=StageSplit(v, layers))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"virtual_stages": 0}, r"virtual_stages=0 must be a positive int"),
        ({"stage_layers": [2, -1]}, r"stage_layers=\[2, -1\] must hold ints >= 0"),
        ({"stage_layers": "even"}, r"stage_layers='even' must be a list of layer counts, one per "
                                   r"\(virtual\) stage, 'auto'"),
        ({"schedule": "interleaved_1f1b"}, r"needs virtual_stages >= 2 .*got 1"),
        ({"virtual_stages": 2}, r"virtual_stages=2 needs a schedule over several chunks per "
                                r"rank, not schedule='1f1b'; choose one of 'dualpipev', "
                                    r"'interleaved_1f1b', 'zbv'"),
        ({"schedule": "zbv"}, r"schedule='zbv' places exactly two chunks .* virtual_stages=1 "
                              r"does not work; use TitanStrategy\(schedule='zbv', "
                              r"virtual_stages=2\)"),
    ],
)  # fmt: skip
def test_bad_split_options_fail_where_they_are_given(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainOptions(**kwargs)


def test_microbatches_the_interleaved_schedule_cannot_run_say_which_work():
    options = TrainOptions(schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=3)
    with pytest.raises(
        ValueError,
        match=r"num_microbatches=3 does not work; use a multiple of 2 "
        r"\(M = 2, 4, 6, ...\)",
    ):
        options.microbatches(12, pp=2)
    assert TrainOptions(schedule="interleaved_1f1b", virtual_stages=2).microbatches(8, pp=4) == 4


def _slowest(costs: StageCosts, counts) -> float:
    extra = [costs.embed] + [0.0] * (len(counts) - 2) + [costs.head] if len(counts) > 1 else [0.0]
    if len(counts) > 1:
        return max(n * costs.block + e for n, e in zip(counts, extra, strict=True))
    return counts[0] * costs.block + costs.embed + costs.head


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n_layers", [4, 5, 8])
@pytest.mark.parametrize("head", [0.0, 0.7, 2.0, 3.5])
def test_auto_balance_makes_the_slowest_stage_as_fast_as_any_split(stages, n_layers, head):
    """Against every split by brute force: no split has a faster slowest stage (middle stages >= 1)."""
    costs = StageCosts(embed=0.3, block=1.0, head=head)
    counts = balance(costs, n_layers, stages)
    assert sum(counts) == n_layers and all(n >= 1 for n in counts[1:-1])
    best = min(
        _slowest(costs, c)
        for c in itertools.product(range(n_layers + 1), repeat=stages)
        if sum(c) == n_layers and all(n >= 1 for n in c[1:-1])
    )
    assert _slowest(costs, counts) == pytest.approx(best)


def test_auto_gives_the_head_stage_fewer_layers_and_says_why():
    assert balance(StageCosts(0.0, 1.0, 2.0), 4, 2) == [3, 1]
    assert balance(StageCosts(0.0, 1.0, 0.0), 4, 2) == [2, 2]
    with pytest.raises(ValueError, match=r"cannot split n_layers=2 over 5 stages.*at most 4"):
        balance(StageCosts(0.0, 1.0, 0.0), 2, 5)
    with pytest.raises(ValueError, match=r"cannot split n_layers=4 over 8 stages"):
        CONFIG.validate_layout(4, 1, split=StageSplit(2, "auto"))  # what preflight runs
    with pytest.raises(RuntimeError, match=r"stage_layers='auto' is chosen by a probe"):
        StageModel(CONFIG, pp_rank=0, pp=2, split=StageSplit(stage_layers="auto"))
    costs = probe_costs(CONFIG, 2, torch.device("cpu"), repeats=1)
    assert costs.block > 0 and costs.head > 0 and "head + loss" in costs.describe()
    counts, probed = agree(CONFIG, 2, 1, 2, torch.device("cpu"))  # one process: no broadcast
    assert sum(counts) == CONFIG.n_layers and probed.block > 0


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("dense", [1, 3])
def test_auto_balance_costs_dense_layers_apart(stages, dense):
    """DeepSeek-V3's cheaper dense first layers: against every split by brute force."""
    costs = StageCosts(embed=0.3, block=1.0, head=0.7, dense_block=0.2)
    layers = [costs.dense_block] * dense + [costs.block] * (8 - dense)

    def slowest(c: tuple[int, ...]) -> float:
        starts = list(itertools.accumulate(c, initial=0))
        per = [sum(layers[starts[s] : starts[s + 1]]) for s in range(stages)]
        per[0] += costs.embed
        per[-1] += costs.head
        return max(per)

    counts = balance(costs, 8, stages, dense)
    assert sum(counts) == 8 and all(n >= 1 for n in counts[1:-1])
    best = min(
        slowest(c)
        for c in itertools.product(range(9), repeat=stages)
        if sum(c) == 8 and all(n >= 1 for n in c[1:-1])
    )
    assert slowest(tuple(counts)) == pytest.approx(best)
    assert balance(StageCosts(0.0, 1.0, 0.0, 0.2), 8, 2, 3) == [5, 3]  # the dense ones weigh less


def test_the_probe_times_a_dense_block_apart():
    config = FAMILY_CONFIGS["deepseek"]
    moe, dense = probe_models(config)
    assert moe.layers["0"].moe is not None and dense is not None and dense.layers["0"].moe is None
    costs = probe_costs(config, 2, torch.device("cpu"), repeats=1)
    assert costs.block > 0 and costs.dense_block > 0
    assert probe_costs(CONFIG, 2, torch.device("cpu"), repeats=1).dense_block == 0.0
