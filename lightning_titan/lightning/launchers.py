"""The launchers of a TitanStrategy job (``supervisor.py`` says how a job fails; these start it).

- ``TitanLauncher``: Lightning's script launcher (``popen``), plus the layout/model/data checks run
  before any rank starts, and a watcher that stops the job within a second of a rank's death, naming
  it (Lightning's own observer polls every 5 s and SIGKILLs every process, this one included). The
  launcher itself then leaves within ``LAUNCHER_WAIT_S``, its user's logs flushed, unless its own
  collectives fail first (gloo's do at once; NCCL does not notice a dead peer on the same node).
- ``TitanForkLauncher``: Lightning's fork/spawn launcher, but an interrupt (or SIGTERM) in the parent
  stops every rank: SIGTERM first (they save ``last`` after the step, ``preemption``), then SIGKILL.
- ``ExternalLauncher``: for processes started outside (torchrun, SLURM) it starts nothing, but each
  rank still runs the checks of a launch (``check_call``).

Every launch first refuses ``ckpt_path="last"`` where Lightning would silently start a new run
(``checkpoint_hooks.refuse_missing_last``): only a launcher sees the ``ckpt_path`` fit was given.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from subprocess import Popen
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed,
)
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
    subprocess_script,
)
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.call import _interrupt
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.multiprocessing import ProcessRaisedException
from typing_extensions import override

from lightning_titan.data.checks import TooLittleData
from lightning_titan.lightning.checkpoint_hooks import refuse_missing_last
from lightning_titan.lightning.restarts import (
    RestartingLauncher,
    keep_logger_versions,
    resumed_call,
)
from lightning_titan.lightning.supervisor import (
    LAUNCHER_WAIT_S,
    _children,
    _failing,
    describe_exit,
    leave,
    preempting,
    say,
)
from lightning_titan.runtime.launch import free_port, hosted_rendezvous
from lightning_titan.runtime.orphans import (
    LAUNCHER_PID,
    die_with_launcher,
    watch_launcher,
)


def check_call(
    function: Callable, args: Sequence[Any], kwargs: dict[str, Any], trainer: Any
) -> None:
    """The checks of the Trainer call being launched (``function``: ``trainer._fit_impl``, ...)."""
    called = inspect.signature(function).bind_partial(*args, **kwargs).arguments
    refuse_missing_last(trainer, called.get("ckpt_path"))


def launch_checks(preflight: Callable[[Any, Any, Any], None]) -> Callable[..., None]:
    """The checks of a launch that starts ranks: the layout, model and data (``preflight``, in one
    process with no process group: a bad layout costs one interpreter start), then the call's."""

    def checks(
        function: Callable, args: Sequence[Any], kwargs: dict[str, Any], trainer: Any
    ) -> None:
        preflight(*_module_and_data(args, kwargs), trainer)
        check_call(function, args, kwargs, trainer)

    return checks


class ExternalLauncher(_Launcher):
    """Processes started outside (torchrun, SLURM, our restarting launcher): nothing to start or kill,
    the checks on each rank; a restarted rank resumes (``restarts.resumed_call``)."""

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = resumed_call(function, args, kwargs, trainer)
        keep_logger_versions(trainer)
        check_call(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        pass  # the processes are not this launcher's


class TitanLauncher(_SubprocessScriptLauncher):
    """Re-runs the script once per extra rank, like Lightning's; checks first, watches after."""

    def __init__(
        self,
        preflight: Callable[[Any, Any, Any], None],
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._preflight = preflight

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # one process, no process group: a bad layout, model or batch costs one interpreter start
        self._preflight(*_module_and_data(args, kwargs), trainer)
        check_call(function, args, kwargs, trainer)
        self.cluster_environment.validate_settings(
            num_devices=self.num_processes, num_nodes=self.num_nodes
        )
        if self.procs or self.cluster_environment.creates_processes_externally:
            # this Trainer's next fit/validate/test: its ranks run the same script and are still in
            # the world group, which keeps the store of the first launch (launch.hosted_rendezvous)
            return function(*args, **kwargs)
        with lightning_rendezvous(self.cluster_environment):
            os.environ[LAUNCHER_PID] = str(os.getpid())
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            _children[:] = [(first + i, p) for i, p in enumerate(self.procs)]
            options = getattr(getattr(trainer, "strategy", None), "options", None)
            grace_s = float(getattr(options, "grace_s", 30.0))
            loggers = list(getattr(trainer, "loggers", None) or [])
            _RankWatcher(self.procs, first, grace_s=grace_s, loggers=loggers).start()
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        # the kernel signals the ranks when this process dies, also while they still import
        with die_with_launcher(subprocess_script):
            super()._call_children_scripts()


def _module_and_data(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The LightningModule and LightningDataModule among ``fit``/``validate``/... arguments."""
    values = [*args, *kwargs.values()]
    module = next((v for v in values if isinstance(v, pl.LightningModule)), None)
    data = next((v for v in values if isinstance(v, pl.LightningDataModule)), None)
    return module, data


class _RankWatcher(threading.Thread):
    """In the launcher: when a rank it started dies, say which, kill the others, and make sure this
    process (rank 0) goes down too.

    Under gloo this process then fails in its next collective (a closed connection is reported at
    once, also to work in flight) and leaves through ``leave_after_failure``. NCCL does not notice a
    dead peer on the same node: if no failure has started here within ``wait_s``, this thread leaves
    for the main thread, blocked in a collective that would wait for the whole collective timeout,
    after flushing the user's loggers and running the ``atexit`` handlers.
    """

    def __init__(
        self,
        procs: list[Popen],
        first_rank: int,
        *,
        grace_s: float = 30.0,
        loggers: Sequence[Any] = (),
        wait_s: float | None = None,
    ) -> None:
        super().__init__(daemon=True, name="titan-rank-watcher")
        self.procs, self.first_rank = procs, first_rank
        self.grace_s, self.loggers = grace_s, list(loggers)
        self.wait_s = min(LAUNCHER_WAIT_S, grace_s) if wait_s is None else wait_s

    def run(self) -> None:
        while True:
            time.sleep(0.2)
            codes = [p.poll() for p in self.procs]
            done = (0, 130, 143) if preempting.is_set() else (0,)  # stopped, `last` saved
            if all(code in done for code in codes):
                return
            failed = [(i, c) for i, c in enumerate(codes) if c is not None and c not in done]
            if failed:
                i, code = failed[0]
                say(
                    f"[titan] rank {self.first_rank + i} (pid {self.procs[i].pid}) "
                    f"{describe_exit(code)}: stopping every rank"
                )
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                if not _failing.wait(self.wait_s):
                    say(
                        f"[titan] the launcher's own collectives did not fail within {self.wait_s:g} s "
                        "(NCCL does not notice a dead peer): leaving with its logs flushed"
                    )
                    leave(1, self.grace_s, self.loggers)
                return


@contextmanager
def lightning_rendezvous(env: Any, forks: bool = False) -> Iterator[None]:
    """``hosted_rendezvous`` on the port Lightning's cluster environment keeps: its launchers hand that
    one to the ranks, and keep it for a second launch of the same Trainer. That is ``MASTER_PORT`` as
    given, else one picked now below the ephemeral range (Lightning's own pick, ``bind(0)``, is in it),
    which is unset again after. ``forks``: the ranks are forked from this process."""
    picked = "MASTER_PORT" not in os.environ
    if picked:
        os.environ["MASTER_PORT"] = str(free_port())
    try:
        with hosted_rendezvous(env.main_port, serve=env.node_rank() == 0, forks=forks):
            yield
    finally:
        if picked:
            os.environ.pop("MASTER_PORT", None)


def launcher_for(strategy: Any, start_method: str) -> Any:
    """The launcher for a strategy: one that only checks when processes are created outside
    (torchrun, SLURM), ours for ``popen`` (checks first, watches after), Lightning's multiprocessing
    one for fork/spawn."""
    env, options = strategy.cluster_environment, strategy.options
    if env.creates_processes_externally:
        return ExternalLauncher()
    if strategy.num_nodes > 1 and "MASTER_PORT" not in os.environ:
        # a port picked here would be this node's alone: the nodes would never meet
        raise ValueError(
            f"num_nodes={strategy.num_nodes}: set MASTER_PORT (a free port on node 0) and "
            "MASTER_ADDR (node 0's address) to the same values on every node, and NODE_RANK to "
            "each node's index; or start the ranks with torchrun or srun"
        )
    if start_method == "popen" and options.max_restarts:
        if strategy.num_nodes > 1:
            raise ValueError(
                f"max_restarts={options.max_restarts} restarts the ranks of one node; on "
                f"num_nodes={strategy.num_nodes} use torchrun --max-restarts (every node's agent)"
            )
        checks, rendezvous = launch_checks(strategy.preflight), lambda: lightning_rendezvous(env)
        n = strategy.num_processes
        return RestartingLauncher(checks, rendezvous, env, n, options.max_restarts, options.grace_s)
    if start_method == "popen":
        return TitanLauncher(strategy.preflight, env, strategy.num_processes, strategy.num_nodes)
    return TitanForkLauncher(strategy, start_method, strategy.options.grace_s)


def found_alike(error: BaseException) -> TooLittleData | None:
    """A forked rank's ``TooLittleData`` (every rank finds it alike) as the parent's own, for the
    command's one line or a notebook's exception: torch hands the parent only the rank's traceback,
    as text, whose last line is the class and the (one-line) message. None: another error."""
    if not isinstance(error, ProcessRaisedException):
        return None
    prefix = f"{TooLittleData.__module__}.{TooLittleData.__qualname__}: "
    said = [line for line in str(error).splitlines() if line.startswith(prefix)]
    return TooLittleData(said[-1][len(prefix) :]) if said else None


class TitanForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher (notebooks), where the parent is no rank: an interrupt or a
    SIGTERM there stops every rank, instead of returning while they train on. The ranks get SIGTERM
    (they save ``last`` after the step, ``preemption``), then SIGKILL after ``grace_s`` or at a second
    interrupt; a SIGTERM makes the parent exit with 143 once they are gone."""

    def __init__(self, strategy: Any, start_method: str, grace_s: float) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self._grace_s, self._sigterm = grace_s, False
        self._checks = launch_checks(strategy.preflight)

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # in the parent, before any rank starts (layout="auto" chooses here, so the parent knows it)
        self._checks(function, args, kwargs, trainer)
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._forward_sigterm) if main else None
        try:
            forks = self._start_method == "fork"
            with lightning_rendezvous(self._strategy.cluster_environment, forks=forks):
                return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException as err:
            self._stop_ranks(err)
            preempted = self.procs and all(p.exitcode == 143 for p in self.procs)
            if not isinstance(err, KeyboardInterrupt) and (self._sigterm or preempted):
                raise SystemExit(128 + signal.SIGTERM) from err  # every rank saved `last`
            found = found_alike(err)
            if found is not None:
                raise found from None
            raise
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        # the version folder rank 0's loggers wrote into: the parent's own loggers logged nothing, and
        # asked for a log_dir they would pick the next free version, a folder that does not exist
        extra = super().get_extra_results(trainer)
        extra["titan_logger_versions"] = [getattr(lg, "version", None) for lg in trainer.loggers]
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        versions = extra.pop("titan_logger_versions", [])
        super().update_main_process_results(trainer, extra)
        for logger, version in zip(trainer.loggers, versions, strict=False):
            if version is not None and hasattr(logger, "_version"):
                logger._version = version

    def _forward_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _stop_ranks(self, error: BaseException) -> None:
        alive = [p for p in self.procs if p.is_alive()]
        if not alive:
            return
        say(
            f"[titan] the launcher got {type(error).__name__}: stopping every rank (SIGTERM: they "
            f"save last after this step; SIGKILL after {self._grace_s:g} s or at another interrupt)"
        )
        try:
            for p in alive:
                p.terminate()  # SIGTERM
            deadline = time.monotonic() + self._grace_s
            while any(p.is_alive() for p in alive) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            for p in alive:
                if p.is_alive():
                    p.kill()
                p.join()

    @override
    def _wrapping_function(self, process_idx: int, trainer: Any, *args: Any, **kwargs: Any) -> Any:
        # in a rank: the parent decides on an interrupt (a terminal's Ctrl+C reaches every rank; they
        # would stop at different points) and sends SIGTERM; leave once the parent is gone
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        watch_launcher()
        try:
            return super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        except SIGTERMException as err:
            # a rank runs the Trainer's function without ``_call_and_handle_interrupt``: do its part
            # here, where the strategy saves `last` and sets the exit code (``preemption``)
            _interrupt(trainer, err)
            trainer._teardown()
            raise
