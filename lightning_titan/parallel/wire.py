"""The dtype a tensor travels in between ranks: under autocast, the dtype the receiver computes in.

Under ``bf16-mixed`` the parameters and the residual stream stay fp32, but the receiving side's
matmuls run in bf16: sending the fp32 values moves twice the bytes for the same result (the receiver's
autocast would round them to bf16 anyway), or, for a residual stream, for one rounding at the stage
boundary that autocast already does to every matmul input.
"""

from __future__ import annotations

import torch


def wire_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """``dtype``, or the autocast dtype of ``device``'s type when autocast is on there and narrower."""
    device_type = torch.device(device).type
    if not (dtype.is_floating_point and torch.is_autocast_enabled(device_type)):
        return dtype
    narrow = torch.get_autocast_dtype(device_type)
    return narrow if narrow.itemsize < dtype.itemsize else dtype
