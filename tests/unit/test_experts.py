"""Grouped GEMM experts (``torch._grouped_mm``) against the per-expert loop: equal outputs and grads,
for the edge cases of the row offsets (empty experts, one token, every token on one expert), with and
without the rows padded per expert as CUDA's kernel wants them; which path runs where (issue 43)."""

from __future__ import annotations

import pytest
import torch

from lightning_titan.model.moe.experts import (
    ALIGN_ROWS,
    GroupedExperts,
    grouped_mm_dtype,
    grouped_mm_supported,
)

D, F = 16, 24
COUNTS = {
    "all_empty": [0, 0, 0, 0],
    "one_token": [0, 1, 0, 0],
    "all_on_one": [0, 0, 0, 13],
    "all_on_first": [9, 0, 0, 0],
    "mixed_with_empty": [3, 0, 7, 2],
}

needs_grouped = pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.float32, D, F),
    reason="this torch build has no CPU fp32 torch._grouped_mm",
)


def run(
    grouped: bool, counts: list[int], align: int | None = None, oss: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``oss``: gpt-oss's experts (biases, clamped SwiGLU at a limit the values cross)."""
    torch.manual_seed(0)
    extra = dict(bias=True, swiglu_limit=0.05) if oss else {}
    experts = GroupedExperts(D, F, (4, 8), grouped_mm=grouped, **extra)  # type: ignore[arg-type]
    with torch.no_grad():
        for name in ("b1", "b3", "b2") if oss else ():
            getattr(experts, name).normal_(std=0.05)
    experts.align_rows = align
    x = torch.randn(sum(counts), D, requires_grad=True)
    out = experts(x, counts, torch.tensor(counts))
    # an expanded grad (stride 0 over the rows, as a sum's), which grouped_mm's own backward would
    # reject, then a dense one that tells every row apart
    out.backward(torch.linspace(-1, 1, D).expand_as(out), retain_graph=True)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    grads = {n: p.grad for n, p in experts.named_parameters()}
    grads["x"] = x.grad
    return out, grads


@needs_grouped
@pytest.mark.parametrize("oss", [False, True], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("align", [None, ALIGN_ROWS], ids=["unpadded", "padded"])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_grouped_equals_loop(counts, align, oss):
    (out_g, grads_g), (out_l, grads_l) = run(True, counts, align, oss), run(False, counts, oss=oss)
    torch.testing.assert_close(out_g, out_l, rtol=0, atol=1e-6)
    for name, grad in grads_l.items():
        assert grads_g[name] is not None, name  # every weight gets a (zero) gradient
        # a bias's grad sums its expert's rows (~14 here): the order's rounding is relative
        rtol = 1e-6 if name.startswith("b") else 0
        torch.testing.assert_close(grads_g[name], grad, rtol=rtol, atol=1e-6, msg=name)
    for e, n in enumerate(counts):
        if n == 0:  # an empty expert's weights: zero gradient, not none
            assert grads_g["w1"][e].abs().sum() == 0


def test_the_padded_rows_stay_out_of_the_result():
    """The padding's outputs are dropped and it gets no gradient; no host-to-device copy when the
    counts come on the device (the offsets are their cumsum there)."""
    from host_reads import HostToDevice

    counts = [3, 0, 17, 1]
    experts = GroupedExperts(D, F, (0, 4), grouped_mm=True)
    experts.align_rows = ALIGN_ROWS
    x = torch.randn(sum(counts), D, requires_grad=True)
    device_counts = torch.tensor(counts)
    with HostToDevice() as copies:
        out = experts(x, counts, device_counts)
        out.sum().backward()
    assert out.shape == x.shape and x.grad is not None and x.grad.shape == x.shape
    assert copies.calls == [], copies.calls


@needs_grouped
def test_chosen_automatically_also_under_autocast():
    experts = GroupedExperts(D, F, (0, 4))
    x = torch.randn(5, D)
    assert experts.grouped_dtype(x) is None  # not probed: the loop
    experts.probe()
    assert experts.grouped_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # explicit casts: the grouped GEMMs, in bf16
        if grouped_mm_supported(x.device, torch.bfloat16, D, F):
            assert experts.grouped_dtype(x) == torch.bfloat16
    experts.grouped_mm = False
    assert not experts.uses_grouped_mm(x)


def test_which_path_runs_where():
    """The decision, given the rows' and weights' dtypes, autocast and the device: CUDA's grouped
    kernel on sm90/sm100 in bf16 with aligned rows, so under bf16-mixed there, also with the rows in
    the bf16 wire dtype of expert parallelism and the weights fp32; the loop where that kernel would
    read the offsets to the host."""
    bf16, fp32, fp16 = torch.bfloat16, torch.float32, torch.float16
    big = (4096, 14336)
    for cap in ((9, 0), (10, 0)):
        assert grouped_mm_dtype("cuda", cap, fp32, fp32, bf16, *big) == bf16  # bf16-mixed
        assert grouped_mm_dtype("cuda", cap, bf16, fp32, bf16, *big) == bf16  # + EP's bf16 rows
        assert grouped_mm_dtype("cuda", cap, bf16, bf16, None, *big) == bf16  # bf16-true
        assert grouped_mm_dtype("cuda", cap, fp32, fp32, None, *big) is None  # 32-true
        assert grouped_mm_dtype("cuda", cap, bf16, fp32, None, *big) is None  # no autocast
        assert grouped_mm_dtype("cuda", cap, fp32, fp32, bf16, 4096, 100) is None  # 200-byte rows
        assert grouped_mm_dtype("cuda", cap, fp16, fp32, fp16, 64, 64) is None
    for cap in ((8, 0), (8, 9), (7, 5), None):
        assert grouped_mm_dtype("cuda", cap, fp32, fp32, bf16, *big) is None
        assert grouped_mm_dtype("cuda", cap, bf16, fp32, bf16, *big) is None
    assert grouped_mm_dtype("cpu", None, fp32, fp32, None, D, F) == fp32
    assert grouped_mm_dtype("cpu", None, fp32, fp32, bf16, D, F) == bf16
    assert grouped_mm_dtype("cpu", None, bf16, fp32, bf16, D, F) == bf16  # EP under bf16-mixed
    assert grouped_mm_dtype("cpu", None, bf16, fp32, None, D, F) is None
    assert grouped_mm_dtype("mps", None, fp32, fp32, bf16, D, F) is None


@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, D, F),
    reason="this torch build has no CPU bf16 torch._grouped_mm",
)
def test_grouped_under_autocast_equals_the_loop_in_bf16():
    counts = [3, 0, 7, 2]
    results = []
    for grouped in (True, False):
        torch.manual_seed(0)
        experts = GroupedExperts(D, F, (0, 4), grouped_mm=grouped)
        experts.align_rows = ALIGN_ROWS
        x = torch.randn(sum(counts), D, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x, counts, torch.tensor(counts))
        out.float().square().sum().backward()
        results.append((out, x.grad, experts.w1.grad))
    (out_g, x_g, w_g), (out_l, x_l, w_l) = results
    assert out_g.dtype == out_l.dtype == torch.bfloat16 and w_g.dtype == torch.float32
    for got, want in ((out_g, out_l), (x_g, x_l), (w_g, w_l)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_counts_must_cover_the_rows():
    experts = GroupedExperts(D, F, (0, 4))
    with pytest.raises(ValueError, match=r"sum to 4, not to the 5 rows"):
        experts(torch.randn(5, D), [1, 1, 1, 1])


def test_the_probe_gives_the_same_answer_under_no_grad_and_inference_mode():
    """The answer is cached for the process, and the first forward often runs under no_grad (a
    logits check against transformers did, and then every later run in the process, the equivalence
    tests' included, used the loop instead of the grouped GEMMs)."""
    cpu, shape = torch.device("cpu"), (8, 12)
    grouped_mm_supported.cache_clear()
    plain = grouped_mm_supported(cpu, torch.float32, *shape)
    for context in (torch.no_grad, torch.inference_mode):
        grouped_mm_supported.cache_clear()
        with context():
            assert grouped_mm_supported(cpu, torch.float32, *shape) == plain, context
    grouped_mm_supported.cache_clear()
