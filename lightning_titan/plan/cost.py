"""Predicted step time of a layout, term by term: compute, the pipeline bubble, and each kind of
communication, so a reader sees why one layout wins.

- **compute**: the model's matmul FLOPs (``model/flops.py``) a rank does (its stage's layers, its share of
  the tokens: ``b*S/(tp*cp)``; x4/3 under full activation checkpointing; under selective recompute the norms' and activations'
  bytes again at the memory bandwidth, ``selective_bytes``) at the device's throughput,
  plus a fixed cost per block pass (launches; it is what a small model pays on a CPU), more when the
  schedule splits the backward into B and W (``Device.split_s``);
- **bubble**: the schedule's idle time, ``(pp-1)/M`` of a stage's compute for GPipe and 1F1B, that
  over ``v`` for interleaved 1F1B, over 3 for ZB-H1 (its cooldown runs the deferred weight grads),
  over 6 for ZBV and DualPipeV (two chunks per rank in a V); the replayed order while the pipeline
  never fills;
- **communication**: bytes per collective per step and rank at the link's bandwidth, plus its
  latency: the data-parallel all-reduce (or ZeRO's reduce-scatter and all-gather) per 25 MiB bucket
  the cheaper of NCCL's ring and tree (``reduction``: its latency model, the group's ranks in one
  node driving as many network adapters; only what outlasts the last microbatch's backward is
  exposed), the EP all-to-alls by link tier (``dispatch_seconds``: the in-node share on NVLink, the
  rest on the network, at once; ``Device.dispatch`` "node-dedup" for a dispatcher that sends a token
  to each node once), PP send/recv, TP's sequence all-gather / reduce-scatter, CP's key/value
  all-gather (a ring on the network once the group spans nodes);
- **overlapped schedules** (``1f1b_overlap``, ``dualpipev``): a paired tick runs one microbatch's
  forward with another's backward, each one's EP all-to-alls under the other's compute. For the
  paired share of the forwards (and as many backwards: ``paired_fraction``), the forward's
  all-to-alls cost ``max(0, a2a - backward compute)`` and the backward's ``max(0, a2a - forward
  compute)`` (backward 2/3 of a microbatch's compute, forward 1/3); the unpaired ones are exposed
  whole. The pairs share the rank's compute: the compute and the bubble are 1F1B's and ZBV's;
- **optimizer**: AdamW streaming the state the rank owns.

A folded layout (``fold_ep``, ``parallel/mesh.py``) changes the groups, not the work: the experts
split over the stage's ep x cp x tp ranks, each whole on one of them, and each rank dispatches its
own positions (its sequence-parallel slice) as unfolded, so a rank's expert FLOPs and dispatch
bytes are the same (``b*S/(tp*cp)`` positions, top-K copies each); the all-to-all runs over the
folded group (``dispatch_seconds`` over its tiers: a larger share of the copies leaves the rank, and
the tp and cp ranks it adds share the node), the expert grads reduce over the dp ranks only, and
the rank owns ``1/(ep*cp*tp)`` of the experts (``plan/memory.py``).

Each payload is priced in the dtype the run sends it in (``plan/precision.py``): under ``bf16-mixed``
the EP, PP, CP and TP payloads in bf16, the gradients fp32.

On a CPU the ranks share the cores: a step takes at least the busy time of all ranks over the cores.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from lightning_titan.model.config import FULL, NONE, SELECTIVE, Recompute
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.flops import layer_flops_per_token, mean_layer_flops_per_token
from lightning_titan.model.options import LATENT
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import SPLIT_BACKWARD, V_SHAPED
from lightning_titan.parallel.pipeline.split import StageCosts, balance
from lightning_titan.parallel.pipeline.theory import ideal_bubble
from lightning_titan.parallel.pipeline.zbv import dualpipev_order
from lightning_titan.plan.devices import Device, Link
from lightning_titan.plan.precision import FP32, Precision
from lightning_titan.plan.precision import STATE_BYTES as BYTES
from lightning_titan.train.options import zero3_reshards_after_forward

BUCKET = 25 * 2**20  # the reducer's default bucket_cap_mb
# (grad reduction, weight all-gather) in units of (n-1)/n * bytes: a ring all-reduce is 2, a
# reduce-scatter or an all-gather 1; zero=3 gathers once a step where it keeps the stage whole, and
# each block for its forward and again for its backward (the last block's kept), every
# microbatch, where it does not
ZERO_FACTOR = {0: (2.0, 0.0), 1: (2.0, 1.0), 2: (1.0, 1.0), 3: (1.0, 1.0)}


# the table's suffix for each recompute mode
RECOMPUTE_LABELS = {NONE: "", SELECTIVE: " sel", FULL: " ckpt"}


def selective_bytes(config: ModelConfig, precision: Precision) -> float:
    """Bytes a token streams per layer when selective recompute runs its norms and gated
    activations again: each norm reads and writes ``D`` values, each activation reads the gate and
    up rows and writes one (``K`` routed rows of ``F``, a shared expert's ``F_s``), in the
    activations' dtype. Priced at the memory bandwidth: no matmul is run again."""
    shared = config.experts.shared_dim
    elements = 2 * 2 * config.d_model + 3 * (config.top_k * config.ffn_dim + shared)
    return elements * precision.wire


@dataclass(frozen=True)
class StepOptions:
    """What a step does beside its layout."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    recompute: Recompute = (
        NONE  # activation checkpointing: none, selective or full (``ModelConfig``)
    )
    # interleaved 1F1B on an uneven split: the layers per virtual stage (model order, pp * v of
    # them; ``virtual_split``), their sums per rank the layout's ``stage_layers``; None: even
    virtual_layers: tuple[int, ...] | None = None

    def label(self, pp: int = 2) -> str:
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        # no pipeline: no schedule to name but the overlapped one
        schedule = f"{self.schedule}{v} " if pp > 1 or self.schedule != "1f1b" else ""
        return f"{schedule}M{self.microbatches}" + RECOMPUTE_LABELS[self.recompute]


@dataclass(frozen=True)
class StepCost:
    """Seconds per step, by term (comm: one entry per collective kind)."""

    compute: float
    bubble: float
    comm: dict[str, float]
    optimizer: float
    step: float  # the prediction (on a shared CPU: at least every rank's busy time over the cores)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble / (self.compute + self.bubble) if self.bubble else 0.0


def stage_flops(config: ModelConfig) -> tuple[float, float, float]:
    """Matmul FLOPs per token of (the embedding, one layer, the head and loss) as ``predict`` prices
    them: the embedding is a lookup (no matmul), a layer is an MoE layer wherever the model has any
    (its attention causal, averaged over full and sliding-window layers), the head ``2 D V``."""
    dense_layer = layer_flops_per_token(config)[1]
    moe = config.experts.dense_layers < config.n_layers
    layer = mean_layer_flops_per_token(config) if moe else dense_layer
    return 0.0, layer, 2.0 * config.d_model * config.vocab_size


@functools.cache
def _balanced(config_key: str, flops: tuple[float, float, float], n_layers: int, pp: int) -> tuple:
    return tuple(balance(StageCosts(*flops), n_layers, pp))


def balanced_split(config: ModelConfig, pp: int) -> tuple[int, ...]:
    """Layers per stage that make the slowest of ``pp`` stages fastest in ``predict``'s compute:
    ``split.balance`` (what ``stage_layers="auto"`` runs on probed times) on ``stage_flops``, so
    the last stage, which also runs the head and the loss, holds fewer layers where the head
    weighs. Raises where ``pp`` stages cannot each hold a layer (the first and last may hold 0)."""
    return _balanced(repr(config), stage_flops(config), config.n_layers, pp)


def virtual_split(
    config: ModelConfig, pp: int, v: int, stage_layers: tuple[int, ...] | None = None
) -> tuple[int, ...] | None:
    """Layers per virtual stage (model order, ``pp * v``; stage ``s`` is chunk ``s // pp`` of rank
    ``s % pp``) for interleaved 1F1B on ``pp`` ranks holding ``stage_layers`` (None: ``n_layers /
    pp`` each; the layout's split, so its state and compute stay the layout's): each rank's layers
    dealt evenly over its ``v`` chunks, the last rank's balanced against the head and loss on its
    last chunk (``split.balance`` on ``stage_flops``, as ``balanced_split``). None where
    ``pp * v`` divides the layers of an even layout. Raises where the ranks' layers cannot be dealt
    (a chunk but the first and the last would hold none: ``v`` larger than a rank's layers)."""
    n = config.n_layers
    if stage_layers is None:
        if n % (pp * v) == 0:
            return None
        if n % pp:
            raise ValueError(f"n_layers={n} is not divisible by pp={pp}: give stage_layers")
        stage_layers = (n // pp,) * pp
    _, layer, head = stage_flops(config)
    chunks = []
    for rank, held in enumerate(stage_layers):
        if rank == pp - 1:
            chunks.append(_balanced(repr(config), (0.0, layer, head), held, v))
        else:
            q, extra = divmod(held, v)
            chunks.append((q + 1,) * extra + (q,) * (v - extra))
    counts = tuple(chunks[s % pp][s // pp] for s in range(pp * v))
    if any(c == 0 for c in counts[1:-1]):
        raise ValueError(f"{stage_layers} layers per rank leave a chunk of {v} empty")
    return counts


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a step with equal stages (docs/choosing_a_layout.md): the closed form once
    the pipeline fills, the replay of the schedule's own order (``parallel/pipeline/theory.py``) before; a test
    holds the two equal wherever the closed form is used."""
    m = microbatches
    fill = (pp - 1) / virtual_stages
    if schedule == "zb_h1":
        if m < pp:  # the W's cannot fill a warm-up that is never complete
            return ideal_bubble(schedule, pp, 1, m)
        fill /= 3  # F, B and W equal: 1F1B idles (pp-1)(F+B+W), ZB-H1 (pp-1)(F+B-W)
    elif schedule in V_SHAPED:  # zbv, dualpipev (its M >= 2P fills the V)
        if m < 2 * pp - 1:  # the V is never full
            return ideal_bubble(schedule, pp, 2, m)
        fill = (pp - 1) / 6  # the V's two chunks each idle ZB-H1's third of a chunk
    return fill / (m + fill)


@functools.cache
def paired_fraction(schedule: str, pp: int, microbatches: int) -> float:
    """The share of a rank's forwards (and as many backwards) an overlapped schedule runs paired with
    another microbatch's backward (forward): M-1 of M for 1f1b_overlap; for dualpipev the two-action
    ticks of ``dualpipev_order`` over its 2M chunk forwards, on the rank with the fewest; else 0."""
    m = microbatches
    if schedule == "1f1b_overlap":
        return (m - 1) / m
    if schedule == "dualpipev":
        ticks = (dualpipev_order(pp, rank, m) for rank in range(pp))
        return min(sum(len(tick) == 2 for tick in t) for t in ticks) / (2 * m)
    return 0.0


def exposed_all_to_all(
    schedule: str, pp: int, microbatches: int, forward_s: float, backward_s: float, compute_s: float
) -> float:
    """Seconds of the step's EP all-to-alls (``forward_s`` the forwards', ``backward_s`` the
    backwards') the rank waits for, ``compute_s`` its compute: all of them, but the paired share under
    an overlapped schedule hides under the partner's compute (module docstring)."""
    paired = paired_fraction(schedule, pp, microbatches)
    hidden = max(0.0, forward_s - 2 / 3 * compute_s) + max(0.0, backward_s - compute_s / 3)
    return paired * hidden + (1 - paired) * (forward_s + backward_s)


def collective(link: Link, nbytes: float, n: int, units: float, calls: int = 1) -> float:
    """Seconds for ``calls`` ring collectives over ``n`` ranks that together move ``units * (n-1)/n``
    times ``nbytes`` per rank (``nbytes``: all the calls' bytes; all-reduce 2, all-gather /
    reduce-scatter / all-to-all 1); each call pays the ring's latency."""
    if n == 1 or calls == 0:
        return 0.0
    steps = units * (n - 1)  # message steps of the ring, each paying the latency
    return calls * steps * link.latency_s + units * (n - 1) / n * nbytes / link.bandwidth


# NCCL's latency model of its ring and tree algorithms (src/graph/tuning.cc, the Simple protocol it
# runs large buckets in): a ring pays a base and one hop per step, the steps that cross nodes at the
# network's hop; a tree (all-reduce only) 2 x (a chain through the node's ranks + log2(nodes) network
# hops), its hop including a 256 kB chunk
RING_BASE_S = 8.4e-6
RING_HOP_S = (5.7e-6, 6.6e-6)  # NVLink, network
TREE_HOP_S = (28e-6, 50e-6)
DISPATCHERS = {
    "all-to-all": "this engine's: one copy per chosen expert, a flat all-to-all over the EP group",
    "node-dedup": "DeepEP's / Megatron's hierarchical dispatcher: one copy of a token per "
    "destination node over the network, fanned out to that node's experts over NVLink",
}


@functools.cache
def members_per_node(
    degrees: tuple[tuple[str, int], ...], varying: tuple[str, ...], per_node: int
) -> int:
    """Ranks of one group (the ranks that differ only on the ``varying`` axes) that share a node of
    ``per_node`` consecutive ranks: those of the first node whose other coordinates are 0 (the
    launcher gives consecutive ranks to a node; every group has the same share)."""
    count = 0
    for rank in range(min(per_node, math.prod(d for _, d in degrees))):
        fixed_zero = True
        for axis, degree in reversed(degrees):
            rank, coord = divmod(rank, degree)
            fixed_zero &= axis in varying or coord == 0
        count += fixed_zero
    return count


def _placed(device: Device, degrees: dict[str, int], varying: tuple[str, ...]) -> tuple[int, int]:
    """(ranks in the group, of them in one node): all of them without an inter-node link."""
    n = math.prod(degrees[a] for a in varying)
    if device.inter is None:
        return n, n
    return n, members_per_node(tuple(degrees.items()), varying, device.per_node)


def reduction(
    device: Device,
    degrees: dict[str, int],
    varying: tuple[str, ...],
    nbytes: float,
    units: float,
    buckets: int,
) -> float:
    """Seconds of ``buckets`` equal NCCL reductions of ``nbytes`` in all over the group varying
    ``varying``: all-reduce (``units`` 2) the cheaper of ring and tree per bucket, reduce-scatter
    and all-gather (1) the ring. Bandwidth: the ``g`` ranks of the group in one node drive ``g``
    network links (one adapter per GPU), so the group moves ``min(NVLink, g x network)`` bytes/s per
    rank once it spans nodes (NCCL's ring and tree bus bandwidth); latency: ``RING_*``, ``TREE_*``."""
    n, g = _placed(device, degrees, varying)
    if n == 1 or buckets == 0:
        return 0.0
    if device.cores is not None:  # gloo on one machine: the plain ring (collective)
        return collective(device.intra, nbytes, n, units, buckets)
    nodes = n // g
    bw = device.intra.bandwidth
    if nodes > 1 and device.inter is not None:
        bw = min(bw, g * device.inter.bandwidth)
    steps, inter_steps = units * (n - 1), units * (nodes - 1)
    per_bucket = nbytes / buckets
    ring = RING_BASE_S + (steps - inter_steps) * RING_HOP_S[0] + inter_steps * RING_HOP_S[1]
    ring += units * (n - 1) / n * per_bucket / bw
    best = ring
    if units == 2:  # NCCL's tree: all-reduce only; reduce up and broadcast down, each the data once
        depth = (g - 1) * TREE_HOP_S[0] + math.ceil(math.log2(nodes)) * TREE_HOP_S[1]
        best = min(ring, 2 * depth + 2 * per_bucket / bw)
    return buckets * best


def dispatch_seconds(
    device: Device,
    degrees: dict[str, int],
    copies: float,
    nbytes: float,
    experts: int,
    calls: int,
    varying: tuple[str, ...] = ("ep",),
) -> float:
    """Seconds of ``calls`` EP all-to-alls over the group varying ``varying`` (``("ep",)``, folded
    ``("ep", "cp", "tp")``), each sending ``copies`` copies of every token (top-K's K; 0 for the
    count exchange) of ``nbytes`` bytes in all per copy: ``calls`` latencies and ``nbytes`` at the
    rate of ``dispatch_rate``."""
    if calls == 0:
        return 0.0
    latency, per_byte = dispatch_rate(device, degrees, copies, experts, varying)
    return calls * latency + per_byte * nbytes


def dispatch_rate(
    device: Device,
    degrees: dict[str, int],
    copies: float,
    experts: int,
    varying: tuple[str, ...] = ("ep",),
) -> tuple[float, float]:
    """(latency of one call, seconds per byte of one copy of the tokens) of an EP all-to-all over
    the group varying ``varying`` (its ``n`` ranks, ``g`` of them in one node), priced by tier: of a
    token's ``copies`` copies ``1/n`` stay on the rank, ``(g-1)/n`` go to the ``g - 1`` peers in its
    node (NVLink) and ``(n-g)/n`` across nodes (network); both tiers run at once, so a call takes
    the slower one plus one latency of the farthest tier (the sends of one all-to-all leave
    together). ``device.dispatch == "node-dedup"``: a token crosses to each destination node once,
    however many of its experts that node holds (under uniform routing a remote node holding
    ``E/nodes`` of the ``E`` experts receives it with probability ``1 - C(E - E/nodes, K) / C(E,
    K)``), and is fanned out in the node over NVLink."""
    n, g = _placed(device, degrees, varying)
    if n == 1:
        return 0.0, 0.0
    nodes = n // g
    inter = device.inter if nodes > 1 and device.inter is not None else None
    near = copies * (g - 1) / n
    far = copies * (n - g) / n
    if device.dispatch == "node-dedup" and inter is not None and copies:
        k, local = round(copies), experts // nodes
        missed = math.comb(experts - local, k) / math.comb(experts, k)
        far = (nodes - 1) * (1 - missed)  # one copy per remote node the token's experts are on
        near = copies * (g - 1) / g  # every copy but the receiving rank's own, over NVLink
    per_byte = near / device.intra.bandwidth
    latency = device.intra.latency_s
    if inter is not None:
        per_byte = max(per_byte, far / inter.bandwidth)
        latency = inter.latency_s
    return latency, per_byte


def fold_terms(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int,
    device: Device,
    params: tuple[int, int],
    fold_ep: bool,
    offload: bool = False,
) -> tuple[float, ...]:
    """What folding changes in a step, as numbers every step option's terms grow with: the EP
    all-to-all's latency and seconds a byte (``dispatch_rate``: a step's EP term is its calls'
    latencies and its bytes at that rate, hidden in part under an overlapped schedule but never
    less for more), the grads' reductions and ZeRO's all-gathers (the DP term) and the optimizer
    (``params``: as ``predict``'s). The compute, the bubble and the PP, TP and CP terms are the
    same folded or not, so of a layout and its folded twin the one whose terms are each no larger
    is no slower under any step option both accept."""
    groups = ParallelDims(**degrees, fold_ep=fold_ep).group_axes
    reduced = (groups("non_expert_dp"), groups("expert_dp"))
    return (
        *dispatch_rate(device, degrees, config.top_k, config.n_experts, groups("ep")),
        *_reductions(degrees, zero, params, device, 1.0, reduced),
        _optimizer(degrees, zero, params, device, offload, reduced),
    )


def _link(device: Device, degrees: dict[str, int], slowest: str) -> Link:
    """The link a group uses: inter-node when its ranks (up to its slowest axis) span nodes."""
    axes = list(degrees)
    span = math.prod(degrees[a] for a in axes[axes.index(slowest) :])
    return device.inter if device.inter is not None and span > device.per_node else device.intra


def predict(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int,
    options: StepOptions,
    global_batch: int,
    device: Device,
    params: tuple[int, int],
    precision: Precision = FP32,
    frozen_base: bool = False,
    stage_layers: tuple[int, ...] | None = None,
    offload: bool = False,
    fold_ep: bool = False,
) -> StepCost:
    """The step time of ``degrees`` (dp, pp, ep, cp, tp) with ``options`` (``fold_ep``: folded, the
    groups of ``ParallelDims.group_axes``); ``params`` is the
    (non-expert, expert) count of the fullest rank's trained parameters (``plan/memory.py``): what
    its reductions carry and its optimizer steps; payloads in the dtypes ``precision`` sends.
    ``frozen_base`` (LoRA): the base's weight-gradient GEMMs are skipped, a backward is one pass
    (the input grads), the adapters' own work left out (a rank-r product per projection).
    ``stage_layers``: layers per stage (None: ``n_layers / pp`` each). ``offload``: the optimizer
    steps on the host (``_optimizer``).
    Each stage is priced with its layers (the first with the embedding, the last with the head and
    loss); the slowest one's compute and collectives are the step's, its compute sets the bubble."""
    pp, world = degrees["pp"], math.prod(degrees.values())
    groups = ParallelDims(**degrees, fold_ep=fold_ep).group_axes
    counts = stage_layers or (config.n_layers / pp,) * pp
    flops = stage_flops(config)  # once: a ModelConfig's derived fields are not cached
    terms = [
        _stage(
            config,
            degrees,
            options,
            global_batch,
            device,
            precision,
            flops,
            frozen_base,
            n,
            first,
            head,
            groups("ep"),
        )
        for n, first, head in _slowest_candidates(flops, counts)
    ]
    compute, comm = max(terms, key=lambda t: t[0] + sum(t[1].values()))
    comm = dict(comm)
    m_count = options.microbatches
    idle = bubble_fraction(options.schedule, pp, m_count, options.virtual_stages)
    bubble = compute * idle / (1 - idle)
    gathers = 1.0  # the weights' all-gathers a step
    if zero == 3 and zero3_reshards_after_forward(pp, options.schedule):
        # the blocks', each forward and backward (the rest of the stage is gathered once: left
        # out), but the last block's backward, which its forward's gather serves: each
        # microbatch's under 1f1b, the last one's under gpipe
        kept = m_count if options.schedule == "1f1b" else 1
        gathers = (2.0 * m_count * counts[0] - kept) / counts[0]
    reduced = (groups("non_expert_dp"), groups("expert_dp"))
    comm["dp"] = _data_parallel(degrees, zero, params, device, compute / m_count, gathers, reduced)
    optimizer = _optimizer(degrees, zero, params, device, offload, reduced)

    busy = compute + sum(comm.values()) + optimizer
    step = busy + bubble
    if device.cores is not None and world > device.cores:
        step = max(step, world * busy / device.cores)  # the ranks take turns on the cores
    return StepCost(compute, bubble, comm, optimizer, step)


def _slowest_candidates(
    flops: tuple[float, float, float], counts: tuple[float, ...]
) -> list[tuple[float, bool, bool]]:
    """The (layers, holds the embedding, holds the head) of the stages that could be the slowest:
    each distinct one but those another stage outdoes in layers, in extra FLOPs and in extra
    passes at once (an even split leaves the last stage alone, or the first where the embedding
    outweighs the head); ``flops``: ``stage_flops``."""
    embed, _, head = flops
    last = len(counts) - 1
    stages = {(n, s == 0, s == last) for s, n in enumerate(counts)}

    def work(stage: tuple[float, bool, bool]) -> tuple[float, float, int]:
        n, first, has_head = stage
        return n, first * embed + has_head * head, int(first or has_head)

    def outdone(a: tuple, b: tuple) -> bool:  # b at least as slow (the first of equals kept)
        wa, wb = work(a), work(b)
        return a != b and all(x >= y for x, y in zip(wb, wa, strict=True)) and (wb != wa or b < a)

    return sorted(a for a in stages if not any(outdone(a, b) for b in stages))


def _stage(
    config: ModelConfig,
    degrees: dict[str, int],
    options: StepOptions,
    global_batch: int,
    device: Device,
    precision: Precision,
    flops_per_token: tuple[float, float, float],
    frozen_base: bool,
    layers: float,
    first: bool,
    head: bool,
    dispatch_group: tuple[str, ...] = ("ep",),
) -> tuple[float, dict[str, float]]:
    """(compute seconds, the PP, EP, TP and CP terms) of a stage of ``layers`` layers (``first``: it
    holds the embedding, ``head``: the head and the loss; ``flops_per_token``: ``stage_flops``;
    ``frozen_base``: as ``predict``; ``dispatch_group``: the axes the all-to-all spans), per step."""
    dp, pp, ep, cp, tp = (degrees[a] for a in ("dp", "pp", "ep", "cp", "tp"))
    m_count, v = options.microbatches, options.virtual_stages
    b = global_batch // (dp * ep)
    tokens = b * config.seq_len / (tp * cp)  # positions this rank computes per step
    mb_tokens = tokens / m_count
    embed, layer, head_flops = flops_per_token
    # forward, backward (input and weight grads: 2x; the input grads alone under a frozen base),
    # and a recomputed forward
    passes = (2 if frozen_base else 3) + (1 if options.recompute == FULL else 0)
    flops = tokens * passes * (layers * layer + first * embed + head * head_flops)
    per_pass = device.pass_s + (device.split_s if options.schedule in SPLIT_BACKWARD else 0.0)
    compute = flops / device.flops + m_count * (layers + (first or head)) * per_pass
    if options.recompute == SELECTIVE:  # no matmul again: the norms and activations' bytes streamed
        compute += tokens * layers * selective_bytes(config, precision) / device.memory_bandwidth

    comm = {}
    wire = precision.wire
    act = mb_tokens * config.d_model  # one microbatch's activations between blocks, in elements
    # pp: a stage receives and sends one activation forward, one grad backward, per microbatch and chunk
    comm["pp"] = (
        0.0
        if pp == 1
        else 2
        * collective(_link(device, degrees, "pp"), act * wire * m_count * v, 2, 2, m_count * v)
    )
    # ep: dispatch, combine and the count exchange forward, dispatch and combine backward, per MoE layer
    token = mb_tokens * config.d_model * wire * m_count  # one copy of every token of the step
    calls = int(layers * m_count)
    n_e, group = config.n_experts, dispatch_group
    backward = 2 * dispatch_seconds(
        device, degrees, config.top_k, token * layers, n_e, calls, group
    )
    forward = backward + dispatch_seconds(device, degrees, 0, 0, n_e, calls, group)
    comm["ep"] = exposed_all_to_all(options.schedule, pp, m_count, forward, backward, compute)
    # tp: sequence all-gather in (the norm's output), reduce-scatter out (the o-projection's), around
    # each block's attention; and each again backward
    tp_link = _link(device, degrees, "tp")
    comm["tp"] = 4 * collective(tp_link, act * tp * wire * calls, tp, 1, calls)
    # cp: the keys and values of every position, gathered forward and their grads scattered back
    kv = 2 * mb_tokens * cp * config.kv_heads * config.head_dim * wire
    latent = config.attention.latent
    if config.attention.kind == LATENT:  # the latent and the shared RoPE key (model/mla.py)
        kv = mb_tokens * cp * (latent.kv_rank + latent.rope_dim) * wire
    comm["cp"] = 2 * collective(_link(device, degrees, "cp"), kv * calls, cp, 1, calls)
    return compute, comm


def _data_parallel(
    degrees: dict[str, int],
    zero: int,
    params: tuple[int, int],
    device: Device,
    microbatch_s: float,
    gathers: float,
    reduced: tuple[tuple[str, ...], tuple[str, ...]],
) -> float:
    """Exposed seconds of the gradient reduction (and ZeRO's weight all-gather, ``gathers`` times a
    step) of the (non-expert, expert) ``params`` over the groups varying ``reduced``: the reduction
    overlaps the last microbatch's backward (2/3 of its compute); the all-gathers follow the step
    or, zero=3, hold up the block that waits for them."""
    total, exposed = _reductions(degrees, zero, params, device, gathers, reduced)
    # the buckets are reduced as the backward fills them: only what outlasts it is exposed
    return max(0.0, total - 2 / 3 * microbatch_s) + exposed


def _reductions(
    degrees: dict[str, int],
    zero: int,
    params: tuple[int, int],
    device: Device,
    gathers: float,
    reduced: tuple[tuple[str, ...], tuple[str, ...]],
) -> tuple[float, float]:
    """(seconds of the grads' reductions, of ZeRO's all-gathers) of ``_data_parallel``."""
    grads, gather = ZERO_FACTOR[zero]
    gather *= gathers
    total = 0.0
    exposed = 0.0
    for n_params, varying in zip(params, reduced, strict=True):
        nbytes = n_params * BYTES
        buckets = max(1, math.ceil(nbytes / BUCKET))
        total += reduction(device, degrees, varying, nbytes, grads, buckets)
        exposed += reduction(device, degrees, varying, nbytes, gather, buckets)
    return total, exposed


def _optimizer(
    degrees: dict[str, int],
    zero: int,
    params: tuple[int, int],
    device: Device,
    offload: bool,
    reduced: tuple[tuple[str, ...], tuple[str, ...]],
) -> float:
    """AdamW reads and writes weight, grad and two moments of what the rank owns (ZeRO: its rows
    over the groups varying ``reduced``, the non-expert and the expert one).
    ``offload``: it does so in host memory (its share of the host's bandwidth), after each owned
    element's fp32 grad crossed to the host and before its fp32 weight crosses back, over the
    device's host link (``parallel/dp/offload.py``; the copies and the step not overlapped)."""
    sizes = [math.prod(degrees[a] for a in axes) for axes in reduced]
    owned = params[0] / sizes[0] + params[1] / sizes[1] if zero else sum(params)
    if offload:
        copies = owned * 2 * BYTES / device.host_link_bandwidth
        return copies + owned * 4 * BYTES * 2 / device.host_memory_bandwidth
    return owned * 4 * BYTES * 2 / device.memory_bandwidth
