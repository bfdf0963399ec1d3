"""Where a ``titan`` run writes, and what its ``--ckpt_path`` names, settled while the command line is
parsed, before any rank starts (``checkpoint/runs.py`` holds the file operations).

- Each launch gets its own run folder, ``<save_dir>/<name>/version_N`` (or the logger's ``version``
  as named; CSV, TensorBoard and Weights & Biases loggers), and its ModelCheckpoints without a
  ``dirpath`` save in its ``checkpoints/``: reruns of a config never collide, and Lightning never
  finds a checkpoint folder that is not empty.
- The process that starts the ranks takes the folder (``mkdir``: two launches get two) and hands its
  number to the ranks it starts, and starts again, in ``RUN_ENV``: a restarted attempt stays in its
  run's folder. It hands them the checkpoint it resolved ``--ckpt_path`` to as well
  (``RESUME_ENV``), so that a checkpoint's checksums are read once, not once per rank. Ranks started elsewhere (torchrun, SLURM) each compute the next free number: none of
  them creates it before every rank has joined the process group. Lightning then broadcasts rank
  0's checkpoint folder and log folder to every rank in setup, so the ranks cannot write apart.
- ``--ckpt_path last`` is the newest complete checkpoint, of any run of the config (of the folders
  named by a ``dirpath`` given), whose checksums verify; a run folder is accepted as a checkpoint.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lightning_titan.checkpoint import files, runs
from lightning_titan.lightning.supervisor import is_worker, say
from lightning_titan.runtime.launch import restart_count
from lightning_titan.runtime.orphans import LAUNCHER_PID

# "<pid>:<N>": the version folder the launching process <pid> took, for the ranks it starts (they
# know its pid from LAUNCHER_PID; a rank started by anything else ignores a value it inherited)
RUN_ENV = "TITAN_RUN_VERSION"
# "<pid>:<path>": the checkpoint that process resolved ``last`` (or a folder) to, checksums read
# once, for the ranks of its first attempt ("<pid>:": none, a new run); a restart resolves again
RESUME_ENV = "TITAN_RESUME_FROM"


def _from_launcher(name: str) -> str | None:
    """The value the process that started this rank left in ``name`` for it (None: not ours)."""
    launcher, sep, value = os.environ.get(name, "").partition(":")
    return value if sep and launcher == os.environ.get(LAUNCHER_PID) else None


def _class(namespace: Any) -> type | None:
    if not isinstance(namespace, Namespace) or "class_path" not in namespace:
        return None
    module, _, name = namespace.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    return cls if isinstance(cls, type) else None


def _speaks() -> bool:
    """Whether this process says what it skipped: the launching process, or rank 0."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def _starts_ranks() -> bool:
    """The process a user ran (not a rank started by a launcher, torchrun or SLURM), on node 0."""
    started_elsewhere = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    return not is_worker() and not started_elsewhere and os.environ.get("NODE_RANK", "0") == "0"


def decide_version(root: Path, claim: bool = True) -> int:
    """The run's version number in ``root`` (a config's folder of runs); see the module's doc.
    ``claim=False``: the next free number, nothing created (a CLI built to look at, not to run)."""
    given = _from_launcher(RUN_ENV)
    if given:  # a rank that process started
        return int(given)
    if restart_count() > 0:  # torchrun's agent restarted the job: the first attempt's, the newest
        return max(runs.versions(root), default=0)
    if claim and _starts_ranks():
        version = runs.claim_version(root)
        os.environ[RUN_ENV] = f"{os.getpid()}:{version}"  # for the ranks it starts (and restarts)
        return version
    return runs.next_version(root)


def place_run(
    config: Namespace, usage_error: Callable[[str], Exception], claim: bool = True
) -> None:
    """Give the parsed ``config`` (one subcommand's) its run folder and a concrete ``ckpt_path``;
    ``claim``: create the folder now (``decide_version``)."""
    trainer = config.trainer
    checkpoints = [
        c
        for c in trainer.get("callbacks") or []
        if (cls := _class(c)) is not None and issubclass(cls, ModelCheckpoint)
    ]
    given = [Path(c.init_args.dirpath) for c in checkpoints if c.init_args.get("dirpath")]
    root, search = None, list(given)
    placed = _place_logger(trainer.get("logger"), usage_error, claim)
    if placed is not None:
        root, folder = placed
        for callback in checkpoints:
            if not callback.init_args.get("dirpath"):
                callback.init_args.dirpath = str(folder / runs.CHECKPOINTS)
                search = [*given, *runs.run_checkpoint_dirs(root)]
    if "ckpt_path" not in config:
        return  # a TitanCLI built without subcommands
    try:
        config.ckpt_path = resolve_ckpt_path(config.ckpt_path, search, root)
    except ValueError as err:
        raise usage_error(str(err)) from None


def _place_logger(
    logger: Any, usage_error: Callable[[str], Exception], claim: bool
) -> tuple[Path, Path] | None:
    """(the config's folder of runs, this run's folder) for the logger's arguments, its version
    decided; None: a logger that chooses its own folder, or none. Weights & Biases has no version
    folder of its own: its ``save_dir`` becomes the run folder (``wandb/`` inside it), named as a
    CSV logger's would be by its ``name`` (else its ``project``)."""
    cls = _class(logger)
    if cls is None:
        return None
    args = logger.init_args
    if issubclass(cls, WandbLogger):
        root = Path(args.get("save_dir") or ".") / (
            args.get("name") or args.get("project") or "lightning_logs"
        )
        folder = root / f"version_{decide_version(root, claim)}"
        args.save_dir = str(folder)
        return root, folder
    if not issubclass(cls, (CSVLogger, TensorBoardLogger)):
        return None
    root = Path(args.save_dir) / (args.get("name") or "")
    if args.get("version") is None:
        args.version = decide_version(root, claim)
    elif not is_worker() and restart_count() == 0:
        _refuse_taken(root, args.version, usage_error)
    version = args.version
    return root, root / (f"version_{version}" if isinstance(version, int) else version)


def _refuse_taken(root: Path, version: Any, usage_error: Callable[[str], Exception]) -> None:
    """A run named by the logger's ``version`` must be new: its folder's checkpoints and metrics
    would be mixed with (and Lightning's CSV logger would delete) the earlier run's."""
    folder = root / (f"version_{version}" if isinstance(version, int) else str(version))
    held = folder / runs.CHECKPOINTS
    if (held.is_dir() and any(held.iterdir())) or (folder / "metrics.csv").is_file():
        raise usage_error(
            f"run folder {folder} already holds a run: name another (--trainer.logger.init_args."
            f"version=NAME), or leave the version out for the next version_N; to continue that "
            f"run, resume from it: --ckpt_path {folder}"
        )


def resolve_ckpt_path(ckpt_path: Any, search: list[Path], root: Path | None) -> str | None:
    """``ckpt_path`` as a checkpoint: ``"last"`` is the newest valid complete one in ``search``
    (None, a new run, when they hold nothing at all); a folder its newest valid complete one."""
    if ckpt_path is None:
        return None
    handed = _from_launcher(RESUME_ENV) if restart_count() == 0 else None
    if handed is not None and (ckpt_path == "last" or Path(str(ckpt_path)).is_dir()):
        return handed or None
    resolved = _resolve(ckpt_path, search, root)
    if _starts_ranks():
        os.environ[RESUME_ENV] = f"{os.getpid()}:{resolved or ''}"
    return resolved


def _resolve(ckpt_path: Any, search: list[Path], root: Path | None) -> str | None:
    speak = say if _speaks() else (lambda line: None)
    if ckpt_path == "last":
        found = runs.newest_valid(search, speak)
        if found is not None:
            return str(found)
        held = [p for d in search if d.is_dir() for p in sorted(d.iterdir())]
        if held and restart_count() == 0:
            _refuse_nothing_to_resume(held, search)
        where = root if root is not None else ", ".join(map(str, search)) or "no checkpoint folder"
        speak(f"[titan] --ckpt_path last: no checkpoint in {where} yet: starting from step 0")
        return None
    if isinstance(ckpt_path, str) and Path(ckpt_path).is_dir():
        return str(runs.resolve(ckpt_path, speak))
    return str(ckpt_path)


def _refuse_nothing_to_resume(held: list[Path], search: list[Path]) -> None:
    """``last`` asked to resume, and the checkpoint folders hold what earlier runs left, but no
    complete checkpoint that verifies: starting over would be a silent loss, so say what is there."""
    shown = ", ".join(f"{p.parent.name}/{files.describe(p)}" for p in held[:6])
    more = f" and {len(held) - 6} more" if len(held) > 6 else ""
    folders = ", ".join(map(str, search))
    raise ValueError(
        f'ckpt_path="last" found no complete checkpoint in {folders}, which holds {shown}{more}: '
        "nothing to resume from. To start a new run leave ckpt_path out (the next save removes "
        "what an interrupted one left); to resume, pass a checkpoint"
    )


def resume_line(trainer: Any) -> str | None:
    """The line rank 0 says as training starts: from which step of which checkpoint it resumes, or,
    on a restart, that it starts over from step 0 and why (None: a first launch without one)."""
    ckpt_path = getattr(trainer, "ckpt_path", None)
    if ckpt_path:
        return f"[titan] resuming from step {trainer.global_step} of {ckpt_path}"
    if restart_count() > 0:
        dirs = [str(c.dirpath) for c in trainer.checkpoint_callbacks if c.dirpath]
        return (
            f"[titan] restart {restart_count()}: no complete checkpoint in "
            f"{', '.join(dirs) or 'no checkpoint folder'}: starting over from step 0"
        )
    return None
