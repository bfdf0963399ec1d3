"""The expert GEMMs as expert parallelism feeds them: rows in the bf16 wire dtype, weights fp32, under
autocast, take the grouped path and equal the loop; the loop's backward writes one gradient per
weight (no zero-filled full-size gradient per expert); the grouped-GEMM probe runs at setup, with
aligned groups, and never in a forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_titan.model.moe import experts as experts_module
from lightning_titan.model.moe.experts import (
    ALIGN_ROWS,
    GroupedExperts,
    expert_gemm_paths,
    grouped_mm_supported,
)

D, F = 16, 24
COUNTS = [3, 0, 7, 2]

needs_bf16_grouped = pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, D, F),
    reason="this torch build has no CPU bf16 torch._grouped_mm",
)


def wire_rows_under_autocast(grouped: bool | None, align: int | None):
    """Experts (fp32 weights) on bf16 rows under CPU bf16 autocast, forward and backward."""
    torch.manual_seed(0)
    holder = nn.ModuleDict({"experts": GroupedExperts(D, F, (0, 4), grouped_mm=grouped)})
    experts = holder["experts"]
    experts.reset_parameters(std=0.5)  # outputs and grads of order one: atol below stays small
    experts.probe()  # what Engine does at setup
    experts.align_rows = align
    x = torch.randn(sum(COUNTS), D).to(torch.bfloat16).requires_grad_()  # the dispatch's wire dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, COUNTS, torch.tensor(COUNTS))
    out.float().square().sum().backward()
    grads = {n: p.grad for n, p in experts.named_parameters()}
    return expert_gemm_paths(holder), out, x.grad, grads


@needs_bf16_grouped
@pytest.mark.parametrize("align", [None, ALIGN_ROWS], ids=["unpadded", "padded"])
def test_wire_dtype_rows_and_fp32_weights_take_the_grouped_path_and_equal_the_loop(align):
    paths, out_g, x_g, grads_g = wire_rows_under_autocast(None, align)
    loop_paths, out_l, x_l, grads_l = wire_rows_under_autocast(False, None)
    assert paths == {"experts": "grouped bf16"}, paths
    assert loop_paths == {"experts": "loop"}, loop_paths
    assert out_g.dtype == out_l.dtype == torch.bfloat16 and x_g.dtype == torch.bfloat16
    # rtol 1.6e-2 (torch's own for bf16): both paths multiply the same bf16-rounded rows and
    # weights with fp32 accumulation, but possibly in different orders, and round gate, up, the
    # activation and the output to bf16 (a step of 2**-7 relative): a value may land one step apart
    # at two of those roundings. The weights' grads are fp32, accumulated from those bf16 products.
    # (torch 2.13's CPU grouped GEMM runs the same matmul per group: here they agree exactly.)
    for name, got, want in [("out", out_g, out_l), ("x", x_g, x_l)] + [
        (n, grads_g[n], grads_l[n]) for n in grads_l
    ]:
        assert want.dtype == (torch.float32 if name.startswith("w") else torch.bfloat16), name
        assert want.abs().max() > 0.1, (name, want.abs().max())  # atol is no free pass
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-4, msg=name)


def test_every_expert_module_reports_its_path():
    holder = nn.ModuleDict(
        {"a": GroupedExperts(D, F, (0, 4)), "b": GroupedExperts(D, F, (0, 4), grouped_mm=False)}
    )
    assert expert_gemm_paths(holder) == {"a": "none", "b": "none"}
    holder["a"].probe()
    x = torch.randn(sum(COUNTS), D)
    for name in ("a", "b"):
        holder[name](x, COUNTS)
    want_a = "grouped fp32" if holder["a"].grouped_mm_runs.get(torch.float32) else "loop"
    assert expert_gemm_paths(holder) == {"a": want_a, "b": "loop"}


# ---- the loop's backward ---------------------------------------------------------------------------


class FullSizeTensors(TorchDispatchMode):
    """Count the new tensors (not views of an input: the grad's ``detach``) shaped like one of
    ``shapes`` (a weight's full [E_local, D, F]): the allocator's view of them, on the CPU."""

    def __init__(self, shapes: set[torch.Size]) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.shape in self.shapes:
                self.count += t.untyped_storage().data_ptr() not in inputs
        return out


def full_size_tensors_in_loop_backward(n_local: int) -> int:
    experts = GroupedExperts(D, F, (0, n_local), grouped_mm=False)
    counts = [2] * n_local
    out = experts(torch.randn(sum(counts), D), counts)
    shapes = {experts.w1.shape, experts.w2.shape}  # w3 is shaped as w1
    with FullSizeTensors(shapes) as seen:
        out.square().sum().backward()
    return seen.count


def test_the_loops_backward_writes_one_full_size_grad_per_weight():
    """Not one zero-filled [E_local, D, F] per expert select (O(E_local^2 D F) per weight): the
    count is the same for 4 and 16 local experts, one per weight."""
    counts = {n: full_size_tensors_in_loop_backward(n) for n in (4, 16)}
    assert counts == {4: 3, 16: 3}, counts


# ---- the probe --------------------------------------------------------------------------------------


def test_engine_probes_at_setup_and_no_forward_probes(monkeypatch):
    from lightning_titan.model.config import ModelConfig
    from lightning_titan.model.decoder import StageModel
    from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
    from lightning_titan.train.engine import Engine

    config = ModelConfig(d_model=16, n_layers=2, n_heads=2, ffn_dim=24, n_experts=4, seq_len=8)
    model = StageModel(config)
    model.init_weights(0)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(not e.grouped_mm_runs for e in experts)
    Engine(model, ParallelDims(1, 1, 1), ProcessGroups(None, None, None, None))
    want = grouped_mm_supported(torch.device("cpu"), torch.float32, D, F)
    for e in experts:  # fixed before the first forward, for each dtype a forward could pick
        assert set(e.grouped_mm_runs) == {torch.float32, torch.bfloat16}
        assert e.grouped_mm_runs[torch.float32] == want

    def no_probe(*args, **kwargs):
        raise AssertionError("a forward ran the grouped-GEMM probe")

    monkeypatch.setattr(experts_module, "grouped_mm_supported", no_probe)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    model(ids)[0].float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)[0].float().sum().backward()
    paths = set(expert_gemm_paths(model).values())
    assert paths == ({"grouped bf16"} if want else {"loop"}), paths


def test_the_probe_uses_groups_aligned_for_the_weight_gradient(monkeypatch):
    """The weight-gradient GEMM groups over the rows: each group's offset a multiple of
    ALIGN_ROWS, as training's padded groups are on CUDA."""
    offsets = []
    real = torch._grouped_mm

    def recording(x, w, offs=None, **kwargs):
        offsets.append(offs.tolist())
        return real(x, w, offs=offs, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    grouped_mm_supported.cache_clear()
    try:
        grouped_mm_supported(torch.device("cpu"), torch.float32, 8, 12)
    finally:
        grouped_mm_supported.cache_clear()
    assert offsets and all(o and all(n % ALIGN_ROWS == 0 for n in o) for o in offsets), offsets
    assert all(len(o) >= 2 for o in offsets)  # more than one group
