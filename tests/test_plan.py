"""titan plan (issue 20, first slice): the layouts the strategy accepts and each one's model state.

The state model itself is checked against measured runs: every equivalence case's ranks
(tests/test_equivalence.py) and every quick-bench case (tests/test_bench.py). Here, in one process:
the enumeration against the strategy's own rules, a published parameter count, the overlay a user
feeds back to `titan fit`, and the errors.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_titan.cli import TitanCLI, cli_components
from lightning_titan.model import ModelConfig
from lightning_titan.parallel_dims import AXES
from lightning_titan.plan.cli import main as plan_main
from lightning_titan.plan.layouts import candidates, factorizations, total_params

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
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


def test_the_overlay_is_the_layout_titan_fit_builds(tmp_path, monkeypatch, capsys):
    overlay = tmp_path / "layout.yaml"
    config = str(CONFIGS / "dp_pp_ep.yaml")
    fits = plan_main(["--config", config, "--devices", "4", "--out", str(overlay)])
    printed = capsys.readouterr().out
    assert "| 1 | " in printed and "model state only" in printed
    assert fits and all(a.state_bytes <= b.state_bytes for a, b in itertools.pairwise(fits))
    monkeypatch.chdir(tmp_path)
    args = ["--config", config, "--config", str(overlay), "--model.model.seq_len=32"]
    cli = TitanCLI(*cli_components(), run=False, args=args)
    dims = cli.trainer.strategy.parallel_dims
    assert dims.degrees == fits[0].degrees and cli.trainer.num_devices == 4
    assert cli.trainer.strategy.options.zero == fits[0].zero


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "8", "--device", "tpu"], "--device='tpu' is unknown"),
        (["--devices", "0"], "--devices=0 must be a positive number"),
        (["--devices", "8", "--global-batch", "0"], "--global-batch=0 must be a positive"),
        (["--devices", "8", "--memory-gb", "0.001"], "nothing fits: the smallest model state"),
        (["--devices", "7"], "no layout of these devices splits this model"),
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
