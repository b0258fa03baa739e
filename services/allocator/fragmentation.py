"""GPU fragmentation, as in FGD (Weng et al., "Beware of Fragmentation", USENIX ATC'23).

The recent mix of request shapes says what the cluster will be asked next. A GPU's free share
is a *fragment* for a shape when that shape cannot use it: the GPU cannot host one slice of
the shape, or its node cannot host the shape at all. A node's fragmentation is the expected
fragment over the mix:

    F(n) = sum_t p_t * sum_g f_g * [node n cannot host t  or  GPU g cannot host a slice of t]

with f_g = min(free memory share, free compute share) of GPU g (0 for an unhealthy GPU).
FGD places a pod where F grows least. Computing F is cheap: whether a GPU hosts each shape
depends only on the GPU's model, size and free amounts, so it is memoised per snapshot of the
mix as a bitmask, and F is a few integer operations per GPU.

Host CPU and memory are left out of the shapes on purpose: kube-scheduler owns them, and the
extender sees GPU pods only.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.common.schemas import ContainerRequest

FULL_COMPUTE = 100
GpuKey = tuple[object, ...]  # GpuState.state_key(): model, base MiB, free MiB, cores, slots, ok


@dataclass(frozen=True)
class Shape:
    """A request shape: what one container asks of each of its GPUs, and how many GPUs."""

    gpus: int
    memory_mib: int = 0
    memory_percent: int = 0
    cores: int = 0

    @classmethod
    def of(cls, request: ContainerRequest) -> Shape:
        return cls(request.gpus, request.memory_mib, request.memory_percent, request.cores)

    def memory_on(self, base_memory_mib: int) -> int:
        if self.memory_mib:
            return self.memory_mib
        if self.memory_percent:
            return base_memory_mib * self.memory_percent // 100
        return base_memory_mib


def free_share(key: GpuKey) -> float:
    _, base, free_memory, free_cores, _, healthy = key
    if not healthy or not base:
        return 0.0
    return max(0.0, min(1.0, free_memory / base, free_cores / FULL_COMPUTE))  # type: ignore[operator]


@dataclass(eq=False)
class MixSnapshot:
    """The mix at one moment: shapes and their probabilities, plus memoised GPU profiles."""

    version: int
    shapes: tuple[Shape, ...]
    probs: tuple[float, ...]
    _profiles: dict[GpuKey, tuple[int, float, float]] = field(default_factory=dict)
    _at_least: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pairs = list(enumerate(zip(self.shapes, self.probs, strict=True)))
        self.multi = [(bit, s.gpus, p) for bit, (s, p) in pairs if s.gpus > 1]
        self.single_bits = sum(1 << b for b, s in enumerate(self.shapes) if s.gpus == 1)

    def gpu_share_at_least(self, gpus: int) -> float:
        """The share of the GPU demand that asks for at least `gpus` GPUs per container
        (a share of one GPU counts as that fraction of a GPU)."""
        found = self._at_least.get(gpus)
        if found is None:
            demand = [
                p * s.gpus * (s.cores / FULL_COMPUTE if s.gpus == 1 and s.cores else 1)
                for s, p in zip(self.shapes, self.probs, strict=True)
            ]
            total = sum(demand)
            large = sum(d for s, d in zip(self.shapes, demand, strict=True) if s.gpus >= gpus)
            found = self._at_least[gpus] = large / total if total else 0.0
        return found

    def profile(self, key: GpuKey) -> tuple[int, float, float]:
        """(mask of shapes this GPU can host one slice of, free share, weight of the others)."""
        found = self._profiles.get(key)
        if found is not None:
            return found
        _, base, free_memory, free_cores, free_slots, healthy = key
        mask = 0
        unhosted = 0.0
        for bit, (shape, p) in enumerate(zip(self.shapes, self.probs, strict=True)):
            fits = (
                healthy
                and free_slots > 0  # type: ignore[operator]
                and free_memory >= shape.memory_on(base)  # type: ignore[arg-type, operator]
                and free_cores >= shape.cores  # type: ignore[operator]
            )
            if fits:
                mask |= 1 << bit
            else:
                unhosted += p
        if len(self._profiles) > 100_000:
            self._profiles.clear()
        found = (mask, free_share(key), unhosted)
        self._profiles[key] = found
        return found

    def fragmentation(self, keys: Sequence[GpuKey]) -> float:
        """F of a node whose GPUs are in the states `keys` (in GPUs' worth of free share)."""
        return self.frag_of([self.profile(k) for k in keys])

    def frag_of(self, profiles: Sequence[tuple[int, float, float]]) -> float:
        """F from the GPUs' profiles (see `profile`)."""
        if not self.shapes:
            return 0.0
        total = 0.0
        for _, share, unhosted in profiles:
            total += share * unhosted
        # Shapes the node cannot host at all make every free share a fragment for them. For
        # one-GPU shapes no GPU hosts them, so the GPUs that do are none: nothing to add.
        for bit, need, p in self.multi:
            hosting = [share for mask, share, _ in profiles if mask >> bit & 1]
            if len(hosting) < need:
                total += p * sum(hosting)
        return total


class WorkloadMix:
    """The recent request shapes, in a sliding window; snapshots change only when it moves.

    A new snapshot (and so new cached scores) is taken every `refresh_every` observations, and
    only when the top shapes' probabilities moved by more than `min_change` (L1), so a steady
    workload keeps its caches warm.
    """

    def __init__(
        self,
        window: int = 2000,
        top: int = 32,
        refresh_every: int = 100,
        min_change: float = 0.05,
        seed: Iterable[Shape] = (),
    ) -> None:
        self._window: deque[Shape] = deque(maxlen=window)
        self._counts: Counter[Shape] = Counter()
        self._top = top
        self._refresh_every = refresh_every
        self._min_change = min_change
        self._since_refresh = 0
        self._snapshot = MixSnapshot(version=0, shapes=(), probs=())
        # GPU demand by the models pods accept (() = any), over the same window.
        self._accepted: deque[tuple[tuple[str, ...], float]] = deque(maxlen=window)
        self._accepted_demand: Counter[tuple[str, ...]] = Counter()
        self._model_shares: dict[tuple[str, ...], float] | None = {}
        # Moves with every observation: scores that read the mix are reused only while
        # it stands still (core.py, the filter's scan reused by prioritize).
        self.generation = 0
        self.observe(seed)
        self._refresh(force=True)

    def observe(self, shapes: Iterable[Shape]) -> None:
        self.generation += 1
        for shape in shapes:
            if len(self._window) == self._window.maxlen:
                old = self._window[0]
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]
            self._window.append(shape)
            self._counts[shape] += 1
            self._since_refresh += 1
        if self._since_refresh >= self._refresh_every or not self._snapshot.shapes:
            self._refresh()

    def observe_models(self, accepted: tuple[str, ...], gpus: float) -> None:
        """One pod's GPU demand and the GPU models it accepts (() = any model)."""
        self.generation += 1
        if len(self._accepted) == self._accepted.maxlen:
            old, demand = self._accepted[0]
            self._accepted_demand[old] -= demand
            if self._accepted_demand[old] <= 1e-9:
                del self._accepted_demand[old]
        self._accepted.append((accepted, gpus))
        self._accepted_demand[accepted] += gpus
        self._model_shares = None

    def model_shares(self) -> dict[tuple[str, ...], float]:
        """Share of the recent GPU demand that accepts only the given models, per set of
        accepted models (model substrings, as nvidia.com/use-gputype gives them)."""
        if self._model_shares is None:
            total = sum(self._accepted_demand.values())
            self._model_shares = {
                accepted: demand / total
                for accepted, demand in self._accepted_demand.items()
                if accepted and total > 0
            }
        return self._model_shares

    def _refresh(self, force: bool = False) -> None:
        self._since_refresh = 0
        common = self._counts.most_common(self._top)
        total = sum(count for _, count in common)
        if not total:
            return
        shapes = tuple(shape for shape, _ in common)
        probs = tuple(count / total for _, count in common)
        old = dict(zip(self._snapshot.shapes, self._snapshot.probs, strict=True))
        change = sum(abs(old.get(s, 0.0) - p) for s, p in zip(shapes, probs, strict=True))
        change += sum(p for s, p in old.items() if s not in set(shapes))
        if force or not old or change > self._min_change:
            self._snapshot = MixSnapshot(self._snapshot.version + 1, shapes, probs)

    def snapshot(self) -> MixSnapshot:
        return self._snapshot

    def __len__(self) -> int:
        return len(self._window)


def expected_increase(before: float, after: float) -> float:
    """Guard against float noise so equal placements tie exactly."""
    delta = after - before
    return 0.0 if math.isclose(delta, 0.0, abs_tol=1e-12) else delta
