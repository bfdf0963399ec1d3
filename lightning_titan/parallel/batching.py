"""How a batch is cut: the global batch -> one slice per data rank -> microbatches.

    B (global_batch_size)  --/ data_world = dp * ep-->  b per data rank  --/ M-->  b / M per microbatch

Every rule and message about these divisions lives here; the strategy, the engine, the sampler and
the data module call these functions instead of checking on their own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor


class PackedBatch(NamedTuple):
    """A batch of packed documents (``data/records.py``, ``model/documents.py``): the plain
    ``(inputs, targets)`` [b, S] and each token's document id [b, S]. A plain batch stays the pair."""

    inputs: Tensor
    targets: Tensor
    documents: Tensor


def unpack_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(inputs, targets, documents or None)`` of a loader's batch: the pair, or a PackedBatch."""
    if isinstance(batch, PackedBatch):
        return batch.inputs, batch.targets, batch.documents
    inputs, targets = batch
    return inputs, targets, None


def local_batch_size(global_batch_size: int, data_world: int, ranks: str = "dp*ep") -> int:
    """The per-rank batch b = B / data_world (data_world = dp * ep: DP and EP ranks read different
    sequences, the stages of one pipeline the same). ``ranks`` says how data_world came about."""
    if (
        not isinstance(global_batch_size, int)
        or global_batch_size < 1
        or global_batch_size % data_world
    ):
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the number of data ranks "
            f"{ranks}={data_world}; choose a global batch size that is a positive multiple of {data_world}"
        )
    return global_batch_size // data_world


def num_microbatches(
    local_batch: int, *, num_microbatches: int | None, microbatch_size: int | None, pp: int
) -> int:
    """How many microbatches a per-rank batch of ``local_batch`` sequences is split into.

    ``microbatch_size`` fixes the sequences per microbatch; else ``num_microbatches`` (default: one per
    stage, the fewest that keep every stage busy)."""
    if microbatch_size is not None:
        if local_batch % microbatch_size:
            raise ValueError(
                f"the per-rank batch of {local_batch} sequences is not divisible by "
                f"microbatch_size={microbatch_size}; choose a divisor of {local_batch} "
                "(per-rank batch = global batch / (dp*ep))"
            )
        return local_batch // microbatch_size
    m = num_microbatches if num_microbatches is not None else pp
    if local_batch % m:
        raise ValueError(
            f"the per-rank batch of {local_batch} sequences cannot be split into num_microbatches={m}; "
            f"choose a divisor of {local_batch} (per-rank batch = global batch / (dp*ep))"
        )
    return m


def check_microbatch_args(num_microbatches: int | None, microbatch_size: int | None) -> None:
    if num_microbatches is not None and microbatch_size is not None:
        raise ValueError(
            f"num_microbatches={num_microbatches} and microbatch_size={microbatch_size} are both set; "
            "set one"
        )
    for name, value in (
        ("num_microbatches", num_microbatches),
        ("microbatch_size", microbatch_size),
    ):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name}={value!r} must be a positive int (or None)")


def split_microbatches(batch_BS: Tensor, m: int) -> tuple[Tensor, ...]:
    """``m`` equal microbatches of a per-rank batch, in order."""
    if m < 1 or batch_BS.shape[0] % m:
        raise ValueError(
            f"the per-rank batch of {batch_BS.shape[0]} sequences cannot be split into {m} "
            "microbatches; choose num_microbatches dividing the per-rank batch "
            "(global_batch_size / (dp*ep))"
        )
    return batch_BS.chunk(m)
