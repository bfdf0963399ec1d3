"""LoRA adapters on a frozen base train the same under every layout as in one process.

One 8-rank spawn runs each layout with ``engine_harness.LORA`` (adapters on the attention
projections, the routed experts, the router, and where the config has them the shared expert and the
dense MLP): per-step loss, aux loss and grad norm at rtol 1e-5 and every weight at atol 1e-5 against
the single process, which tests/unit/test_lora.py holds against PEFT on transformers. Every frozen
parameter stays bit for bit what it was, and only the adapters hold grads and optimizer state.
An adapter checkpoint (the adapters and their AdamW state, no base) written under one layout
resumes under another, continuing the single process's run exactly.
"""

import pytest
import torch
from engine_harness import (
    ACKPT_CONFIG,
    CONFIG,
    FAMILY_CONFIGS,
    LORA,
    SELECTIVE_CONFIG,
    assert_matches_reference,
    reference,
    run_layouts,
)

from lightning_titan.checkpoint import consolidate
from lightning_titan.model.lora import is_adapter
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.plan.memory import rank_state, trained_params
from lightning_titan.runtime.launch import run_on_ranks

DEEPSEEK = FAMILY_CONFIGS["deepseek"]  # latent attention, a shared expert, a dense first layer
CASES = [
    ((2, 2, 2), "1f1b:lora", 2),  # dp2 x pp2 x ep2
    ((1, 2, 2, 2), "1f1b:lora", 2),  # tp2 x pp2 x ep2: the factors cut like their weights
    ((1, 2, 2, 1, 2), "1f1b:lora", 2),  # cp2 x pp2 x ep2
    ((4, 1, 2), "1f1b:lora:zero1", 1),  # dp4 x ep2, the adapters' state sharded
    ((1, 2, 2, 2), "dualpipev:lora", 4),  # the overlapped pairs
    ((2, 2, 2), "zb_h1:lora", 2),  # the W pass: the adapters' weight grads
    ((2, 2, 2), "1f1b:lora", 2, ACKPT_CONFIG),  # recomputed blocks
    ((2, 2, 2), "zb_h1:lora", 2, SELECTIVE_CONFIG),  # recomputed norms and activations, then W
    ((2, 2, 2), "1f1b:lora:compile=aot_eager", 2),  # compiled attention, router and head
    ((1, 2, 2, 2), "1f1b:lora", 2, DEEPSEEK),  # MLA's q_a/q_b/kv_a/kv_b/o, shared, dense MLP
    ((1, 2, 2, 2), "1f1b:lora:fold", 2),  # fold_ep: the experts' adapters over ep x tp
]
# an adapter checkpoint written under one layout after step 2, resumed under another (ZeRO-1 there)
SAVED = ((1, 2, 2, 2), "1f1b:lora:save=2", 2)
RESUMED = ((4, 1, 2), "1f1b:lora:zero1:resume=2", 1)


@pytest.mark.slow
@pytest.mark.timeout(620)
def test_lora_equals_one_process_under_every_layout(tmp_path):
    refs = {id(CONFIG): reference(lora=LORA), id(DEEPSEEK): reference(DEEPSEEK, lora=LORA)}
    refs[id(ACKPT_CONFIG)] = refs[id(SELECTIVE_CONFIG)] = refs[id(CONFIG)]
    plain = reference()
    ref = refs[id(CONFIG)]
    # the adapters moved the model off the full fine-tune's path, and away from their init
    assert ref["loss"][1:] != plain["loss"][1:]
    assert ref["weights"]["layers.0.moe.experts.w1_lora_B"].abs().max() > 0
    assert ref["weights"]["layers.0.attn.wq.lora_B.weight"].abs().max() > 0
    for r in refs.values():
        assert r["frozen_moved"] == [] and r["trained"] > 0
    cases = [*CASES, SAVED, RESUMED]
    per_rank = run_on_ranks(
        run_layouts, 8, cases, str(tmp_path), timeout_s=600, start_method="fork"
    )
    saved, resumed = ([per_rank[rank][i] for rank in range(8)] for i in (-2, -1))
    for r in saved:
        torch.testing.assert_close(r["loss"], ref["loss"][:2], rtol=1e-5, atol=0)
    later = {k: ref[k][2:] for k in ("loss", "aux", "norm", "dropped")}
    assert_matches_reference({**ref, **later}, resumed, f"{RESUMED} from {SAVED}")
    # the checkpoint holds the adapters, not the frozen base
    state = consolidate(tmp_path / "harness.ckpt")
    assert state and all(is_adapter(k) for k in state), sorted(state)[:4]
    assert set(state) == {n for n in ref["weights"] if is_adapter(n)}
    for i, (layout, schedule, m, *config) in enumerate(CASES):
        results = [per_rank[rank][i] for rank in range(8)]
        case_ref = refs[id(config[0] if config else CONFIG)]
        assert_matches_reference(case_ref, results, f"{layout} {schedule} M={m} lora")
        zero = next((int(o[-1]) for o in schedule.split(":") if o.startswith("zero")), 0)
        for rank, r in enumerate(results):
            where = (layout, schedule, r["coords"])
            # titan plan's state model knows LoRA: every rank's bytes, exactly as measured
            dims = ParallelDims(*layout[:3], rank, *layout[3:], fold_ep=":fold" in schedule)
            model = config[0] if config else CONFIG
            assert rank_state(model, dims, zero, r["split"], LORA) == r["state"], where
            if r["split"].virtual_stages == 1 and r["split"].stage_layers is None:
                trained = sum(w.numel() for n, w in r["weights"].items() if is_adapter(n))
                assert sum(trained_params(model, dims, LORA)) == trained, where
            assert r["frozen_moved"] == [], where  # the base bit for bit
            adapters = [w for n, w in r["weights"].items() if is_adapter(n)]
            adapter_numel = sum(w.numel() for w in adapters)
            adapter_bytes = sum(w.numel() * w.element_size() for w in adapters)
            # grads and AdamW's two moments for the adapters only (zero1: a share of them)
            assert 0 < r["grad_bytes"] <= adapter_bytes, (where, r["grad_bytes"], adapter_bytes)
            if "zero1" in schedule:
                assert 0 < r["state_numel"] < 2 * adapter_numel, where
            else:
                assert r["state_numel"] == 2 * adapter_numel, where
