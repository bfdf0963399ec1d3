"""What ``titan`` keeps off the terminal: warnings a user can do nothing about, and Lightning's lines
that sell a product or list accelerators the run does not use. Each by its exact text, at its source
(the warnings filter, Lightning's own logger), so that anything new still shows."""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.utilities.warnings import PossibleUserWarning

# Lightning's rank_zero_info lines, by how they start: its "💡 Tip:" adverts (litlogger, litmodels)
# and the accelerator inventory ("GPU available: False, used: False", "TPU available: ...", HPU/IPU
# in older releases). Every accelerator line goes, the GPU one too: the config names the accelerator,
# the end summary says where the memory peaked (CUDA or host), and Lightning still warns when a GPU
# sits unused.
# Also the process-group lines: "Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/W" from every
# rank and the "distributed_backend=... All distributed processes registered" banner from rank 0 (the
# layout line and the end summary say the world, and a rank that fails is named by its own line).
LIGHTNING_CHATTER = (
    "💡 Tip:",
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "IPU available:",
    "Initializing distributed:",
    "-" * 100 + "\ndistributed_backend=",
)
# the loggers these lines go to (rank_zero_info: Lightning points the shared helper at the last one
# imported; fabric's distributed utilities log the per-rank line themselves)
RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.distributed",
)


class DropChatter(logging.Filter):
    """Drops a record whose message starts with one of ``LIGHTNING_CHATTER``; passes the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_CHATTER)


def quiet_lightning_chatter() -> None:
    """Filter ``LIGHTNING_CHATTER`` out of Lightning's rank-zero loggers (once per process)."""
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropChatter) for f in logger.filters):
            logger.addFilter(DropChatter())


def quiet_known_noise() -> None:
    """Silence the warnings a titan user can do nothing about, each by its exact text and category,
    and Lightning's chatter (``quiet_lightning_chatter``)."""
    quiet_lightning_chatter()
    # Lightning 2.6's CombinedLoader builds torch's LeafSpec(), which torch 2.13 deprecates (once per rank)
    warnings.filterwarnings(
        "ignore",
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # under manual optimization ModelCheckpoint asks for a copy of the weights from before
    # optimizer.step(); ours are rightly the weights after step N, which a resume at step N continues
    warnings.filterwarnings(
        "ignore",
        r"Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
        r"pre-optimization state was saved",
        UserWarning,
    )
    # every run has a run folder of its own (run_folders.py): the one whose checkpoint folder is not
    # empty is a restarted attempt's, resuming what it holds
    warnings.filterwarnings(
        "ignore", r"Checkpoint directory .* exists and is not empty\.", UserWarning
    )
    # a resume from another run's checkpoint starts its own top-k in its own run folder, as meant
    warnings.filterwarnings(
        "ignore", r"The dirpath has changed from .*, therefore `best_model_score`", UserWarning
    )
    # TitanLM's epoch-level values are global by construction (every rank logs the same all-reduced
    # mean): a sync_dist mean would only cost a collective. Only these keys: others still warn.
    warnings.filterwarnings(
        "ignore",
        r"It is recommended to use `self.log\('(val|test)_(loss|perplexity)', \.\.\., "
        r"sync_dist=True\)`",
        PossibleUserWarning,
        module=r"lightning\.pytorch\.trainer\.connectors\.logger_connector",
    )
