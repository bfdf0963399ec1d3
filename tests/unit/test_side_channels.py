"""No side channels, process-free: a fact is handed over by its owner (an argument, a return value, a
table the owner keeps), not hung on a tensor or a module, nor left in another module's global.

- the TP cuts are declared by the modules that make them (``tp_cuts``), and a stage model trained a
  step carries no ``_titan_...`` attribute anywhere (under ZeRO and TP with real groups:
  ``tests/distributed/test_no_side_channels.py``);
- the hot path's probes reach only what ``probes.install`` put there, until its handle removes it;
- an overlapped pair's hand-overs are counted where its caller reads them (``overlap.handovers()``).
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_harness import FAMILY_CONFIGS
from side_channels import PREFIX, titan_attributes

import lightning_titan
from lightning_titan.model.decoder import StageModel
from lightning_titan.parallel import overlap
from lightning_titan.parallel.tensor_parallel import tp_cut_modules, tp_shards
from lightning_titan.runtime import probes, tracing

# the modules that cut: attention's q/k/v (with biases) and o, the whole-projection QK-norm and the
# sinks (each cuts its own weight), the vocabulary; latent attention's per-head projections
QK_FULL = replace(FAMILY_CONFIGS["qk_full"], attn_sinks=True, n_layers=2)
LATENT = replace(FAMILY_CONFIGS["deepseek"], n_layers=2)


def _one_step(model: StageModel) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_len + 1))
    logits, aux = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux.sum()
    loss.backward()
    optimizer.step()
    return optimizer


def test_the_cuts_are_declared_by_the_modules_that_make_them():
    model = StageModel(QK_FULL)
    names = {id(p): n for n, p in model.named_parameters()}
    cut = {names[i]: s.dim for i, s in tp_shards(model).items()}
    layer = {
        **{f"attn.{w}.{t}": 0 for w in ("wq", "wk", "wv") for t in ("weight", "bias")},
        "attn.wo.weight": 1,
        **{f"attn.{m}.weight": 0 for m in ("q_norm", "k_norm", "sinks")},
    }
    want = {f"layers.{i}.{k}": d for i in range(2) for k, d in layer.items()}
    assert cut == {**want, "embed.weight": 0, "lm_head.weight": 0}
    modules = dict(model.named_modules())
    assert tp_cut_modules(model)[modules["layers.1.attn.sinks"]].full_size == QK_FULL.n_heads
    latent = StageModel(LATENT)
    names = {id(p): n for n, p in latent.named_parameters()}
    cut = {names[i]: s.dim for i, s in tp_shards(latent).items()}
    assert cut["layers.0.attn.q_b_proj.weight"] == cut["layers.0.attn.kv_b_proj.weight"] == 0
    assert cut["layers.0.attn.wo.weight"] == 1 and "layers.0.attn.kv_a_proj.weight" not in cut


@pytest.mark.parametrize("config", [QK_FULL, LATENT], ids=["qk_full", "latent"])
def test_a_stage_trained_a_step_carries_no_titan_attribute(config):
    model = StageModel(config)
    model.init_weights(1)
    optimizer = _one_step(model)
    assert any(p.grad is not None for p in model.parameters()) and optimizer.state
    assert titan_attributes(model, [optimizer]) == []


def test_no_module_of_the_package_names_a_titan_attribute():
    """What the runtime check cannot reach (a branch no test runs) the source shows."""
    root = Path(lightning_titan.__file__).parent
    named = re.compile(rf"(?<![A-Za-z0-9]){PREFIX}")  # not the package's own name, lightning_titan_
    hits = [
        f"{path.relative_to(root)}:{i}"
        for path in sorted(root.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if named.search(line)
    ]
    assert hits == []


def test_the_probes_reach_what_is_installed_until_its_handle_removes_it():
    assert probes.span("p2p", "a") is probes.span("p2p", "b")  # nothing installed: a shared no-op
    seen = []

    def tracer(kind, name, args):
        seen.append((kind, name, args))
        return nullcontext()

    installed = probes.install(tracer=tracer, faulter=lambda phase, t: t * 2)
    try:
        with probes.span("p2p", "send", mb=1):
            pass
        assert probes.fault("forward", torch.ones(1)).item() == 2.0
        with pytest.raises(RuntimeError, match="a tracer is installed already"):
            probes.install(tracer=tracer)
        with pytest.raises(RuntimeError, match="tracing.stop"):
            tracing.start(0)  # the tracing module asks probes too
    finally:
        installed.remove()
    installed.remove()  # twice: nothing more
    with probes.span("p2p", "after"):
        pass
    assert seen == [("p2p", "send", {"mb": 1})]
    assert probes.fault("forward", torch.ones(1)).item() == 1.0
    assert not tracing.is_recording()
    tracing.start(3, step=2)
    with probes.span("all_reduce", "grads"):
        pass
    spans = tracing.stop()
    assert [(s.kind, s.name, s.rank, s.step) for s in spans] == [("all_reduce", "grads", 3, 2)]
    assert probes.span("p2p", "a") is probes.span("p2p", "b")  # stop() took its tracer out


def test_a_pair_counts_its_hand_overs_where_the_caller_reads_them():
    before, order = overlap.handovers(), []

    def half(name: str, result: str):
        def run() -> str:
            order.append(f"{name}1")
            overlap.hand_over()  # as an exchange just started
            order.append(f"{name}2")
            return result

        return run

    assert overlap.run_pair(half("f", "y"), half("b", "dx")) == ("y", "dx")
    assert order == ["b1", "f1", "b2", "f2"]  # the backward first; each hands the rank over once
    assert overlap.handovers() - before == 2
    overlap.hand_over()  # outside a pair: nothing to hand over
    with pytest.raises(RuntimeError, match="do not nest"):
        overlap.run_pair(lambda: overlap.run_pair(int, int), int)
    assert overlap.run_pair(int, int) == (0, 0)  # the failed pair left nothing running
    assert overlap.handovers() - before == 2
