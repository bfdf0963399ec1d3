"""Every step option a layout allows (schedule, microbatches, virtual stages, recompute), each
predicted (``plan/cost.py``), ranked by predicted step time.

The options pass the strategy's own checks (``TrainOptions``, ``check_microbatches``, the layer
split, ``check_overlap``), like the layouts do (``plan/layouts.py``): so the overlapped schedules
(``1f1b_overlap`` on pp=1, ``dualpipev`` on pp >= 2 with M >= 2 pp) are offered only where the
all-to-all has ranks to cross (ep > 1, or a folded layout's tp or cp ranks), without activation
checkpointing and without ``compile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_titan.model.config import FULL, NONE, SELECTIVE, Recompute
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import (
    CHUNKED,
    SCHEDULES,
    V_SHAPED,
    check_microbatches,
)
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.activations import peak_bytes, weight_copy_bytes
from lightning_titan.plan.cost import StepCost, StepOptions, fold_terms, predict, virtual_split
from lightning_titan.plan.devices import Device
from lightning_titan.plan.layouts import Candidate, divisors
from lightning_titan.plan.memory import fullest_step_grad_bytes, trained_params
from lightning_titan.plan.precision import FP32, Precision
from lightning_titan.train.options import (
    TrainOptions,
    check_overlap,
    zero3_reshards_after_forward,
)

MAX_VIRTUAL_STAGES = 8  # interleaved 1F1B is offered with 2..8 chunks a rank
V_CHUNKS = 2  # zbv and dualpipev: exactly two chunks a rank, in a V

# every recompute mode the search prices (``ModelConfig.activation_checkpointing``)
RECOMPUTE_MODES: tuple[Recompute, ...] = (NONE, SELECTIVE, FULL)


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    options: StepOptions
    cost: StepCost
    activation_bytes: float  # the fullest stage's peak (plan/activations.py)
    # the grads a step holds beyond the state: at zero >= 2 what its microbatches accumulate whole
    # before the last backward (plan/memory.py fullest_step_grad_bytes)
    step_grad_bytes: float = 0.0

    @property
    def memory_bytes(self) -> float:
        return self.candidate.state_bytes + self.activation_bytes + self.step_grad_bytes

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def options_label(self) -> str:
        return self.options.label(self.candidate.degrees["pp"])


def _accepted(
    config: ModelConfig,
    degrees: dict[str, int],
    options: StepOptions,
    compiled: bool,
    stage_layers: tuple[int, ...] | None = None,
    fold_ep: bool = False,
) -> bool:
    pp, v = degrees["pp"], options.virtual_stages
    try:
        train = TrainOptions(schedule=options.schedule, virtual_stages=v)
        check_microbatches(options.schedule, options.microbatches, pp, v)
        # one count per stage (v = 1), or per virtual stage (interleaved on an uneven split)
        layers = options.virtual_layers if options.virtual_layers is not None else stage_layers
        StageSplit(v, layers).counts(config.n_layers, pp)
        dims = ParallelDims(**degrees, fold_ep=fold_ep)
        check_overlap(dims, train, recompute=options.recompute == FULL, compiled=compiled)
    except ValueError:
        return False
    return True


def step_options(
    config: ModelConfig,
    degrees: dict[str, int],
    local_batch: int,
    recompute: tuple[Recompute, ...] = RECOMPUTE_MODES,
    compiled: bool = False,
    stage_layers: tuple[int, ...] | None = None,
    fold_ep: bool = False,
) -> list[StepOptions]:
    """Schedules (interleaved 1F1B with each v of 2..8, on an uneven split or where ``pp * v``
    does not divide the layers each rank's layers dealt over its chunks: ``cost.virtual_split``) x
    microbatch counts (divisors of the per-rank batch) x recompute that ``degrees``
    accept (``compiled``: the model is compiled; ``stage_layers``: an uneven split, one count per
    stage, which the one-chunk schedules and interleaved 1F1B run; ``fold_ep``: folded); pp = 1: 1F1B (the microbatches are gradient
    accumulation: less activation memory) or, with an all-to-all (ep > 1, or folded tp or cp
    ranks), 1f1b_overlap from two microbatches.
    GPipe from two microbatches too: with one it runs 1F1B's order, the same row twice."""
    pp = degrees["pp"]
    schedules = ["1f1b", "1f1b_overlap"] if pp == 1 else sorted(SCHEDULES)
    out = []
    for ckpt in recompute:
        for schedule in schedules:
            chunks = [1]
            if schedule in CHUNKED:
                chunks = list(range(2, MAX_VIRTUAL_STAGES + 1))
            elif schedule in V_SHAPED:
                chunks = [V_CHUNKS]
            for v in chunks:
                virtual = None
                if schedule in CHUNKED:
                    if pp * v > config.n_layers:
                        continue  # a chunk without a layer: v cannot help
                    try:
                        virtual = virtual_split(config, pp, v, stage_layers)
                    except ValueError:
                        continue
                for m in divisors(local_batch):
                    options = StepOptions(schedule, m, v, ckpt, virtual)
                    if schedule in ("1f1b_overlap", "gpipe") and m == 1:
                        continue  # one microbatch: nothing to pair or reorder, 1F1B itself
                    if _accepted(config, degrees, options, compiled, stage_layers, fold_ep):
                        out.append(options)
    return out


class _Prices:
    """What a search prices once and shares between layouts: the step options of each (pp, an
    all-to-all or none, local batch), the weight copies of each (ranks the experts split over, tp),
    the activation peak of each layout without its zero level (ZeRO does not change the
    activations)."""

    def __init__(
        self,
        config: ModelConfig,
        global_batch: int,
        device: Device,
        recompute: tuple[Recompute, ...],
        precision: Precision,
        compiled: bool,
        lora: LoRA | None = None,
    ) -> None:
        self.config, self.batch, self.device = config, global_batch, device
        self.recompute, self.precision, self.compiled = recompute, precision, compiled
        self.lora = lora
        self._options: dict[tuple, list[StepOptions]] = {}
        self._copies: dict[tuple[int, ...], tuple[float, float, float]] = {}
        self._peaks: dict[tuple, float] = {}
        self._step_grads: dict[tuple, float] = {}

    def options(self, c: Candidate) -> list[StepOptions]:
        degrees = c.degrees
        pp, ep = degrees["pp"], degrees["ep"]
        local = self.batch // (degrees["dp"] * ep)
        # all that step_options' checks read of a layout
        key = (pp, c.dims.expert_world > 1, local, c.stage_layers)
        if key not in self._options:
            self._options[key] = step_options(
                self.config, degrees, local, self.recompute, self.compiled, c.stage_layers,
                c.fold_ep,
            )  # fmt: skip
        if c.zero == 3:  # priced gathered per block (layouts.fullest_gathered): those schedules
            return [o for o in self._options[key] if zero3_reshards_after_forward(pp, o.schedule)]
        return self._options[key]

    def activations(self, c: Candidate, options: StepOptions) -> float:
        degrees = c.degrees
        key = (*degrees.values(), c.fold_ep, c.stage_layers, options)
        if key not in self._peaks:
            self._peaks[key] = peak_bytes(
                self.config,
                degrees,
                options,
                self.batch,
                self.precision,
                self.copies(c),
                c.stage_layers,
            )
        return self._peaks[key]

    def copies(self, c: Candidate) -> tuple[float, float, float]:
        """``weight_copy_bytes`` of ``c``: they depend on the ranks the experts split over and tp."""
        key = (c.dims.expert_world, c.degrees["tp"])
        if key not in self._copies:
            self._copies[key] = weight_copy_bytes(self.config, c.degrees, self.precision, c.fold_ep)
        return self._copies[key]

    def params(self, c: Candidate) -> tuple[int, int]:
        """(non-expert, expert) trained parameters of ``c``'s fullest rank, as ``predict`` takes."""
        if self.lora is None and c.zero < 3 and c.policy.param_dtype == "fp32":
            return c.parts["non_expert_params"] // 4, c.parts["expert_params"] // 4
        # zero=3 (its parts hold its rows), LoRA, bf16 weights: the first stage's trained
        # parameters (an even split's are alike)
        split = StageSplit(1, c.stage_layers)
        return trained_params(self.config, c.dims, self.lora, split)

    def predict(self, c: Candidate, options: StepOptions) -> StepCost:
        return predict(
            self.config, c.degrees, c.zero, options, self.batch, self.device, self.params(c),
            self.precision, frozen_base=self.lora is not None, stage_layers=c.stage_layers,
            offload=c.policy.offload, fold_ep=c.fold_ep,
        )  # fmt: skip

    def step_grads(self, c: Candidate, options: StepOptions) -> float:
        """``memory.fullest_step_grad_bytes`` of ``c`` under ``options``: the whole grads its
        microbatches accumulate (zero >= 2, several a step)."""
        accumulating = options.microbatches > 1 and c.zero >= 2
        key = (*c.degrees.values(), c.fold_ep, c.stage_layers, c.policy.param_dtype, accumulating)
        if key not in self._step_grads:
            self._step_grads[key] = fullest_step_grad_bytes(
                self.config, c.degrees, c.zero, accumulating, self.lora, c.stage_layers,
                c.policy.param_dtype, c.fold_ep,
            )  # fmt: skip
        return self._step_grads[key]

    def rows(self, c: Candidate, fitting: bool = True) -> list[Ranked]:
        """``c`` with each step option (``fitting``: those whose memory fits the device)."""
        out = []
        for options in self.options(c):
            activations = self.activations(c, options)
            grads = self.step_grads(c, options)
            if fitting and c.state_bytes + activations + grads > self.device.memory:
                continue
            out.append(Ranked(c, options, self.predict(c, options), activations, grads))
        return out

    def lower_bound(self, c: Candidate) -> float:
        """No step option of ``c`` is predicted faster than this: one microbatch's compute without
        recompute and the fixed costs of one pass each (more microbatches only add passes), no
        bubble, the PP, TP and CP bytes (the same whatever M) with one microbatch's latencies, the
        data-parallel term with the most backward to hide under, the EP bytes unless an overlapped
        schedule could hide them, and the optimizer."""
        one = self.predict(c, StepOptions())
        hidden = one.comm["dp"]
        if FULL in self.recompute:  # a longer backward hides more of the reduction
            hidden = min(hidden, self.predict(c, StepOptions(recompute=FULL)).comm["dp"])
        overlappable = (
            c.dims.expert_world > 1 and set(self.recompute) != {FULL} and not self.compiled
        )
        ep = 0.0 if overlappable else one.comm["ep"]
        comm = one.comm["pp"] + one.comm["tp"] + one.comm["cp"] + ep + hidden
        return one.compute + comm + one.optimizer


def _undominated(found: list[Candidate], prices: _Prices | None = None) -> list[Candidate]:
    """``found`` without the zero=1 layouts whose zero=2 twin is there: the same step options and
    activations, no more state (the grads are split too) and less data-parallel traffic (a
    reduce-scatter where zero=1 all-reduces), so it ranks ahead of every zero=1 row. Over several
    microbatches the twin holds its rows more than zero=1 during the step (its grads accumulate
    whole beside them, ``step_grad_bytes``): a zero=1 layout that fits only by that margin is not
    offered. With
    ``prices``, also without each layout its folded twin dominates, or the other way round
    (``_fold_dominated``)."""
    twins = {(*c.degrees.values(), c.stage_layers, c.fold_ep) for c in found if c.zero == 2}
    kept = [
        c
        for c in found
        if not (c.zero == 1 and (*c.degrees.values(), c.stage_layers, c.fold_ep) in twins)
    ]
    if prices is None:
        return kept
    folded = {_twin_key(c): c for c in kept if c.fold_ep}
    dropped = set()
    for c in kept:
        twin = folded.get(_twin_key(c)) if not c.fold_ep else None
        if twin is not None:
            loser = _fold_dominated(prices, c, twin)
            if loser is not None:
                dropped.add(id(loser))
    return [c for c in kept if id(c) not in dropped]


def _twin_key(c: Candidate) -> tuple:
    return (*c.degrees.values(), c.zero, c.stage_layers, c.policy)


def _fold_dominated(prices: _Prices, plain: Candidate, folded: Candidate) -> Candidate | None:
    """Of a layout and its folded twin, the one the other dominates, or None: no less state, no
    larger weight copies (the activations), each of ``cost.fold_terms`` no larger (so no slower
    under any step option), and every step option it accepts accepted by the other (folding only
    adds an all-to-all where ep = 1: the overlapped schedules)."""
    sides = []
    for c in (plain, folded):
        copies = prices.copies(c)
        terms = fold_terms(
            prices.config, c.degrees, c.zero, prices.device, prices.params(c), c.fold_ep,
            c.policy.offload,
        )  # fmt: skip
        sides.append((c.state_bytes, *copies, *terms))
    if all(f <= p for f, p in zip(*reversed(sides), strict=True)):
        return plain
    same_options = plain.dims.expert_world > 1
    if same_options and all(p <= f for p, f in zip(*sides, strict=True)):
        return folded
    return None


Progress = Callable[[int, int, "Ranked | None"], None]


def ranked(
    config: ModelConfig,
    found: list[Candidate],
    global_batch: int,
    device: Device,
    recompute: tuple[Recompute, ...] = RECOMPUTE_MODES,
    precision: Precision = FP32,
    compiled: bool = False,
    keep: int | None = None,
    progress: Progress | None = None,
    fitting: bool = True,
    lora: LoRA | None = None,
) -> list[Ranked]:
    """Every candidate with every step option whose state and activations fit the device's
    memory, fastest predicted first; activations and payloads in ``precision``'s dtypes
    (``compiled``: the model is compiled, which the overlapped schedules refuse).

    ``keep``: only the ``keep`` fastest rows, found without pricing every layout: the zero=1
    layouts that their zero=2 twins dominate, and the layouts their folded (or unfolded) twins
    dominate, are dropped (``_undominated``), and the others are priced in the order
    of a lower bound on their step time (``_Prices.lower_bound``) until that bound passes the
    ``keep``-th fastest row found, after which no layout can enter the first ``keep``.
    ``progress(priced, of, fastest so far)`` is called after each layout priced. ``fitting=False``:
    the rows that do not fit the memory too (``titan plan --only`` shows what a layout would cost).
    ``lora``: LoRA's adapters train over a frozen base (``candidates(..., lora)``'s state)."""
    prices = _Prices(config, global_batch, device, recompute, precision, compiled, lora)
    order, bounds = list(found), {}
    if keep is not None:
        order = _undominated(found, prices)
        bounds = {id(c): prices.lower_bound(c) for c in order}
        order.sort(key=lambda c: bounds[id(c)])
    rows: list[Ranked] = []
    best: Ranked | None = None
    for done, c in enumerate(order, 1):
        if keep is not None and len(rows) >= keep and bounds[id(c)] > rows[-1].cost.step:
            break  # every layout left is bounded above the keep-th row
        new = prices.rows(c, fitting)
        rows.extend(new)
        best = min([*new, best] if best else new, key=_fastest, default=None)
        if keep is not None:
            rows.sort(key=_fastest)
            del rows[keep:]
        if progress is not None:
            progress(done, len(order), best)
    rows.sort(key=_fastest)
    return rows


def _fastest(r: Ranked) -> tuple[float, int]:
    return r.cost.step, r.candidate.state_bytes
