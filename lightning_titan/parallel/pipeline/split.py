"""Which layers each pipeline rank holds: ``pp`` ranks x ``virtual_stages`` chunks, even or explicit.

Virtual stage ``s`` (0 .. pp*v - 1, in model order) is chunk ``s // pp`` of rank ``s % pp``
(Megatron's round-robin): with pp=2, v=2 and 4 layers rank 0 holds layers 0 and 2, rank 1 layers
1 and 3. Virtual stage ``s`` holds the contiguous layers after those of stages 0 .. s-1, as many as
``stage_layers[s]`` (None: n_layers / (pp*v) each). Parameter names stay global (``layers.5...``),
so a checkpoint written under one split loads under any other.

With ``v_shape`` (schedule="zbv", two chunks per rank) the placement is the V instead: rank r holds
virtual stage r (chunk 0) and 2*pp-1-r (chunk 1), so rank 0 holds the first and the last stage and
the last rank two adjacent ones. The layer counts per virtual stage mean the same either way.

The embedding lives on virtual stage 0 and the head (norm, LM head, loss) on the last one: those two
may hold 0 layers (they have work anyway); any other stage must hold at least one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AUTO = "auto"  # stage_layers chosen from measured costs (train/auto_split.py)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class StageSplit:
    """How the layers are cut over the pipeline (``TitanStrategy(virtual_stages=, stage_layers=)``)."""

    virtual_stages: int = 1
    stage_layers: Sequence[int] | str | None = None  # a tuple once validated, or AUTO
    v_shape: bool = False  # schedule="zbv": rank r holds virtual stages r and 2*pp-1-r

    def __post_init__(self) -> None:
        if not _positive_int(self.virtual_stages):
            raise ValueError(
                f"virtual_stages={self.virtual_stages!r} must be a positive int (1: one chunk per rank)"
            )
        if self.v_shape and self.virtual_stages != 2:
            raise ValueError(
                f"the V placement (schedule='zbv') holds exactly two chunks per rank: "
                f"virtual_stages={self.virtual_stages} does not work; use virtual_stages=2"
            )
        layers = self.stage_layers
        if layers is not None and layers != AUTO:
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
                raise ValueError(
                    f"stage_layers={layers!r} must be a list of layer counts, one per (virtual) "
                    "stage, 'auto' (balanced by a probe of their cost), or None for an even split"
                )
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layers):
                raise ValueError(f"stage_layers={list(layers)} must hold ints >= 0")
            object.__setattr__(self, "stage_layers", tuple(layers))

    def counts(self, n_layers: int, pp: int) -> list[int]:
        """Layers per virtual stage, in model order (length pp * v); raises with the fix if the
        split does not fit ``n_layers`` on ``pp`` ranks."""
        v, stages = self.virtual_stages, pp * self.virtual_stages
        where = f"pp={pp}" if v == 1 else f"pp * virtual_stages = {pp} * {v}"
        if self.stage_layers is None:
            if n_layers % stages:
                raise ValueError(
                    f"n_layers={n_layers} is not divisible by {where} = {stages}; change n_layers "
                    f"to a multiple of {stages} or give stage_layers (one count per virtual stage)"
                    if v > 1
                    else f"n_layers={n_layers} is not divisible by pp={pp}; choose pp dividing "
                    f"{n_layers} or change n_layers to a multiple of {pp}"
                )
            return [n_layers // stages] * stages
        if isinstance(self.stage_layers, str):  # AUTO before the probe: any split balance() makes
            return balance(StageCosts(0.0, 1.0, 0.0), n_layers, stages)
        counts = [int(n) for n in self.stage_layers]
        if len(counts) != stages:
            raise ValueError(
                f"stage_layers={counts} has {len(counts)} entries but there are {where} = "
                f"{stages} {'virtual ' if v > 1 else ''}stages; give one layer count per stage"
                + (f" ({self.placement(pp)})" if v > 1 else "")
            )
        if sum(counts) != n_layers:
            raise ValueError(
                f"stage_layers={counts} sums to {sum(counts)} but the model has "
                f"n_layers={n_layers}; make the counts sum to {n_layers}"
            )
        empty = [s for s, n in enumerate(counts) if n == 0 and 0 < s < stages - 1]
        if empty:
            raise ValueError(
                f"stage_layers={counts} leaves stage {empty[0]} without layers; only the first "
                "(embedding) and the last (head) stage may hold 0 layers"
            )
        return counts

    def placement(self, pp: int) -> str:
        if self.v_shape:
            return f"virtual stage s is chunk 0 of rank s for s < {pp}, else chunk 1 of rank {2 * pp - 1} - s"
        return "virtual stage s is chunk s // pp of rank s % pp"

    def stage_ids(self, pp: int, pp_rank: int) -> list[int]:
        """The virtual stages rank ``pp_rank`` holds, chunk 0 first."""
        if self.v_shape:
            return [pp_rank, 2 * pp - 1 - pp_rank]  # down the V, then back up
        return list(range(pp_rank, pp * self.virtual_stages, pp))  # round-robin

    def chunk_ranges(self, n_layers: int, pp: int, pp_rank: int) -> list[tuple[int, int]]:
        """The layer ranges ``[start, end)`` of rank ``pp_rank``'s chunks, chunk 0 first."""
        if self.stage_layers == AUTO:
            raise RuntimeError(
                "stage_layers='auto' is chosen by a probe on the ranks (train/auto_split.py); "
                "build the stages from the counts it returns"
            )
        counts = self.counts(n_layers, pp)
        starts = [sum(counts[:s]) for s in range(len(counts))]
        return [(starts[s], starts[s] + counts[s]) for s in self.stage_ids(pp, pp_rank)]


@dataclass(frozen=True)
class StageCosts:
    """Seconds for one microbatch's forward + backward through each part."""

    embed: float
    block: float  # an MoE block
    head: float  # final norm, LM head and the loss
    dense_block: float = 0.0  # a dense block (DeepSeek-V3's first layers), when the model has any

    def describe(self) -> str:
        return (
            f"embedding {self.embed * 1e3:.2f} ms, block {self.block * 1e3:.2f} ms, "
            f"head + loss {self.head * 1e3:.2f} ms per microbatch"
        )


def balance(costs: StageCosts, n_layers: int, stages: int, dense_layers: int = 0) -> list[int]:
    """Layers per virtual stage (model order) minimising the slowest stage; middle stages hold >= 1.

    The bottleneck ``T`` is found by bisection on ``T / block``: stage s holds
    ``floor((T - extra_s) / block)`` layers, and the least ``T`` whose capacities cover ``n_layers``
    wins; the layers left over go to the stages with the most room (the middle ones first).
    ``dense_layers``: the first layers cost ``costs.dense_block`` each instead (``_balance_costs``)."""
    if stages == 1:
        return [n_layers]
    if n_layers < stages - 2:
        raise ValueError(
            f"stage_layers='auto' cannot split n_layers={n_layers} over {stages} stages: every stage "
            f"but the first and the last needs a layer; use at most {n_layers + 2} (virtual) stages"
        )
    if dense_layers and costs.dense_block > 0:
        layers = [costs.dense_block] * dense_layers + [costs.block] * (n_layers - dense_layers)
        return _balance_costs(costs, layers, stages)
    block = max(costs.block, 1e-12)
    extra = [0.0] * stages
    extra[0] += costs.embed / block
    extra[-1] += costs.head / block
    floor = [0 if s in (0, stages - 1) else 1 for s in range(stages)]

    def capacity(t: float) -> list[int]:
        return [max(floor[s], int(t - extra[s] + 1e-9)) for s in range(stages)]

    low, high = 0.0, float(n_layers) + max(extra)
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(capacity(mid)) < n_layers else (low, mid)
    counts = capacity(high)
    # bisection overshoots by whole layers: take back from the stages that end up slowest
    while sum(counts) > n_layers:
        over = [s for s in range(stages) if counts[s] > floor[s]]
        s = max(over, key=lambda s: (counts[s] + extra[s], -abs(s - stages / 2)))
        counts[s] -= 1
    return counts


def _balance_costs(costs: StageCosts, layers: list[float], stages: int) -> list[int]:
    """``balance`` for layers of different costs (``layers[i]``: layer i's seconds): the least
    bottleneck ``T`` (bisection) at which filling the stages in order, each as far as ``T`` allows
    and leaving every later middle stage its layer, places every layer."""
    floor = [0 if s in (0, stages - 1) else 1 for s in range(stages)]
    extra = [0.0] * stages
    extra[0] += costs.embed
    extra[-1] += costs.head

    def fill(t: float) -> list[int] | None:
        counts, i = [], 0
        for s in range(stages):
            keep = sum(floor[s + 1 :])  # layers the later stages need
            used, n = extra[s], 0
            while i + n < len(layers) - keep and (n < floor[s] or used + layers[i + n] <= t):
                used, n = used + layers[i + n], n + 1
            if used > t + 1e-12:
                return None
            counts.append(n)
            i += n
        return counts if i == len(layers) else None

    low, high = 0.0, sum(layers) + sum(extra)
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (low, mid) if fill(mid) is not None else (mid, high)
    counts = fill(high)
    assert counts is not None  # T = every cost at once always fits
    return counts
