"""The placement core: filter, prioritize and commit, synchronous and free of any wire format.

The extender, the simulator (`vgpu simulate`) and the benchmarks all drive this one class;
see docs/allocator.md ("Driving the engine without HTTP"). Results are cached per node and
pod shape, keyed by the node's version (which every change to the node bumps) and, for
policies that read the workload mix, by the mix snapshot: a bind invalidates one node only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.resources import DEFAULT_CONFIG, RequestConfig
from services.common.schemas import ContainerAllocation, PodAllocation

from .cluster import FULL_COMPUTE, ClusterState, NodeState
from .fragmentation import Shape, WorkloadMix
from .ledger import Ledger
from .modes import mode_refusals
from .node_table import NodeTable, ResultColumns
from .placement import NodePlacement, NoFit, describe_request, host_problem, need_text, place_pod
from .pod_request import NUMA_BIND, PodRequest, Selection, parse_pod
from .policies import (
    MAX_SCORE,
    POLICIES,
    Policy,
    ScoreContext,
    relative_scores,
    relative_scores_of,
)

DEFAULT_POLICY = "hostpack"  # measured best on the openb trace: docs/simulate.md
MIX_REFRESH_PER_CALL = 16  # cached scores refreshed per call after the mix moved
SHARED_RESULTS_LIMIT = 200_000  # results kept per node signature before starting afresh
RESULT_COLUMNS_LIMIT = 128  # pod shapes whose per-node results best_node keeps as columns
GROUP_FROM = 32  # stale nodes in one call from which they are evaluated once per signature


@dataclass
class FilterOutcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_ref(pod: Mapping[str, Any]) -> PodRef:
    metadata = pod.get("metadata") or {}
    return PodRef(
        namespace=metadata.get("namespace") or "default",
        name=metadata.get("name") or "",
        uid=metadata.get("uid") or "",
    )


@dataclass(frozen=True)
class _Unfit:
    node: str
    detail: str
    forever: bool  # even idle and healthy, this node could not hold it

    @property
    def reason(self) -> str:
        where = " can never hold it" if self.forever else ""
        return f"node {self.node!r}{where}: {self.detail}"


@dataclass(frozen=True)
class _Fit:
    placement: NodePlacement | None  # None: scored on an equivalent node; placed on demand
    raw_score: float
    score10: int  # absolute_scores of raw_score, for policies whose scores are absolute
    host_view: object = None  # what the node policy's host_score needs of the placement


@dataclass(frozen=True)
class _FilterScan:
    """What filter's scan found for a pod: prioritize asks about the same pod over exactly
    the nodes filter passed (kube-scheduler sends the extender's answer back, in order),
    and while nothing a score reads has changed its answer is this one."""

    pod: PodRequest
    passed: list[str]
    rows: np.ndarray  # node table rows of `passed`
    scores: np.ndarray  # their exact node-policy scores (_scan's)
    state: tuple[int, int, int]  # (_scan_state) when scanned


class Unplaceable(Exception):
    """The pod cannot be committed to that node; the message says why."""


class PlacementCore:
    def __init__(
        self,
        cluster: ClusterState,
        ledger: Ledger,
        *,
        node_policy: str = DEFAULT_POLICY,
        gpu_policy: str = DEFAULT_POLICY,
        request_config: RequestConfig = DEFAULT_CONFIG,
        mix: WorkloadMix | None = None,
        policies: Mapping[str, Policy] | None = None,
    ) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.policies = dict(policies or POLICIES)
        for name in (node_policy, gpu_policy):
            if name not in self.policies:
                raise ValueError(
                    f"unknown placement policy {name!r} (known: {', '.join(sorted(self.policies))})"
                )
        self.node_policy = node_policy
        self.gpu_policy = gpu_policy
        self.request_config = request_config
        self.mix = mix or WorkloadMix()
        self._never: dict[tuple[object, ...], str | None] = {}
        # Results by (pod shape, node signature): equivalent nodes are evaluated once.
        self._shared: dict[tuple[object, ...], tuple[int, _Fit | _Unfit]] = {}
        self._shape_ids: dict[tuple[object, ...], int] = {}
        self._next_shape_id = 0
        self._allows_all: dict[tuple[Selection, tuple[str, ...]], bool] = {}
        self._capacity: dict[tuple[object, ...], NoFit | None] = {}
        self._refresh_budget = MIX_REFRESH_PER_CALL
        # best_node's scan over every node: per cache key, each node's result (node_table.py).
        self._columns: OrderedDict[tuple[object, ...], ResultColumns] = OrderedDict()
        self._columns_layout = -1
        # Scoring verbs scan columns (False: node by node; the tests compare the two).
        self.scan_columns = True
        # Filter scans columns too, and prioritize reuses its scan (False: filter walks the
        # nodes one by one, as before; the tests and bench/allocator_extender.py compare).
        self.scan_filter = True
        self._filter_scan: _FilterScan | None = None
        self.filter_rescans = 0  # filters the scan could not explain (always 0: tests check)
        self.scans_reused = 0  # prioritize answers taken from filter's scan

    # -- requests -------------------------------------------------------------------------

    def parse(self, pod: Mapping[str, Any]) -> PodRequest:
        """The pod's request; RequestError naming what is malformed."""
        return parse_pod(pod, frozenset(self.policies), self.request_config)

    def observe(self, pod: PodRequest) -> None:
        """Count the pod's shapes in the recent workload mix (FGD's view of demand)."""
        self.mix.observe(Shape.of(r) for r in pod.app)
        gpus = sum(
            r.gpus * (r.cores / FULL_COMPUTE if r.gpus == 1 and r.cores > 0 else 1) for r in pod.app
        )
        self.mix.observe_models(pod.selection.use_types, gpus)

    def policies_of(self, pod: PodRequest) -> tuple[Policy, Policy]:
        return (
            self.policies[pod.node_policy or self.node_policy],
            self.policies[pod.gpu_policy or self.gpu_policy],
        )

    # -- per node -------------------------------------------------------------------------

    def _key(self, pod: PodRequest) -> tuple[int, str, str]:
        """The cache key of a pod's shape under its policies: computed once per call, cheap
        to hash once per node. The call's refresh budget is reset here too."""
        self._refresh_budget = MIX_REFRESH_PER_CALL
        self._call_mix_version = self._mix_version(pod)
        names = tuple(p.name for p in self.policies_of(pod))
        selection = pod.selection
        # On a node whose every GPU the pod's model selection allows, it places exactly as
        # the same pod without a selection: such nodes share that pod's results.
        self._call_open_key = (
            (self._shape_id((pod.containers, Selection(), *pod.shape[2:])), *names)
            if (selection.use_types or selection.nouse_types)
            and not (selection.use_uuids or selection.nouse_uuids)
            else None
        )
        return (self._shape_id(pod.shape), *names)  # type: ignore[return-value]

    def _shape_id(self, shape: tuple[object, ...]) -> int:
        shape_id = self._shape_ids.get(shape)
        if shape_id is None:
            if len(self._shape_ids) > 100_000:
                self._shape_ids.clear()  # ids keep counting up: old cache entries never match
            shape_id = self._shape_ids[shape] = self._next_shape_id
            self._next_shape_id += 1
        return shape_id

    def _mix_version(self, pod: PodRequest) -> int:
        if any(getattr(p, "uses_mix", False) for p in self.policies_of(pod)):
            return self.mix.snapshot().version
        return 0

    def _evaluate(
        self, node: NodeState, pod: PodRequest, key: tuple[int, str, str] | None = None
    ) -> _Fit | _Unfit:
        """Fit and score of the pod on one node, cached until the node changes.

        When the workload mix moves, cached scores of unchanged nodes stay in use and are
        refreshed a few per call (fit itself never depends on the mix), so a new mix never
        makes one call recompute the whole cluster."""
        if (
            (pod.cpu_milli and node.cpu_milli)
            or (pod.memory_mib and node.host_memory_mib)
            or node.max_pods
        ):
            problem = host_problem(node, pod)
            if problem is not None:
                forever = host_problem(node, pod, empty=True) is not None
                return _Unfit(node.name, problem, forever)
        if key is None:
            key = self._key(pod)
        mix_version = self._call_mix_version
        cached: Any = node.cache.get(key)
        if cached is not None and cached[0] == node.version:
            if cached[1] == mix_version or isinstance(cached[2], _Unfit):
                return cached[2]  # type: ignore[no-any-return]
            if self._refresh_budget <= 0:
                return cached[2]  # type: ignore[no-any-return]
            self._refresh_budget -= 1
        node_policy, gpu_policy = self.policies_of(pod)
        shared_key: tuple[object, ...] | None = None
        if (
            getattr(node_policy, "gpu_state_only", False)
            and getattr(gpu_policy, "gpu_state_only", False)
            and not (pod.selection.use_uuids or pod.selection.nouse_uuids)
        ):
            open_key = self._call_open_key
            if open_key is not None and self._allows_every_gpu(pod.selection, node):
                shared_key = (open_key, node.signature())
            else:
                shared_key = (key, node.signature())
            shared = self._shared.get(shared_key)
            if shared is not None and (shared[0] == mix_version or type(shared[1]) is _Unfit):
                result = shared[1]
                if type(result) is _Unfit:
                    result = dataclasses.replace(result, node=node.name)
                node.cache[key] = (node.version, mix_version, result)
                return result
        result = self._place_and_score(node, pod, node_policy, gpu_policy)
        node.cache[key] = (node.version, mix_version, result)
        if shared_key is not None:
            if len(self._shared) > SHARED_RESULTS_LIMIT:
                self._shared.clear()
            # Fits are shared without the placement: it names this node's GPUs.
            shared_result = (
                result if type(result) is _Unfit else dataclasses.replace(result, placement=None)
            )
            self._shared[shared_key] = (mix_version, shared_result)
        return result

    def _allows_every_gpu(self, selection: Selection, node: NodeState) -> bool:
        memo_key = (selection, node.models)
        allowed = self._allows_all.get(memo_key)
        if allowed is None:
            if len(self._allows_all) > 10_000:
                self._allows_all.clear()
            allowed = all(selection.allows_model(m) for m in node.models)
            self._allows_all[memo_key] = allowed
        return allowed

    def _place_and_score(
        self, node: NodeState, pod: PodRequest, node_policy: Policy, gpu_policy: Policy
    ) -> _Fit | _Unfit:
        ctx = ScoreContext(self.mix.snapshot())
        try:
            placement = place_pod(node, pod, gpu_policy, ctx)
        except NoFit as exc:
            problem = self._capacity_problem(node, pod)
            if problem is not None:
                return _Unfit(node.name, str(problem), True)
            return _Unfit(node.name, str(exc), False)
        raw = node_policy.node_score(ctx, placement.trial, pod)
        host_view = getattr(node_policy, "host_view", None)
        return _Fit(
            placement,
            raw,
            max(0, min(MAX_SCORE, round(MAX_SCORE * raw))),
            None if host_view is None else host_view(placement.trial),
        )

    def _capacity_problem(self, node: NodeState, pod: PodRequest) -> NoFit | None:
        """Why the pod could never fit the node, even idle and healthy (None: it could)."""
        by_uuid = pod.selection.use_uuids or pod.selection.nouse_uuids
        memo_key = (pod.shape, node.capacity_signature, tuple(node.positions) if by_uuid else ())
        if memo_key in self._capacity:
            return self._capacity[memo_key]
        problem = None
        try:
            place_pod(node, pod, self.policies["binpack"], ScoreContext(self.mix.snapshot()), True)
        except NoFit as exc:
            problem = exc
        if len(self._capacity) > 100_000:
            self._capacity.clear()
        self._capacity[memo_key] = problem
        return problem

    def _scorer(self, pod: PodRequest) -> Callable[[_Fit, NodeState], float]:
        """The node policy's exact score of a fit: the cached raw score, plus the uncached
        host part of policies that have one (it depends on the pod's CPU, which cache keys
        leave out)."""
        host_score = getattr(self.policies_of(pod)[0], "host_score", None)
        if host_score is None:
            return lambda fit, node: fit.raw_score
        ctx = ScoreContext(self.mix.snapshot(), self.cluster, self.mix.model_shares())
        return lambda fit, node: fit.raw_score + host_score(ctx, node, fit.host_view, pod)

    def placement(self, pod: PodRequest, node_name: str) -> NodePlacement:
        """Where the pod's slices would go on `node_name` now; Unplaceable when they can't."""
        status = self.cluster.status(node_name)
        node = self.cluster.node(node_name)
        if not status.available or node is None:
            raise Unplaceable(status.reason)
        result = self._evaluate(node, pod)
        if isinstance(result, _Unfit):
            raise Unplaceable(result.reason)
        if result.placement is None:  # scored on an equivalent node: place it on this one
            # (the score is known; what is placed next changes the node, so nothing to cache)
            gpu_policy = self.policies_of(pod)[1]
            return place_pod(node, pod, gpu_policy, ScoreContext(self.mix.snapshot()))
        return result.placement

    # -- cluster-wide ---------------------------------------------------------------------

    def never_fits(self, pod: PodRequest) -> str | None:
        """A reason when no known node could ever hold the pod; None when one could."""
        key = (pod.shape, pod.cpu_milli, pod.memory_mib, self.cluster.capacity_version)
        if key in self._never:
            return self._never[key]
        reason = self._never_fits(pod)
        if len(self._never) > 4096:
            self._never.clear()
        self._never[key] = reason
        return reason

    def _never_fits(self, pod: PodRequest) -> str | None:
        states = list(self.cluster.states())
        if not states or not pod.containers:
            return None
        by_uuid = pod.selection.use_uuids or pod.selection.nouse_uuids
        # Without UUIDs in the selection, a node's identity does not matter: one of each kind.
        candidates = states if by_uuid else self.cluster.capacity_classes()

        def fits_somewhere(candidate: PodRequest) -> bool:
            return any(
                host_problem(node, candidate, empty=True) is None
                and self._capacity_problem(node, candidate) is None
                for node in candidates
            )

        selection = pod.selection.describe()
        allowed = f" allowed by {selection}" if selection else ""
        for request in pod.containers:
            alone = PodRequest(
                containers=(request,), selection=pod.selection, numa_bind=pod.numa_bind
            )
            if not fits_somewhere(alone):
                numa = (
                    f" on one NUMA node ({NUMA_BIND})" if pod.numa_bind and request.gpus > 1 else ""
                )
                largest = max((g.memory_mib for n in states for g in n.gpus), default=0)
                most = max(len(n.gpus) for n in states)
                return (
                    f"container {request.container!r} ({describe_request(request)}) can never "
                    f"fit: no node in the cluster has {need_text(request)}{numa}{allowed} "
                    f"(largest GPU: {largest} MiB, most GPUs on one node: {most})"
                    f"{mode_refusals(request, states)}"
                )
        if (pod.cpu_milli or pod.memory_mib) and not fits_somewhere(pod):
            gpu_only = dataclasses.replace(pod, cpu_milli=0, memory_mib=0)
            if fits_somewhere(gpu_only):
                cpu = max((n.cpu_milli for n in states), default=0)
                memory = max((n.host_memory_mib for n in states), default=0)
                return (
                    f"the pod needs {pod.cpu_milli}m CPU and {pod.memory_mib} MiB of memory "
                    f"beside its GPUs; no node with room for its GPUs has that much (largest "
                    f"node: {cpu}m CPU, {memory} MiB)"
                )
        if not fits_somewhere(pod):
            names = ", ".join(repr(r.container) for r in pod.containers)
            return (
                f"containers {names} can never fit together: no node in the cluster has room "
                f"for all of them at once{allowed}"
            )
        return None

    # -- the verbs ------------------------------------------------------------------------

    def _results(
        self,
        pod: PodRequest,
        names: Iterable[str],
        reasons: bool = True,
        refresh: int = MIX_REFRESH_PER_CALL,
    ) -> Iterator[tuple[str, NodeState | None, _Fit | _Unfit | None]]:
        """Each named node with the pod's fit and score there (None: unknown or silent node),
        from the node's cache while it has not changed: the hot path of every verb. Without
        `reasons`, nodes short of CPU or memory are skipped instead of explained."""
        key = self._key(pod)
        self._refresh_budget = refresh
        mix_version = self._call_mix_version
        cpu, memory = pod.cpu_milli, pod.memory_mib
        fresh_since, get = self.cluster.fresh_since(), self.cluster.lookup()
        evaluate = self._evaluate
        # One container: it needs `gpus` GPUs with `cores` free each (a bound, not the fit).
        single = pod.containers[0] if len(pod.containers) == 1 and not reasons else None
        for name in names:
            node = get(name)
            if node is None or node.received_at < fresh_since:
                yield name, None, None
                continue
            if single is not None and single.gpus:
                room = node.free_cores()
                if len(room) < single.gpus or room[single.gpus - 1] < single.cores:
                    continue
            if (
                (cpu and node.cpu_milli and cpu > node.cpu_milli - node.used_cpu_milli)
                or (
                    memory
                    and node.host_memory_mib
                    and memory > node.host_memory_mib - node.used_memory_mib
                )
                or (node.max_pods and node.used_pods >= node.max_pods)
            ):
                if reasons:
                    yield name, node, evaluate(node, pod, key)
                continue
            cached: Any = node.cache.get(key)
            if cached is not None and cached[0] == node.version and cached[1] == mix_version:
                yield name, node, cached[2]
            else:
                yield name, node, evaluate(node, pod, key)

    def filter(self, pod: PodRequest, node_names: Iterable[str]) -> FilterOutcome:
        """Which nodes could take the pod now; reasons for the others."""
        names = list(dict.fromkeys(node_names))
        outcome = FilterOutcome()
        self._filter_scan = None
        if not pod.containers:
            outcome.passed = names  # no GPU asked: not ours to judge
            return outcome
        never = self.never_fits(pod)
        if never:
            outcome.unresolvable = dict.fromkeys(names, never)
            return outcome
        if self.scan_columns and self.scan_filter:
            scanned = self._filter_by_scan(pod, names)
            if scanned is not None:
                return scanned
            self.filter_rescans += 1
        return self._filter_node_by_node(pod, names, outcome)

    def _filter_by_scan(self, pod: PodRequest, names: list[str]) -> FilterOutcome | None:
        """filter as one scan of the node table (`_scan`, which evaluates stale nodes in the
        order given, as the loop does), then reasons for the nodes it did not pass, from
        their cached results. The same outcome, in the same order, as the loop; None if a
        node the scan ruled out fits after all (the loop then answers)."""
        fresh_since = self.cluster.fresh_since()
        table, taken, rows, scores = self._scan_taken(pod, MIX_REFRESH_PER_CALL, names, fresh_since)
        assert taken is not None
        if len(rows) == len(names):  # all passed
            outcome = FilterOutcome(passed=names)
        else:
            outcome = FilterOutcome(passed=list(itertools.compress(names, taken.tolist())))
            others = [names[i] for i in np.flatnonzero(~taken).tolist()]
            if not self._explain(pod, others, fresh_since, outcome):
                return None
        passed = outcome.passed
        key = self._key(pod)
        if self._columns[key].valid(table, self._call_mix_version)[rows].all():
            # Every score is current (a mix policy's may lag when the refresh budget ran out:
            # prioritize then refreshes more, as it always did): prioritize may reuse them.
            # A copy: the caller may add to its outcome (engine.filter adds a pod's own node).
            self._filter_scan = _FilterScan(pod, list(passed), rows, scores, self._scan_state())
        return outcome

    def _explain(
        self, pod: PodRequest, names: list[str], fresh_since: float, outcome: FilterOutcome
    ) -> bool:
        """The loop's reason for each of `names` (the scan did not pass them), in order,
        into `outcome`; False when one of them fits after all."""
        key = self._key(pod)
        status, get, evaluate = self.cluster.status, self.cluster.lookup(), self._evaluate
        for name in names:
            node = get(name)
            if node is None or node.received_at < fresh_since:
                outcome.failed[name] = status(name).reason
                continue
            result = evaluate(node, pod, key)
            if type(result) is _Fit:
                return False
            assert isinstance(result, _Unfit)
            if result.forever:
                outcome.unresolvable[name] = result.reason
            else:
                outcome.failed[name] = result.reason
        return True

    def _scan_state(self) -> tuple[int, int, int]:
        """What every score depends on besides the pod: the nodes, their usage, the mix."""
        cluster = self.cluster
        return (cluster.layout_version, cluster.generation, self.mix.generation)

    def _reused_scan(self, pod: PodRequest, names: list[str]) -> _FilterScan | None:
        """Filter's scan when `names` are the nodes it passed for this very request and
        nothing a score reads has changed since (all of them still fresh): what a new scan
        would find, without the scan."""
        scan = self._filter_scan
        if (
            scan is None
            or scan.state != self._scan_state()
            or scan.passed != names
            or scan.pod != pod
        ):
            return None
        table = self.cluster.table()
        if scan.rows.size and table.received_at[scan.rows].min() < self.cluster.fresh_since():
            return None
        self.scans_reused += 1
        return scan

    def _filter_node_by_node(
        self, pod: PodRequest, names: list[str], outcome: FilterOutcome
    ) -> FilterOutcome:
        status = self.cluster.status
        for name, _, result in self._results(pod, names):
            if result is None:
                outcome.failed[name] = status(name).reason
            elif type(result) is _Fit:
                outcome.passed.append(name)
            elif result.forever:
                outcome.unresolvable[name] = result.reason
            else:
                outcome.failed[name] = result.reason
        return outcome

    def raw_scores(self, pod: PodRequest, node_names: Iterable[str]) -> dict[str, float]:
        """The node policy's own scores (higher is better) of the nodes that can take the pod."""
        if not pod.containers:
            return {}
        if self.scan_columns:
            table, rows, scores = self._scan(
                pod, MIX_REFRESH_PER_CALL, list(dict.fromkeys(node_names))
            )
            names = table.names
            return dict(zip([names[r] for r in rows.tolist()], scores.tolist(), strict=True))
        score = self._scorer(pod)
        return {
            name: score(result, node)  # type: ignore[arg-type]
            for name, node, result in self._results(pod, dict.fromkeys(node_names), False)
            if type(result) is _Fit
        }

    def cpu_pod_scores(self, pod: PodRequest, node_names: Iterable[str]) -> dict[str, float]:
        """The node policy's host score (higher is better) of a pod without GPUs on each named
        node that has room for its CPU, memory and one more pod. A node vgpu has no inventory
        of has no GPUs to strand: 0, the best a host score gets. Policies without a host
        score rank every node alike (0)."""
        scores = getattr(self.policies_of(pod)[0], "cpu_pod_scores", None)
        get = self.cluster.lookup()
        cpu, memory = pod.cpu_milli, pod.memory_mib
        raw: dict[str, float] = {}
        fitting: list[NodeState] = []
        for name in node_names:
            node = get(name)
            if node is None:
                raw[name] = 0.0
            elif not (
                (node.max_pods and node.used_pods >= node.max_pods)
                or (cpu and node.cpu_milli and cpu > node.cpu_milli - node.used_cpu_milli)
                or (
                    memory
                    and node.host_memory_mib
                    and memory > node.host_memory_mib - node.used_memory_mib
                )
            ):  # host_problem, inlined: this runs for thousands of nodes per call
                fitting.append(node)
        if scores is None:
            raw.update((node.name, 0.0) for node in fitting)
        else:
            raw.update(scores(pod, fitting))
        return raw

    def prioritize(self, pod: PodRequest, node_names: Iterable[str]) -> dict[str, int]:
        """Scores 0..10 by the pod's node policy; 0 for nodes that cannot take it. Pods without
        GPUs get the host score (cpu_pod_scores): exactly the best nodes 10, others 0..9."""
        names = list(dict.fromkeys(node_names))
        node_policy, _ = self.policies_of(pod)
        if not pod.containers:
            scores = dict.fromkeys(names, 0)
            scores.update(relative_scores(self.cpu_pod_scores(pod, names)))
            return scores
        reused = self._reused_scan(pod, names) if self.scan_columns else None
        scores = {} if reused is not None else dict.fromkeys(names, 0)
        if not getattr(node_policy, "absolute", False) or not pod.containers:
            if reused is not None and getattr(node_policy, "relative", False):
                # Every name passed filter: all of them are scored, in order.
                return dict(zip(names, relative_scores_of(reused.scores).tolist(), strict=True))
            if self.scan_columns and getattr(node_policy, "relative", False):
                table, rows, raw = self._scan(pod, MIX_REFRESH_PER_CALL, names)
                found = [table.names[r] for r in rows.tolist()]
                scores.update(zip(found, relative_scores_of(raw).tolist(), strict=True))
                return scores
            scores.update(node_policy.to_scores(self.raw_scores(pod, names)))
            return scores
        # Absolute 0..10 scores are cached per node with the fit: one pass, no rescaling.
        if reused is not None:
            return dict(zip(names, self._score10(pod, reused.rows).tolist(), strict=True))
        if self.scan_columns:
            table, rows, _ = self._scan(pod, MIX_REFRESH_PER_CALL, names)
            found = [table.names[r] for r in rows.tolist()]
            scores.update(zip(found, self._score10(pod, rows).tolist(), strict=True))
            return scores
        for name, _, result in self._results(pod, names, False):
            if type(result) is _Fit:
                scores[name] = result.score10
        return scores

    def best_node(self, pod: PodRequest, node_names: Sequence[str] | None = None) -> str | None:
        """Filter over `node_names` (default: every node), then the best by the node policy's
        exact score, ties to the lowest name: what the simulator and benchmarks use. Through
        kube-scheduler the same ranking arrives quantised to 0..10 (see to_scores)."""
        names = self.cluster.nodes() if node_names is None else list(node_names)
        if not pod.containers:
            return self._best_cpu_node(pod, names)
        if self.never_fits(pod):
            return None
        if node_names is None and self.scan_columns:
            return self._best_of_all(pod)
        # One pass (filter + raw_scores would evaluate every passing node twice).
        # As filter + raw_scores would refresh.
        results = self._results(pod, dict.fromkeys(names), False, 2 * MIX_REFRESH_PER_CALL)
        score = self._scorer(pod)
        best_score, best_name = -math.inf, ""
        for name, node, result in results:
            if type(result) is _Fit:
                value = score(result, node)  # type: ignore[arg-type]
                if value > best_score or (value == best_score and name < best_name):
                    best_score, best_name = value, name
        return best_name or None

    def _best_of_all(self, pod: PodRequest) -> str | None:
        """best_node over every node, as a scan of the node table (`_scan`)."""
        # As filter + raw_scores would refresh.
        table, rows, scores = self._scan(pod, 2 * MIX_REFRESH_PER_CALL, None)
        if not rows.size:
            return None
        return table.names[int(rows[np.argmax(scores)])]  # the first best: the lowest name

    def _scan(
        self, pod: PodRequest, refresh: int, given: list[str] | None
    ) -> tuple[NodeTable, np.ndarray, np.ndarray]:
        """The nodes that can take the pod (table rows, in name order or the order of
        `given`) and their exact scores: what `_results` and `_scorer` give node by node,
        with the per-node tests and the scoring done on columns. The same tests, cache,
        refresh budget and scores; only nodes whose cached result is stale are evaluated,
        through `_evaluate`, in the same order."""
        table, _, rows, scores = self._scan_taken(pod, refresh, given)
        return table, rows, scores

    def _scan_taken(
        self,
        pod: PodRequest,
        refresh: int,
        given: list[str] | None,
        fresh_since: float | None = None,
    ) -> tuple[NodeTable, np.ndarray | None, np.ndarray, np.ndarray]:
        """`_scan`, and for each of `given` whether it is among the rows found (None when
        no names are given)."""
        key = self._key(pod)
        self._refresh_budget = refresh
        mix_version = self._call_mix_version
        table = self.cluster.table()
        single = pod.containers[0] if len(pod.containers) == 1 else None
        may = table.may_take(
            self.cluster.fresh_since() if fresh_since is None else fresh_since,
            single.gpus if single is not None else 0,
            single.cores if single is not None else 0,
            pod.cpu_milli,
            pod.memory_mib,
        )
        if pod.selection.use_types or pod.selection.nouse_types:
            # A node whose every GPU is of a model the pod refuses can never fit it.
            may &= table.allows_models(pod.selection.allows_model)
        considered: np.ndarray | None = None  # of `given`: known, and passing `may`
        if given is None:
            candidates = np.flatnonzero(may)
        else:
            # A list, then one np.array: np.fromiter converting lookup by lookup took most of
            # this step's time (500 names per kube-scheduler call at 5,000 nodes).
            found = list(map(table.index.get, given, itertools.repeat(-1)))
            rows = np.array(found, dtype=np.int64)
            considered = rows >= 0  # a node never heard of cannot take it
            considered[considered] = may[rows[considered]]
            candidates = rows[considered]
        columns = self._result_columns(key, table)
        stale = candidates[~columns.valid(table, mix_version)[candidates]]
        if len(stale) > GROUP_FROM and self._alike_by_signature(pod):
            self._evaluate_by_signature(pod, key, table, columns, stale)
        else:
            self._evaluate_rows(pod, key, table, columns, stale.tolist())
        fit = columns.fit[candidates]
        rows = candidates[fit]
        if considered is not None:
            considered[considered] = fit  # now: taken
        scores = columns.raw[rows]
        node_policy = self.policies_of(pod)[0]
        host_score = getattr(node_policy, "host_score", None)
        if host_score is not None and rows.size:
            ctx = ScoreContext(self.mix.snapshot(), self.cluster, self.mix.model_shares())
            host_scores = getattr(node_policy, "host_scores", None)
            if host_scores is not None and columns.views is not None:
                scores = scores + host_scores(ctx, table, rows, columns.views[rows], pod)
            else:
                results: list[Any] = columns.results
                scores = scores + np.array(
                    [
                        host_score(ctx, table.nodes[r], results[r].host_view, pod)
                        for r in rows.tolist()
                    ]
                )
        return table, considered, rows, scores

    def _score10(self, pod: PodRequest, rows: np.ndarray) -> np.ndarray:
        """The cached 0..10 scores of `rows` for the pod's shape (after a `_scan` of it)."""
        return self._columns[self._key(pod)].score10[rows]

    def _evaluate_rows(
        self,
        pod: PodRequest,
        key: tuple[object, ...],
        table: NodeTable,
        columns: ResultColumns,
        rows: list[int],
    ) -> list[object]:
        """_evaluate on each row's node, in order; the results mirrored into `columns`."""
        evaluate = self._evaluate
        results: list[object] = []
        known = columns.results
        for row in rows:
            node = table.nodes[row]
            if self._refresh_budget <= 0:
                cached: Any = node.cache.get(key)
                if cached is not None and cached[0] == node.version and cached[2] is known[row]:
                    # The refresh budget is spent: _evaluate would hand back the cached
                    # result, which the column already holds (a mix policy after the mix moved).
                    results.append(cached[2])
                    continue
            result = evaluate(node, pod, key)  # type: ignore[arg-type]
            cached = node.cache.get(key)
            version, mix = (cached[0], cached[1]) if cached and cached[2] is result else (-1, 0)
            if type(result) is _Fit:
                columns.store(
                    row, version, mix, result, result.raw_score, result.score10, result.host_view
                )
            else:
                columns.store(row, version, mix, result, None, 0, None)
            results.append(result)
        return results

    def _alike_by_signature(self, pod: PodRequest) -> bool:
        """Whether nodes of equal signature give the pod equal results, whatever their cache
        holds: policies of GPU state only that never read the workload mix (a mix policy's
        cached scores may lag the mix, node by node), and no GPU named by UUID."""
        policies = self.policies_of(pod)
        return (
            all(getattr(p, "gpu_state_only", False) for p in policies)
            and not any(getattr(p, "uses_mix", False) for p in policies)
            and not (pod.selection.use_uuids or pod.selection.nouse_uuids)
        )

    def _evaluate_by_signature(
        self,
        pod: PodRequest,
        key: tuple[object, ...],
        table: NodeTable,
        columns: ResultColumns,
        stale: np.ndarray,
    ) -> None:
        """Many stale rows (a shape not met for a while): one evaluation per distinct node
        signature, its result copied to the rows alike (what _evaluate's shared results
        would give each of them, without a call per node)."""
        signatures = table.signature_ids()[stale]
        _, first, group = np.unique(signatures, return_index=True, return_inverse=True)
        results = self._evaluate_rows(pod, key, table, columns, stale[first].tolist())
        fit = np.array([type(r) is _Fit for r in results])
        raw = np.array([r.raw_score if type(r) is _Fit else 0.0 for r in results])
        score10 = np.array([r.score10 if type(r) is _Fit else 0 for r in results])
        columns.version[stale] = table.version[stale]
        columns.mix[stale] = self._call_mix_version
        columns.fit[stale] = fit[group]
        columns.raw[stale] = raw[group]
        columns.score10[stale] = score10[group]
        for row, index in zip(stale.tolist(), group.tolist(), strict=True):
            columns.results[row] = results[index]
        views = [r.host_view if type(r) is _Fit else None for r in results]
        shown = [v for v in views if isinstance(v, tuple)]
        if shown:
            width = len(shown[0])
            has = np.array([isinstance(v, tuple) for v in views])[group]
            matrix = np.array([v if isinstance(v, tuple) else (0.0,) * width for v in views])
            if columns.views is None:
                columns.views = np.zeros((len(columns.version), width))
            columns.views[stale[has]] = matrix[group[has]]

    def _result_columns(self, key: tuple[object, ...], table: NodeTable) -> ResultColumns:
        if self._columns_layout != table.layout:
            self._columns.clear()
            self._columns_layout = table.layout
        columns = self._columns.get(key)
        if columns is None:
            if len(self._columns) >= RESULT_COLUMNS_LIMIT:
                self._columns.popitem(last=False)
            columns = self._columns[key] = ResultColumns(len(table.names))
        else:
            self._columns.move_to_end(key)
        return columns

    def _best_cpu_node(self, pod: PodRequest, names: Sequence[str]) -> str | None:
        """A pod without GPUs: the best host score, then (as kube-scheduler's LeastAllocated
        would) the most CPU and memory share left, then the lowest name."""
        get = self.cluster.lookup()
        best: tuple[float, float, str] | None = None
        for name, raw in self.cpu_pod_scores(pod, names).items():
            node = get(name)
            left = 2.0
            if node is not None:
                left = _share_left(node.cpu_milli, node.used_cpu_milli + pod.cpu_milli)
                left += _share_left(node.host_memory_mib, node.used_memory_mib + pod.memory_mib)
            key = (-raw, -left, name)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def commit(
        self, ref: PodRef, node_name: str, pod: PodRequest, traceparent: str = ""
    ) -> PodAllocation:
        """Place and record in one synchronous step: nothing runs between check and record."""
        if ref.uid in self.ledger:
            raise Unplaceable(f"pod {ref} (uid {ref.uid}) is already recorded")
        try:
            placement = self.placement(pod, node_name)
        except Unplaceable as exc:
            raise Unplaceable(f"node {node_name!r} no longer fits pod {ref}: {exc}") from exc
        node = self.cluster.node(node_name)
        assert node is not None
        node_policy, gpu_policy = self.policies_of(pod)
        allocation = PodAllocation(
            namespace=ref.namespace,
            name=ref.name,
            uid=ref.uid,
            node=node_name,
            containers={
                r.container: ContainerAllocation(
                    container=r.container, slices=placement.slices[r.container], init=r.init
                )
                for r in pod.containers
            },
            traceparent=traceparent,
            memory_scaling=node.memory_scaling,
            policy=f"{node_policy.name}/{gpu_policy.name}",
        )
        self.ledger.record(
            allocation, {r.container: r for r in pod.containers}, pod.cpu_milli, pod.memory_mib
        )
        return allocation


def _share_left(capacity: int, used: int) -> float:
    return (capacity - used) / capacity if capacity else 1.0
