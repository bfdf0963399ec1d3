"""``titan plan`` prices selective recompute (``activation_checkpointing: selective``): the probe runs
the model with it, so the activations are what the engine keeps (the norms' and the gated
activations' outputs freed after use); the compute is no matmul more, the norms' and activations'
bytes streamed again; the search offers it beside none and full, and ``--out`` writes it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import AXES
from lightning_titan.plan.activations import per_sequence
from lightning_titan.plan.cost import StepOptions, predict, selective_bytes
from lightning_titan.plan.devices import GPUS
from lightning_titan.plan.layouts import candidates
from lightning_titan.plan.precision import FP32
from lightning_titan.plan.rank import ranked
from lightning_titan.tools.plan_cli import overlay

# d_model at most the probe's width: measured as it is, no scaling
CONFIG = ModelConfig(
    vocab_size=257, d_model=64, n_layers=2, n_heads=4, ffn_dim=96, n_experts=4, seq_len=32
)
# wide enough that a matmul costs more than streaming its rows (on a tiny model the bytes win)
WIDE = replace(CONFIG, d_model=512, n_heads=8, ffn_dim=1024, seq_len=1024)
H100 = GPUS["h100-80gb"]


def _layout(**degrees: int) -> dict[str, int]:
    return {a: degrees.get(a, 1) for a in AXES}


def test_selective_frees_exactly_the_norms_and_the_activations_of_a_block():
    """What a block stops keeping, counted by hand from the shapes (fp32): each of the two norms'
    output and its per-token rms (``D + 1`` floats, twice: the normalized rows and the weighted
    ones the projections read), and the gated activation's two tensors (silu(gate) and the
    product) of each of the ``K`` routed rows of ``F``."""
    none, ends = per_sequence(CONFIG, FP32, "none")
    selective, ends_selective = per_sequence(CONFIG, FP32, "selective")
    d, k, f, s = CONFIG.d_model, CONFIG.top_k, CONFIG.ffn_dim, CONFIG.seq_len
    per_token = 2 * (2 * d + 1) * 4 + 2 * k * f * 4
    assert none - selective == s * per_token
    assert ends_selective == ends  # the embedding, head and loss are not recomputed


def test_selective_costs_the_bytes_it_streams_again_and_no_matmul():
    degrees, params = _layout(dp=8), (10**6, 10**6)
    plain = predict(WIDE, degrees, 0, StepOptions(), 64, H100, params)
    sel = predict(WIDE, degrees, 0, StepOptions(recompute="selective"), 64, H100, params)
    full = predict(WIDE, degrees, 0, StepOptions(recompute="full"), 64, H100, params)
    tokens = 64 // 8 * WIDE.seq_len
    streamed = tokens * WIDE.n_layers * selective_bytes(WIDE, FP32) / H100.memory_bandwidth
    assert sel.compute - plain.compute == pytest.approx(streamed, rel=1e-9)
    assert plain.compute < sel.compute < full.compute
    elements = 4 * WIDE.d_model + 3 * WIDE.top_k * WIDE.ffn_dim
    assert selective_bytes(WIDE, FP32) == elements * 4


def test_the_search_takes_selective_where_nothing_fits_without_recompute():
    """A device just too small for the layout without recompute: the first row recomputes
    selectively (it fits and is faster than full recompute), and ``--out`` writes it."""
    found, _ = candidates(WIDE, 1, 1)  # one sequence: one microbatch
    (one,) = [c for c in found if c.zero == 0]
    rows = ranked(WIDE, [one], 1, H100, fitting=False)
    by_mode = {}
    for r in rows:
        if r.options.schedule == "1f1b":
            by_mode[r.options.recompute] = r
    assert set(by_mode) == {"none", "selective", "full"}
    need = {mode: r.memory_bytes for mode, r in by_mode.items()}
    assert need["full"] < need["selective"] < need["none"]
    device = replace(H100, memory=(need["selective"] + need["none"]) / 2)
    first = ranked(WIDE, [one], 1, device, keep=1)[0]
    assert first.options.recompute == "selective", first.options
    assert first.memory_bytes <= device.memory
    assert "model.model.init_args.activation_checkpointing: selective\n" in overlay(first)
