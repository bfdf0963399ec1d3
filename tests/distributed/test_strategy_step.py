"""One step through Trainer + TitanStrategy(dp2 x pp2 x ep2, gradient_clip_norm, zero=2) on a plain
DataLoader, checked on every rank (tests/support/scripts/one_step.py records what each rank saw):

- the sampler gives each rank its data rank: all stages of one pipeline read the same rows, DP and EP
  ranks different rows, and together the global batch;
- a per-rank init is overwritten by the broadcast: every replicated parameter (and every expert row)
  equals its group's first rank's;
- the configured clip norm bites: the weights after the step equal those of an independent reference
  (tests/mixtral_reference.py) with the gradient clipped to ``MAX_NORM``, not the unclipped ones;
- zero=2: each rank's optimizer holds about half of its parameters' elements (non-expert ones split
  over 4 ranks, expert ones over 2), its grads are only its rows (reduce-scattered; the pre-clip norm
  composed from them equals the reference's), and the all-gather makes every rank's weights whole.
- the expert bias moves after the optimizer step by the step's global loads (every data rank's
  tokens): each rank's bias equals one process's update from the whole batch.
  (ZeRO-1 through the strategy: the CLI's main job in tests/cli/test_cli.py.)
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mixtral_reference import loss_and_grads

from lightning_titan import ParallelDims, StageModel
from lightning_titan.model.moe.balance import bias_step

SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "scripts"
sys.path.insert(0, str(SCRIPTS))
import one_step  # noqa: E402


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_step")
    cmd = [sys.executable, str(SCRIPTS / "one_step.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    world = one_step.LAYOUT["dp"] * one_step.LAYOUT["pp"] * one_step.LAYOUT["ep"]
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _dims(rank: int) -> ParallelDims:
    return ParallelDims(*one_step.LAYOUT.values(), rank)


def expected_initial() -> dict[str, torch.Tensor]:
    """The full model as the broadcast leaves it: each tensor (each expert row block) from the first rank
    of its group, i.e. the layout-free init plus that rank's noise."""
    model = StageModel(one_step.CONFIG)
    model.init_weights(one_step.SEED)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers_per_stage = one_step.CONFIG.n_layers // one_step.LAYOUT["pp"]
    experts_per_rank = one_step.CONFIG.n_experts // one_step.LAYOUT["ep"]
    dims = _dims(0)
    for name, w in full.items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        pp = (
            0
            if name == "embed.weight"
            else dims.pp - 1
            if layer is None
            else layer // layers_per_stage
        )
        if ".experts." not in name:
            w += one_step.rank_noise(dims.rank_of(0, pp, 0), name, w.shape)
            continue
        for ep in range(dims.ep):
            rows = slice(ep * experts_per_rank, (ep + 1) * experts_per_rank)
            w[rows] += one_step.rank_noise(dims.rank_of(0, pp, ep), name, w[rows].shape)
    return full


def _local(full: torch.Tensor, name: str, expert_range: tuple[int, int]) -> torch.Tensor:
    return full[slice(*expert_range)] if ".experts." in name else full


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_rank_reads_its_data_rank(records):
    rows_of = {}
    for rank, r in enumerate(records):
        dims = _dims(rank)
        assert r["sampler"] == {"num_replicas": 4, "rank": dims.data_rank}, f"rank {rank}"
        ((inputs, targets),) = r["batches"]
        seen = rows_of.setdefault(dims.data_rank, (inputs, targets))
        # every stage of one pipeline reads the same rows (stage 0 the inputs, the last the targets)
        assert torch.equal(seen[0], inputs) and torch.equal(seen[1], targets), f"rank {rank}"
    got = torch.cat([rows_of[d][0] for d in sorted(rows_of)])
    assert len(rows_of) == 4
    want = one_step.dataset().tensors[0]
    # DP and EP ranks read different rows, and together the whole global batch once
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_rank_init_is_broadcast_and_the_clip_norm_bites(records):
    initial = expected_initial()
    inputs, targets = one_step.dataset().tensors
    values, grads = loss_and_grads(initial, inputs, targets, one_step.CONFIG)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    scale = one_step.MAX_NORM / norm
    assert scale < 0.5, "clipping must bite for the test to check it"
    for rank, r in enumerate(records):
        where = f"rank {rank} coords {r['coords']}"
        held = sum(w.numel() for w in r["initial"].values())
        assert r["optimizer_numel"] < 0.55 * held, f"{where}: the optimizer is not sharded"
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-4), where
        for name, w0 in r["initial"].items():
            want = _local(initial[name], name, r["expert_range"])
            assert torch.equal(w0, want), f"{where} {name}: not its group's first rank's value"
            step = w0 - r["final"][name]
            g = _local(grads[name], name, r["expert_range"]) * one_step.LR
            atol = 1e-5 * g.abs().max().item() * scale + 1e-7
            torch.testing.assert_close(step, g * scale, rtol=1e-3, atol=atol, msg=f"{where} {name}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_bias_moves_by_the_global_loads(records):
    """Through TitanLM and the strategy's optimizer_step: the step's counts from every data rank."""
    model = StageModel(one_step.CONFIG)
    model.load_state_dict({**model.state_dict(), **expected_initial()})
    inputs, _ = one_step.dataset().tensors
    with torch.no_grad():
        model(inputs)  # the bias is zero in the step's forward: the same choices
    rate = one_step.CONFIG.router_bias_update_rate
    for rank, r in enumerate(records):
        assert r["biases"], f"rank {rank} holds no expert bias"
        for name, bias in r["biases"].items():
            layer = model.get_submodule(name.removesuffix(".expert_bias"))
            want = bias_step(layer.tokens_per_expert, rate)
            assert want.abs().sum() > 0 and torch.equal(bias, want), (rank, name, bias, want)
