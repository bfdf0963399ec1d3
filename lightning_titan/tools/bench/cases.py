"""What the benchmark runs: the compositions per world size, their peers, and the shared settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.pipeline.schedules import V_SHAPED
from lightning_titan.parallel.pipeline.split import AUTO, StageSplit

OURS, PER_PARAM, DDP, TORCH_PP = "titan", "titan_per_param", "ddp", "torch_pp"
ZERO1, ZERO2, DDP_ZERO, TORCH_TP = "titan_zero1", "titan_zero2", "ddp_zero", "torch_tp"
FSDP2 = "fsdp2"
ZERO3, FSDP2_ZERO3 = "titan_zero3", "fsdp2_zero3"  # ours at zero=3; FSDP2 resharding after forward
A2A_BLOCKING = "titan_a2a_blocking"  # ours with every EP all-to-all waited for at once
# ours under another schedule than the case's (titan bench --ep-overlap): zbv with the in-layer
# overlap, and the schedules that overlap one microbatch's forward with another's backward
ZBV, OVERLAP_1F1B, DUALPIPEV = "titan_zbv", "titan_1f1b_overlap", "titan_dualpipev"
SCHEDULE_IMPLS = {ZBV: "zbv", OVERLAP_1F1B: "1f1b_overlap", DUALPIPEV: "dualpipev"}
PAIRED = (OVERLAP_1F1B, DUALPIPEV)  # a rank runs two threads (parallel/overlap.py)
ZERO_LEVELS = {ZERO1: 1, ZERO2: 2, ZERO3: 3}  # ours with a zero flag
IMPL_LABELS = {
    OURS: "ours",
    ZERO1: "ours, zero=1",
    ZERO2: "ours, zero=2",
    ZERO3: "ours, zero=3",
    PER_PARAM: "ours, per-param all-reduce",
    DDP: "torch DDP",
    DDP_ZERO: "torch DDP + ZeroRedundancyOptimizer",
    TORCH_PP: "torch.distributed.pipelining",
    TORCH_TP: "torch parallelize_module (TP + SP)",
    FSDP2: "torch FSDP2 (fully_shard, ZeRO-2)",
    FSDP2_ZERO3: "torch FSDP2 (fully_shard, ZeRO-3)",
    A2A_BLOCKING: "ours, all-to-alls waited for at once",
    ZBV: "ours, zbv",
    OVERLAP_1F1B: "ours, 1f1b_overlap",
    DUALPIPEV: "ours, dualpipev",
}
# what a peer is timed against (default: OURS): the sharded-state peer against our sharded state
BASELINES = {DDP_ZERO: ZERO1, FSDP2: ZERO2, FSDP2_ZERO3: ZERO3, A2A_BLOCKING: OURS}
OVERLAP_IMPLS = (OURS, ZBV, *PAIRED)  # --ep-overlap: each timed against A2A_BLOCKING


@dataclass(frozen=True)
class Case:
    """One layout and schedule; ``impls[0]`` is ours, the rest are peers timed in the same rounds."""

    dp: int = 1
    pp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    tp: int = 1
    impls: tuple[str, ...] = (OURS,)
    cp: int = 1
    virtual_stages: int = 1  # chunks per rank (interleaved_1f1b; zbv: 2, in a V)
    stage_layers: tuple[int, ...] | str | None = None  # layers per (virtual) stage, or "auto"
    microbatches: int | None = None  # M for every impl (None: Settings.num_microbatches's)

    @property
    def split(self) -> StageSplit:
        v_shape = self.schedule in V_SHAPED  # as TrainOptions.split: zbv's chunks go in a V
        return StageSplit(self.virtual_stages, self.stage_layers, v_shape)

    def of(self, impl: str) -> Case:
        """The case as ``impl`` runs it: under its own schedule where it has one (V-shaped: v=2)."""
        schedule = SCHEDULE_IMPLS.get(impl)
        if schedule is None:
            return self
        return replace(self, schedule=schedule, virtual_stages=2 if schedule in V_SHAPED else 1)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.ep * self.cp * self.tp

    @property
    def layout(self) -> str:
        degrees = (
            ("dp", self.dp),
            ("pp", self.pp),
            ("ep", self.ep),
            ("cp", self.cp),
            ("tp", self.tp),
        )
        parts = [f"{name}{n}" for name, n in degrees if n > 1]  # mesh order, tp fastest
        return "x".join(parts) or "single"

    @property
    def name(self) -> str:
        if self.pp == 1:
            return self.layout
        name = f"{self.layout} {self.schedule}"
        if self.virtual_stages > 1 and self.schedule not in V_SHAPED:  # zbv: always 2
            name += f" v{self.virtual_stages}"
        if self.stage_layers == AUTO:
            name += " auto"
        elif self.stage_layers is not None:
            name += " layers" + "-".join(map(str, self.stage_layers))
        return name


@dataclass(frozen=True)
class Settings:
    config: ModelConfig = field(default_factory=ModelConfig)
    global_batch: int = 32  # sequences per step, the same for every world size
    warmup: int = 2  # steps per implementation before timing (allocator, p2p shape exchange)
    steps: int = 4  # timed steps per round
    rounds: int = 3  # rounds alternate the implementations of a case; the median round is reported
    traced_steps: int = 3  # extra steps recorded as spans for the time breakdown and the bubble
    microbatches_per_stage: int = 4  # M = this * pp (capped by the per-rank batch)
    device: str = "cpu"
    bucket_cap_mb: float = 25.0  # ours; the DDP peer keeps its own defaults
    threads_per_rank: int | None = None  # None: the launcher's split of the cores between the ranks
    precision: str = "32-true"  # "bf16-mixed": every step under autocast, as Lightning runs it
    timeout_s: float = 1800.0

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.config.seq_len

    def num_microbatches(self, case: Case) -> int:
        if case.microbatches is not None:
            return case.microbatches
        if case.pp == 1:
            return 1
        local = self.global_batch // (case.dp * case.ep)  # TP ranks read the same sequences
        m = min(local, self.microbatches_per_stage * case.pp)
        while local % m:
            m -= 1
        return m


def default_cases(worlds: list[int], peers: bool = True) -> list[Case]:
    """Every composition of dp, pp and ep on each world size (pp <= 4: the default model has 4 layers)."""
    # zero=1 and 2 are ours with a flag: they stay under --no-peers, the ZeRO peer goes
    dp_peers = (
        (OURS, ZERO1, ZERO2, PER_PARAM, DDP, DDP_ZERO, FSDP2) if peers else (OURS, ZERO1, ZERO2)
    )
    pp_peers = (OURS, TORCH_PP) if peers else (OURS,)
    tp_peers = (OURS, TORCH_TP) if peers else (OURS,)
    table = {
        1: [Case()],
        2: [Case(dp=2, impls=dp_peers), Case(pp=2, schedule="gpipe", impls=pp_peers),
            Case(pp=2, impls=pp_peers), Case(ep=2), Case(tp=2, impls=tp_peers), Case(cp=2)],
        4: [Case(dp=4, impls=dp_peers), Case(pp=4, schedule="gpipe", impls=pp_peers),
            Case(pp=4, impls=pp_peers), Case(ep=4), Case(dp=2, pp=2), Case(pp=2, ep=2),
            Case(dp=2, ep=2, impls=(OURS, ZERO1, ZERO2)), Case(dp=2, tp=2, impls=(OURS, ZERO1, ZERO2)),
            Case(ep=2, tp=2),
            Case(cp=4), Case(cp=2, tp=2)],
        8: [Case(dp=8, impls=dp_peers), Case(ep=8), Case(dp=4, pp=2), Case(pp=4, ep=2),
            Case(dp=2, ep=4), Case(dp=2, pp=2, ep=2)],
    }  # fmt: skip
    unknown = [w for w in worlds if w not in table]
    if unknown:
        raise ValueError(
            f"no default compositions for world sizes {unknown}; choose from {sorted(table)}"
        )
    return [case for w in worlds for case in table[w]]


def quick_cases(peers: bool = True) -> list[Case]:
    """Two ranks, one case per axis, with their peers: the smoke test's run."""
    return [
        Case(
            dp=2,
            impls=(OURS, ZERO1, ZERO2, PER_PARAM, DDP, DDP_ZERO, FSDP2, ZERO3, FSDP2_ZERO3)
            if peers
            else (OURS, ZERO1, ZERO2, ZERO3),
        ),
        Case(pp=2, impls=(OURS, TORCH_PP) if peers else (OURS,)),
        Case(pp=2, schedule="gpipe"),
        Case(ep=2),
        Case(tp=2, impls=(OURS, TORCH_TP) if peers else (OURS,)),
        Case(cp=2),
    ]


SCHEDULES_N_LAYERS = 8  # pp4 x v2 = 8 virtual stages of one layer each


def schedule_cases(peers: bool = True) -> list[Case]:
    """``titan bench --schedules``: pp2 and pp4 under 1F1B, interleaved 1F1B (v=2), ZB-H1 and ZBV
    at the same M, each beside its torch.distributed.pipelining schedule; and pp2 1F1B with the
    layers split by ``stage_layers="auto"`` (ours only: the probe's split against the theory)."""
    impls = (OURS, TORCH_PP) if peers else (OURS,)
    cases = []
    for pp in (2, 4):
        cases += [
            Case(pp=pp, impls=impls),
            Case(pp=pp, schedule="interleaved_1f1b", virtual_stages=2, impls=impls),
            Case(pp=pp, schedule="zb_h1", impls=impls),
            Case(pp=pp, schedule="zbv", virtual_stages=2, impls=impls),
        ]
    return cases + [Case(pp=2, stage_layers=AUTO)]


def ep_overlap_cases(quick: bool = False) -> list[Case]:
    """``titan bench --ep-overlap``: before, ours under 1F1B with each all-to-all waited for at once
    and with the in-layer overlap (and under zbv where pp > 1); after, the schedules that overlap two
    microbatches (1f1b_overlap at pp=1, dualpipev), all in the same rounds, on ep2, ep4, pp2 x ep2
    and dp2 x pp2 x ep2 (with --quick: ep2 only). At pp=1 every impl runs M=4, three of whose four
    forwards 1f1b_overlap pairs (the pipelines run 4 per stage too)."""
    flat = (OURS, A2A_BLOCKING, OVERLAP_1F1B)
    piped = (OURS, A2A_BLOCKING, ZBV, DUALPIPEV)
    m = 4
    cases = [
        Case(ep=2, impls=flat, microbatches=m),
        Case(ep=4, impls=flat, microbatches=m),
        Case(pp=2, ep=2, impls=piped),
        Case(dp=2, pp=2, ep=2, impls=piped),
    ]
    return cases[:1] if quick else cases


def zero3_cases(quick: bool = False) -> list[Case]:
    """``titan bench --zero3``: ours at zero=3 beside zero=0 (one process's state per rank, which
    zero=3 divides), our zero=2 and torch FSDP2 resharding after forward (ZeRO-3), in the same
    rounds, on dp2 and dp4; dp2 x ep2 without FSDP2, which has no expert parallelism (with --quick:
    dp2 only)."""
    impls = (OURS, ZERO2, ZERO3, FSDP2_ZERO3)
    cases = [Case(dp=2, impls=impls), Case(dp=4, impls=impls), Case(dp=2, ep=2, impls=impls[:3])]
    return cases[:1] if quick else cases
