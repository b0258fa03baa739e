"""The paper's baseline policies as PlacementCore plug-ins (Weng et al., ATC'23, section 6.1).

Each is a `services.allocator.policies.Policy`: it ranks GPU sets inside a node
(`gpu_score`) and nodes (`node_score`, with the pod placed in `trial`); higher is better, fit
is the engine's. Resources are normalised as in the paper's simulator: CPU by
`MAX_CPU_MILLI`, GPUs by `MAX_GPUS` (the largest node specs of the openb cluster).

- random: any GPU set, any node (seeded).
- firstfit: the first node (by name) and the lowest-numbered GPUs that fit.
- bestfit: the node with the least CPU and GPU left after placing (weights 0.5 / 0.5), and
  the fullest GPUs.
- dotprod (Tetris): the node whose free (CPU, GPU) vector has the smallest dot product with
  the pod's request, both normalised by the node's capacity; the GPU with least free share.
- gpupacking: shared GPUs first (least free), then idle GPUs on a used node (fewest), then an
  idle node (smallest).
- gpuclustering: nodes already running pods of the same GPU request type first (only that type
  beats a mix), then idle nodes, then nodes of other types; fuller nodes first inside a class.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from services.allocator.cluster import Charge, GpuState, NodeState
from services.allocator.fragmentation import free_share
from services.allocator.ledger import Ledger
from services.allocator.pod_request import PodRequest
from services.allocator.policies import Policy, ScoreContext, Trial, relative_scores

MAX_CPU_MILLI = 128_000
MAX_GPUS = 8


def _free_before(trial: Trial, gpu: GpuState) -> float:
    """The GPU's free share (min of memory and compute) before the pod."""
    return free_share(Trial(trial.node, empty=trial.empty).key(gpu))


def _free_after(trial: Trial, gpu: GpuState) -> float:
    return free_share(trial.key(gpu))


def _node_gpus_free(trial: Trial, after: bool) -> float:
    """The node's free GPUs (sum of free shares), before or after the pod."""
    pick = _free_after if after else _free_before
    return sum(pick(trial, g) for g in trial.node.gpus)


def _pod_gpus(pod: PodRequest) -> float:
    """GPUs the pod asks, counting a share as a fraction (the paper's GPU demand)."""
    total = 0.0
    for request in pod.app:
        share = request.cores / 100 if 0 < request.cores < 100 else 1.0
        total += request.gpus * share
    return total


def _cpu_free(node: NodeState, extra: int = 0) -> int:
    return node.cpu_milli - node.used_cpu_milli - extra


class _Relative:
    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return relative_scores(raw)


class RandomFit(_Relative):
    name = "random"

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def gpu_score(self, ctx: ScoreContext, trial: Trial, gpus: Sequence[GpuState],
                  adds: Sequence[Charge]) -> float:  # fmt: skip
        return self._random.random()

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        return self._random.random()


class FirstFit(_Relative):
    name = "firstfit"

    def gpu_score(self, ctx: ScoreContext, trial: Trial, gpus: Sequence[GpuState],
                  adds: Sequence[Charge]) -> float:  # fmt: skip
        return -float(sum(g.index for g in gpus))

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        return 0.0  # every node ties: best_node takes the first by name


class _TightestGpus(_Relative):
    """GPU level shared by bestfit, dotprod, gpupacking, gpuclustering: least free GPUs."""

    def gpu_score(self, ctx: ScoreContext, trial: Trial, gpus: Sequence[GpuState],
                  adds: Sequence[Charge]) -> float:  # fmt: skip
        return -sum(_free_before(trial, g) for g in gpus)


class BestFit(_TightestGpus):
    name = "bestfit"

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        cpu_left = _cpu_free(trial.node, pod.cpu_milli) / MAX_CPU_MILLI
        gpu_left = _node_gpus_free(trial, after=True) / MAX_GPUS
        return -(0.5 * cpu_left + 0.5 * gpu_left)


class DotProd(_TightestGpus):
    name = "dotprod"

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        node = trial.node
        cpu = node.cpu_milli or MAX_CPU_MILLI
        gpus = len(node.gpus) or 1
        free = (_cpu_free(node) / cpu, _node_gpus_free(trial, after=False) / gpus)
        asked = (pod.cpu_milli / cpu, _pod_gpus(pod) / gpus)
        return -(free[0] * asked[0] + free[1] * asked[1]) / 2


class GpuPacking(_TightestGpus):
    name = "gpupacking"

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        gpus = trial.node.gpus
        before = [_free_before(trial, g) for g in gpus]
        idle = sum(share >= 1.0 for share in before)
        if idle == len(gpus):
            return 1.0 / (1 + idle)  # an idle node: the smallest first
        touched = [i for i, g in enumerate(gpus) if g.uuid in trial.extra]
        idle_used = sum(before[i] >= 1.0 for i in touched)
        if idle_used:
            return 1.0 + 1.0 / (1 + idle_used)  # idle GPUs on a used node: fewest first
        left = sum(before[i] for i in touched) / max(1, len(touched))
        return 2.0 + (1.0 - left)  # shared GPUs only: the least free first


class GpuClustering(_TightestGpus):
    name = "gpuclustering"

    def __init__(self, ledger: Ledger | None) -> None:
        self._ledger = ledger

    @staticmethod
    def kind(gpus: int, cores: int) -> tuple[int, int]:
        """A pod's GPU request type: how many GPUs and which share of each."""
        return (gpus, cores if 0 < cores < 100 else 100)

    def _kinds_on(self, node: str) -> set[tuple[int, int]]:
        kinds = set()
        for allocation in self._ledger.on_node(node) if self._ledger else ():
            for container in allocation.containers.values():
                if container.slices and not container.init:
                    kinds.add(self.kind(len(container.slices), container.slices[0].cores))
        return kinds

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        fullness = 1.0 - _node_gpus_free(trial, after=False) / MAX_GPUS
        kinds = self._kinds_on(trial.node.name)
        mine = {self.kind(r.gpus, r.cores) for r in pod.app}
        if kinds and mine <= kinds:
            return (3.0 if len(kinds) == 1 else 2.0) + fullness
        return (1.0 if not kinds else 0.0) + fullness


def baseline_policies(seed: int, ledger: Ledger | None = None) -> dict[str, Policy]:
    """Fresh baseline plug-ins for one replay (random is seeded; clustering reads `ledger`)."""
    policies: list[Policy] = [
        RandomFit(seed), FirstFit(), BestFit(), DotProd(), GpuPacking(), GpuClustering(ledger),
    ]  # fmt: skip
    return {p.name: p for p in policies}
