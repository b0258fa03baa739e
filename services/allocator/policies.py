"""Placement policies: small plug-ins that score GPU sets within a node and nodes in a cluster.

A policy never decides fit (placement.py does, the same for all policies); it only ranks what
fits. ``gpu_score`` ranks a candidate GPU set for one container on one node; ``node_score``
ranks a node given the whole pod's placement there; ``to_scores`` turns raw node scores into
kube-scheduler's 0..10. Higher is better everywhere. Add a policy by writing a class with
these three methods and registering it in ``POLICIES``.

Built in: ``binpack`` and ``spread`` (node and GPU level, as HAMi), ``topology``
(multi-GPU containers on NVLink-connected GPUs, binpack otherwise) and ``fgd``
(fragmentation gradient descent, fragmentation.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .cluster import Charge, ClusterState, GpuState, NodeState
from .fragmentation import MixSnapshot, expected_increase, free_share
from .pod_request import PodRequest

if TYPE_CHECKING:
    from .node_table import NodeTable

MAX_SCORE = 10
_ZERO = Charge()
_USABLE_KEY = ("hostpack", "usable-gpus")  # NodeState.cache key


@dataclass
class Trial:
    """A node as it would be with a pod's charges placed so far (``extra`` per GPU uuid)."""

    node: NodeState
    extra: dict[str, Charge] = field(default_factory=dict)
    empty: bool = False  # capacity checks: as if nothing were placed and every GPU healthy
    _profiles: tuple[int, list[tuple[int, float, float]]] | None = field(default=None, repr=False)

    def changed(self) -> None:
        """`extra` changed: forget derived views."""
        self._profiles = None

    def profiles(self, mix: MixSnapshot) -> list[tuple[int, float, float]]:
        """Each GPU's fragmentation profile in the trial's state (node.gpus order), memoised."""
        if self._profiles is None or self._profiles[0] != mix.version:
            self._profiles = (mix.version, [mix.profile(self.key(g)) for g in self.node.gpus])
        return self._profiles[1]

    def used(self, gpu: GpuState) -> Charge:
        base = _ZERO if self.empty else gpu.used
        extra = self.extra.get(gpu.uuid)
        return base if extra is None else base + extra

    def key(self, gpu: GpuState, add: Charge | None = None) -> tuple[object, ...]:
        used = self.used(gpu)
        if add is not None:
            used = used + add
        return (
            gpu.device.model,
            gpu.base_memory_mib,
            gpu.memory_mib - used.memory_mib,
            gpu.compute - used.cores,
            gpu.slots - used.slots,
            self.empty or gpu.healthy,
        )


@dataclass(frozen=True)
class ScoreContext:
    mix: MixSnapshot
    cluster: ClusterState | None = None  # cluster-wide figures, for host_score
    model_shares: Mapping[tuple[str, ...], float] = field(default_factory=dict)  # WorkloadMix's


class Policy(Protocol):
    name: str

    def gpu_score(
        self,
        ctx: ScoreContext,
        trial: Trial,
        gpus: Sequence[GpuState],
        adds: Sequence[Charge],
    ) -> float: ...

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float: ...

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]: ...


def _fullness(trial: Trial, gpus: Sequence[GpuState], adds: Sequence[Charge]) -> float:
    """How full the GPUs would be after adding (memory and compute share, averaged)."""
    total = 0.0
    for gpu, add in zip(gpus, adds, strict=True):
        um, uc, _, _ = _ZERO if trial.empty else gpu.used
        em, ec, _, _ = trial.extra.get(gpu.uuid) or _ZERO
        memory = (um + em + add[0]) / gpu.memory_mib if gpu.memory_mib else 1.0
        total += (memory + (uc + ec + add[1]) / gpu.compute) / 2
    return total / len(gpus) if gpus else 0.0


def node_memory_fullness(trial: Trial) -> float:
    """Share of the node's GPU memory promised, counting the trial's extra charges."""
    total = sum(g.memory_mib for g in trial.node.gpus)
    used = sum(trial.used(g).memory_mib for g in trial.node.gpus)
    return used / total if total else 0.0


def absolute_scores(raw: Mapping[str, float]) -> dict[str, int]:
    """Raw scores already in [0, 1]: scaled to 0..10."""
    return {node: max(0, min(MAX_SCORE, round(MAX_SCORE * value))) for node, value in raw.items()}


def relative_scores(raw: Mapping[str, float]) -> dict[str, int]:
    """Raw scores on any scale: exactly the best get 10, the others 0..9 linearly between the
    worst and the best, so kube-scheduler's 11 levels never blur the winner into a crowd."""
    if not raw:
        return {}
    low, high = min(raw.values()), max(raw.values())
    if high - low < 1e-9:
        return dict.fromkeys(raw, MAX_SCORE)
    span = high - low
    return {
        n: MAX_SCORE
        if high - v < 1e-9
        else min(MAX_SCORE - 1, round((MAX_SCORE - 1) * (v - low) / span))
        for n, v in raw.items()
    }


def relative_scores_of(raw: np.ndarray) -> np.ndarray:
    """relative_scores of an array of raw scores, to the same integers (Python's round and
    numpy's rint both round half to even)."""
    if not raw.size:
        return np.zeros(0, dtype=np.int64)
    low, high = raw.min(), raw.max()
    if high - low < 1e-9:
        return np.full(raw.size, MAX_SCORE, dtype=np.int64)
    scaled = np.minimum(MAX_SCORE - 1, np.rint((MAX_SCORE - 1) * (raw - low) / (high - low)))
    return np.where(high - raw < 1e-9, MAX_SCORE, scaled).astype(np.int64)


class Binpack:
    """Fill what is already used: fuller GPUs and nodes first (HAMi's default node policy)."""

    name = "binpack"
    absolute = True  # to_scores is absolute_scores: cached per node
    gpu_state_only = True  # scores read only GPU states: equivalent nodes share them

    def gpu_score(self, ctx, trial, gpus, adds) -> float:  # type: ignore[no-untyped-def]
        return _fullness(trial, gpus, adds)

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        return node_memory_fullness(trial)

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return absolute_scores(raw)


class Spread:
    """Keep load apart: emptier GPUs and nodes first (HAMi's default GPU policy)."""

    name = "spread"
    absolute = True  # to_scores is absolute_scores: cached per node
    gpu_state_only = True  # scores read only GPU states: equivalent nodes share them

    def gpu_score(self, ctx, trial, gpus, adds) -> float:  # type: ignore[no-untyped-def]
        return 1.0 - _fullness(trial, gpus, adds)

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        return 1.0 - node_memory_fullness(trial)

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return absolute_scores(raw)


class Topology:
    """Multi-GPU containers on GPUs joined by NVLink (most linked pairs), binpack otherwise.

    A node scores by how well connected the pod's multi-GPU containers ended up (all pairs
    linked = 1), then by fullness, so it both keeps links together and packs.
    """

    name = "topology"
    absolute = True  # to_scores is absolute_scores: cached per node
    gpu_state_only = True  # scores read only GPU states: equivalent nodes share them

    @staticmethod
    def _linked_share(gpus: Sequence[GpuState]) -> float:
        pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
        if not pairs:
            return 0.0
        linked = sum(
            b.uuid in a.device.nvlink_peers or a.uuid in b.device.nvlink_peers for a, b in pairs
        )
        return linked / len(pairs)

    def gpu_score(self, ctx, trial, gpus, adds) -> float:  # type: ignore[no-untyped-def]
        return self._linked_share(gpus) * 2 + _fullness(trial, gpus, adds)

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        return node_memory_fullness(trial)

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return absolute_scores(raw)


class Fgd:
    """Place where the expected fragmentation of the cluster grows least (Weng et al. 2023)."""

    name = "fgd"
    relative = True  # to_scores is relative_scores: the core may score arrays
    uses_mix = True  # scores depend on the workload mix: caches refresh when it moves
    gpu_state_only = True

    def gpu_score(self, ctx, trial, gpus, adds) -> float:  # type: ignore[no-untyped-def]
        mix = ctx.mix
        before = trial.profiles(mix)
        after = list(before)
        positions = trial.node.positions
        for gpu, add in zip(gpus, adds, strict=True):
            after[positions[gpu.uuid]] = mix.profile(trial.key(gpu, add))
        # Tie-break on fullness so that with an empty mix it still packs.
        increase = expected_increase(mix.frag_of(before), mix.frag_of(after))
        return -increase + 1e-6 * _fullness(trial, gpus, adds)

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        mix = ctx.mix
        before = Trial(trial.node, empty=trial.empty).profiles(mix)
        increase = expected_increase(mix.frag_of(before), mix.frag_of(trial.profiles(mix)))
        return -increase + 1e-6 * node_memory_fullness(trial)

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return relative_scores(raw)


class HostPack(Binpack):
    """Binpack that does not strand GPUs behind a node's exhausted CPU.

    A node's usable free GPUs (free shares of at least `min_share`: slivers below it fit
    almost nothing and need no CPU) are stranded when its free CPU cannot feed them:
    stranded = max(0, usable free GPUs - free CPU / `cpu_per_gpu_milli`), plus all of them
    when the free CPU per usable GPU is below `starved_cpu_per_gpu_milli` (only the lightest
    pods could still use them). A node scores its
    binpack fullness minus `weight` x the growth of its stranded GPUs, so CPU-heavy pods go
    where CPU is plentiful and CPU-light ones fill CPU-poor nodes. Opening an idle node earns
    no such credit while idle nodes of its size hold fewer GPUs than `whole_node_weight` x
    the recent demand share of pods asking for that many GPUs x the cluster's free GPUs:
    those pods need whole nodes. A scarce GPU model (pods accepting only it ask at least
    `scarce_ratio` of its share of the cluster's GPUs) is kept for them: while its free GPUs
    are fewer than `model_weight` x their demand share x the free GPUs, pods that accept
    any model lose `model_penalty` there. Without a known CPU capacity (the Node's allocatable
    or the agent's hint) and without model-restricted pods this is binpack exactly. Pods
    without GPUs are scored by `cpu_pod_score`: where their CPU strands the fewest GPUs.
    Measured on the openb trace with `vgpu simulate`: docs/simulate.md.
    """

    name = "hostpack"
    absolute = False  # scores can be negative: relative_scores
    relative = True  # to_scores is relative_scores: the core may score arrays

    def __init__(
        self,
        cpu_per_gpu_milli: int = 13000,
        starved_cpu_per_gpu_milli: int = 8000,
        weight: float = 10.0,
        min_share: float = 0.2,
        whole_node_weight: float = 2.0,
        model_weight: float = 2.0,
        scarce_ratio: float = 0.5,
        model_penalty: float = 1.0,
        reserve_weight: float = 0.05,
    ) -> None:
        self.cpu_per_gpu_milli = cpu_per_gpu_milli  # openb GPU pods: median 11,400, mean 12,070
        self.starved_cpu_per_gpu_milli = starved_cpu_per_gpu_milli
        self.weight = weight
        self.min_share = min_share
        self.whole_node_weight = whole_node_weight
        self.model_weight = model_weight
        self.scarce_ratio = scarce_ratio
        self.model_penalty = model_penalty
        # Below the smallest stranding term that matters (100m on a short node: 0.077).
        self.reserve_weight = reserve_weight
        self._reserved: tuple[ScoreContext, frozenset[str]] | None = None

    def usable(self, key: tuple[object, ...]) -> float:
        share = free_share(key)
        return share if share >= self.min_share else 0.0

    def stranded(self, usable_gpus: float, free_cpu_milli: int) -> float:
        short = max(0.0, usable_gpus - free_cpu_milli / self.cpu_per_gpu_milli)
        if free_cpu_milli < usable_gpus * self.starved_cpu_per_gpu_milli:
            short += usable_gpus  # so little CPU per GPU that few pods could use any of them
        return short

    # node_score (binpack's, GPU state only) is cached per node and pod shape; the CPU and
    # model parts depend on the pod's CPU and the cluster, which the cache key leaves out, so
    # the core adds host_score uncached (PlacementCore._scorer), reading what host_view
    # cached with the fit.
    def host_view(self, trial: Trial) -> tuple[float, float, bool]:
        """The node's usable free GPUs before and after the pod, and whether it was idle."""
        before = after = 0.0
        idle = True
        for gpu in trial.node.gpus:
            share = self.usable(gpu.state_key())
            before += share
            after += self.usable(trial.key(gpu)) if gpu.uuid in trial.extra else share
            idle = idle and not gpu.used.slots
        return before, after, idle

    @staticmethod
    def whole_node_share(ctx: ScoreContext, size: int) -> float:
        """The recent GPU demand share of the pods that need an idle node of `size` GPUs:
        those asking more than half of it (bigger ones cannot use it, smaller ones fit half
        of a bigger node: 8-GPU pods keep 8-GPU nodes idle, not 4-GPU ones)."""
        mix = ctx.mix
        return mix.gpu_share_at_least(size // 2 + 1) - mix.gpu_share_at_least(size + 1)

    def host_score(
        self, ctx: ScoreContext, node: NodeState, view: tuple[float, float, bool], pod: PodRequest
    ) -> float:
        score = 0.0
        if (
            ctx.model_shares  # only while pods restricted to some models are in the mix
            and self.model_weight
            and not pod.selection.use_types
            and len(node.models) == 1
            and node.models[0] in self._reserved_models(ctx)
        ):
            score -= self.model_penalty  # keep it for the pods that can only go there
        if not node.cpu_milli:
            return score
        before, after, idle = view
        cpu = node.cpu_milli - node.used_cpu_milli
        stranded_before = self.stranded(before, cpu)
        if idle and self.whole_node_weight and ctx.cluster is not None:
            # Idle nodes are what whole-node pods need: keep as many GPUs on idle nodes as
            # whole-node pods are expected to ask of the free GPUs; below that, opening an
            # idle node earns nothing for the CPU it would feed.
            size = len(node.gpus)
            whole = self.whole_node_share(ctx, size) * ctx.cluster.free_gpus
            if (ctx.cluster.idle_nodes.get(size, 0) - 1) * size < self.whole_node_weight * whole:
                stranded_before = 0.0
        growth = self.stranded(after, cpu - pod.cpu_milli) - stranded_before
        return score - self.weight * growth

    def host_scores(
        self, ctx: ScoreContext, table: NodeTable, rows: np.ndarray, views: np.ndarray,
        pod: PodRequest,
    ) -> np.ndarray:  # fmt: skip
        """host_score of many nodes at once: the table's `rows`, with their host views as
        rows of `views`. The same arithmetic in the same order, so every score is equal to
        host_score's to the last bit (tests/allocator/test_placement_scan.py)."""
        score = np.zeros(len(rows))
        if (
            ctx.model_shares
            and self.model_weight
            and not pod.selection.use_types
            and (reserved := self._reserved_models(ctx))
        ):
            score[table.model_in(rows, reserved)] -= self.model_penalty
        total = table.cpu_milli[rows]
        cpu = total - table.used_cpu_milli[rows]
        before, after, idle = views[:, 0], views[:, 1], views[:, 2] != 0
        stranded_before = self.stranded_many(before, cpu)
        if self.whole_node_weight and ctx.cluster is not None and idle.any():
            # host_score's test of whether opening an idle node earns nothing, per size.
            sizes = table.gpu_count[rows]
            opens_free = np.zeros(int(sizes.max()) + 1, dtype=bool)
            for size in range(len(opens_free)):
                whole = self.whole_node_share(ctx, size) * ctx.cluster.free_gpus
                idle_nodes = ctx.cluster.idle_nodes.get(size, 0)
                opens_free[size] = (idle_nodes - 1) * size < self.whole_node_weight * whole
            stranded_before[idle & opens_free[sizes]] = 0.0
        growth = self.stranded_many(after, cpu - pod.cpu_milli) - stranded_before
        return np.where(total != 0, score - self.weight * growth, score)

    def stranded_many(self, usable: np.ndarray, free_cpu_milli: np.ndarray) -> np.ndarray:
        """stranded() of arrays, to the last bit."""
        short = np.maximum(0.0, usable - free_cpu_milli / self.cpu_per_gpu_milli)
        starved = free_cpu_milli < usable * self.starved_cpu_per_gpu_milli
        return np.where(starved, short + usable, short)

    def cpu_pod_score(self, node: NodeState, pod: PodRequest) -> float:
        """A pod without GPUs: minus `weight` x how much its CPU grows the node's stranded
        GPUs, minus `reserve_weight` x the share of the node's free CPU left after it that
        its usable free GPUs need (`cpu_per_gpu_milli` each). 0, the best, where the node
        has no free GPUs, no GPUs at all or states no CPU. The second term only orders nodes
        the first finds alike: CPU-only pods go where CPU is most plentiful beside the free
        GPUs (a 2-GPU T4 node with 104 cores before an idle 8-GPU node with 128, whose CPU
        8-GPU pods asking 120 cores need)."""
        return self.cpu_pod_scores(pod, [node])[node.name]

    def reserve_share(self, usable_gpus: float, free_cpu_milli: int) -> float:
        """The share of `free_cpu_milli` that `usable_gpus` free GPUs need (at most 1)."""
        if not usable_gpus:
            return 0.0
        need = usable_gpus * self.cpu_per_gpu_milli
        return 1.0 if free_cpu_milli <= need else need / free_cpu_milli

    def cpu_pod_scores(self, pod: PodRequest, nodes: Iterable[NodeState]) -> dict[str, float]:
        """cpu_pod_score of each node, in one pass (prioritize sends thousands of nodes):
        nodes alike in usable free GPUs and free CPU share one computation."""
        need = pod.cpu_milli
        memo: dict[tuple[float, int], float] = {}
        scores: dict[str, float] = {}
        for node in nodes:
            total = node.cpu_milli
            if not total or not node.gpus:
                scores[node.name] = 0.0
                continue
            cached = node.cache.get(_USABLE_KEY)
            if cached is None or cached[0] != node.version:
                cached = (node.version, sum(self.usable(g.state_key()) for g in node.gpus))
                node.cache[_USABLE_KEY] = cached
            key = (cached[1], total - node.used_cpu_milli)  # type: ignore[index]
            value = memo.get(key)
            if value is None:
                usable, cpu = key
                growth = self.stranded(usable, cpu - need) - self.stranded(usable, cpu)
                value = memo[key] = -self.weight * round(
                    growth, 9
                ) - self.reserve_weight * self.reserve_share(usable, cpu - need)
            scores[node.name] = value
        return scores

    def usable_gpus(self, node: NodeState) -> float:
        """The node's usable free GPUs (memoised per node version: GPU state only)."""
        cached = node.cache.get(_USABLE_KEY)
        if cached is None or cached[0] != node.version:
            cached = (node.version, sum(self.usable(g.state_key()) for g in node.gpus))
            node.cache[_USABLE_KEY] = cached
        return cached[1]  # type: ignore[no-any-return]

    def _reserved_models(self, ctx: ScoreContext) -> frozenset[str]:
        """Scarce GPU models kept for the pods that accept only them (memoised per call)."""
        memo = self._reserved
        if memo is not None and memo[0] is ctx:
            return memo[1]
        reserved: set[str] = set()
        cluster = ctx.cluster
        if cluster is not None and ctx.model_shares:
            capacity = sum(cluster.gpus_by_model.values()) or 1
            expected = dict.fromkeys(cluster.gpus_by_model, 0.0)
            for accepted, share in ctx.model_shares.items():
                allowed = [m for m in expected if any(t in m.lower() for t in accepted)]
                for model in allowed:
                    expected[model] += share / len(allowed)
            for model, share in expected.items():
                scarce = share >= self.scarce_ratio * cluster.gpus_by_model[model] / capacity
                short = cluster.free_by_model[model] < self.model_weight * share * cluster.free_gpus
                if share and scarce and short:
                    reserved.add(model)
        self._reserved = (ctx, frozenset(reserved))
        return self._reserved[1]

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return relative_scores(raw)


POLICIES: dict[str, Policy] = {
    p.name: p for p in (Binpack(), Spread(), Topology(), Fgd(), HostPack())
}
