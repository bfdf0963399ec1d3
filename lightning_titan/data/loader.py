"""A DataLoader whose position Lightning saves and restores with its loop state.

Lightning checks each train loader against its stateful protocol (``state_dict`` and
``load_state_dict``): one that has them is saved in the checkpoint's loop state and given its state
back before the resumed run draws a batch; any other makes Lightning warn that a resume mid-epoch
is "not resumable". The position is the data pipeline's (global batches consumed since the start,
the same number for every layout), so the pipeline hands the loader how to read and set it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader


class ResumableLoader(DataLoader):
    """``DataLoader(*args, **kwargs)`` plus ``position()`` (batches consumed, for the checkpoint) and
    ``resume(batches)`` (serve from there on the next pass)."""

    def __init__(
        self,
        *args: Any,
        position: Callable[[], int],
        resume: Callable[[int], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._position, self._resume = position, resume

    def state_dict(self) -> dict[str, int]:
        return {"batches": self._position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batches" in state:
            self._resume(int(state["batches"]))
