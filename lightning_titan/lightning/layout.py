"""Which layout a TitanStrategy trains under: the degrees it was given, or with ``layout="auto"`` the
plan's choice once made (``plan/auto.py``), and a rank's coordinates once the world size is known."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_titan.parallel.mesh import ParallelDims, check_degrees, resolve_degrees
from lightning_titan.parallel.pipeline.schedules import (
    V_SHAPED,
    check_microbatches,
    default_microbatches,
)
from lightning_titan.plan.auto import Choice, check_auto_arguments
from lightning_titan.train.options import TrainOptions, check_fold


class Layout:
    """``layout``: None (the ``degrees`` given) or ``"auto"`` (chosen at launch, so neither the
    degrees nor the step ``options`` it chooses may be given)."""

    def __init__(
        self,
        degrees: dict[str, int],
        layout: str | None,
        options: TrainOptions,
        *,
        fold_ep: bool = False,
    ) -> None:
        if layout not in (None, "auto"):
            raise ValueError(f"layout={layout!r} is unknown; use 'auto' or give the degrees")
        o = options
        check_fold(fold_ep, o.zero)
        self.fold_ep = fold_ep  # the experts over the ep x cp x tp ranks (parallel/mesh.py FOLDED)
        if layout == "auto":
            step = dict(zero=o.zero, schedule=o.schedule, virtual_stages=o.virtual_stages)
            given = {**degrees, **step, "num_microbatches": o.num_microbatches, "fold_ep": fold_ep}
            check_auto_arguments({**given, "stage_layers": o.stage_layers})
        self.degrees = check_degrees(**degrees)  # -1 is resolved once the world size is known
        self.auto = layout == "auto"
        pp = degrees["pp"]
        if o.schedule in (*V_SHAPED, "1f1b_overlap"):  # pp is known: say now what they need
            m = o.num_microbatches or default_microbatches(o.schedule, pp)
            check_microbatches(o.schedule, m, pp, o.virtual_stages)
        self.choice: Choice | None = None
        self._dims: ParallelDims | None = None

    @property
    def waiting(self) -> bool:
        """``layout="auto"`` before its choice: the degrees are not known yet."""
        return self.auto and self.choice is None

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("parallel_dims is known once the Trainer is built (set_world_ranks)")
        return self._dims

    def resolve(self, world_size: int, rank: int) -> None:
        """This rank's dims in a world of ``world_size`` (nothing yet while waiting for the choice)."""
        if not self.waiting:
            degrees = resolve_degrees(self.degrees, world_size)
            self._dims = ParallelDims(**degrees, rank=rank, fold_ep=self.fold_ep)

    def take(self, choice: Choice) -> None:
        """``layout="auto"``: the chosen degrees, as if they had been given."""
        if self.choice is None:  # said once: rank 0 may have chosen in the launcher already
            rank_zero_info(f"[titan] layout='auto' chose {choice.summary}")
        self.choice, self.degrees = choice, check_degrees(**choice.degrees)
        self.fold_ep = choice.fold_ep
