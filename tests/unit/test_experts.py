"""Grouped GEMM experts (``torch._grouped_mm``) against the per-expert loop: equal outputs and grads,
for the edge cases of the row offsets (empty experts, one token, every token on one expert)."""

from __future__ import annotations

import pytest
import torch

from lightning_titan.model.moe.experts import GroupedExperts, grouped_mm_supported

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


def run(grouped: bool, counts: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    experts = GroupedExperts(D, F, (4, 8), grouped_mm=grouped)
    x = torch.randn(sum(counts), D, requires_grad=True)
    out = experts(x, counts)
    # an expanded grad (stride 0 over the rows, as a sum's), which grouped_mm's own backward would
    # reject, then a dense one that tells every row apart
    out.backward(torch.linspace(-1, 1, D).expand_as(out), retain_graph=True)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    grads = {n: p.grad for n, p in experts.named_parameters()}
    grads["x"] = x.grad
    return out, grads


@needs_grouped
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_grouped_equals_loop(counts):
    (out_g, grads_g), (out_l, grads_l) = run(True, counts), run(False, counts)
    torch.testing.assert_close(out_g, out_l, rtol=0, atol=1e-6)
    for name, grad in grads_l.items():
        assert grads_g[name] is not None, name  # every weight gets a (zero) gradient
        torch.testing.assert_close(grads_g[name], grad, rtol=0, atol=1e-6, msg=name)
    for e, n in enumerate(counts):
        if n == 0:  # an empty expert's weights: zero gradient, not none
            assert grads_g["w1"][e].abs().sum() == 0


@needs_grouped
def test_chosen_automatically():
    experts = GroupedExperts(D, F, (0, 4))
    x = torch.randn(5, D)
    assert experts.uses_grouped_mm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's casts: the loop
        assert not experts.uses_grouped_mm(x)
    experts.grouped_mm = False
    assert not experts.uses_grouped_mm(x)


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
