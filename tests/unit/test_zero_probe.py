"""The probe that decides how ZeRO hands a rank's rows to an optimizer: every AdamW implementation
steps row views as it steps a whole tensor; the fused one steps strided (column) views wrongly, so
ZeRO gives it dense copies of an expert's rows (the equivalence suite's ADAMW cases train with it)."""

import pytest
import torch

from lightning_titan.parallel.dp.zero import _probe_steps, check_elementwise, steps_strided_views


@pytest.mark.parametrize(
    "variant, strided_ok", [({}, True), ({"foreach": True}, True), ({"fused": True}, False)]
)
def test_the_adamw_variants_step_views_as_whole_tensors_except_fused_on_strided(
    variant, strided_ok
):
    like = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([like], lr=0.1, **variant)
    check_elementwise(optimizer)  # rows: each implementation is element-wise
    assert steps_strided_views(optimizer) is strided_ok
    hyper = {"lr": 0.1, **variant}
    whole = _probe_steps(torch.optim.AdamW, hyper, like, split=None)
    columns = _probe_steps(torch.optim.AdamW, hyper, like, split=1)
    # what the probe guards against: fused AdamW on column views moved the wrong elements
    assert torch.allclose(whole, columns) is strided_ok
