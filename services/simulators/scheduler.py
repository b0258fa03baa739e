"""kube-scheduler stand-ins that drive a scheduler extender exactly as kube-scheduler does.

`SchedulerSimulator` is the extender's client alone (every node goes to the extender);
`KubeSchedulerEmulation` (below) is a whole default-profile scheduler: NodeResourcesFit,
LeastAllocated and BalancedAllocation scoring (services/simulators/kube_scoring.py), the
extenders of a KubeSchedulerConfiguration, and binding through the API server.

SchedulerSimulator:

nodeCacheCapable=true: filter with ``Pod`` + ``NodeNames`` (``Nodes`` null), prioritize the
survivors, pick the best total (extender score x weight x 10, ties to the lowest node name),
then bind. Like kube-scheduler, a non-200 or non-JSON answer fails the call, a filter that
returns a node it was not given is an error, and a failed prioritize is ignored.

With ``managed_resources`` it follows deploy/k8s's two extender entries: filter and bind only
for pods that name one of them (kube-scheduler's IsInterested), prioritize for every pod;
other pods are bound as kube-scheduler's DefaultBinder binds, with a v1.Binding POSTed to
the API server at ``api_url``.
"""

from __future__ import annotations

import random
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common.tracing import inject_headers, tracer
from services.simulators import kube_scoring
from services.simulators.kube_columns import NodeColumns

_tracer = tracer("vgpu.simulators.scheduler")

SCORE_FACTOR = 10  # kube-scheduler: MaxNodeScore / MaxExtenderPriority


class HostPriority(msgspec.Struct):
    """One entry of an extender's prioritize answer (extenderv1.HostPriority)."""

    Host: str
    Score: int  # JSON true or 2.0 is not one: such answers take the entry-by-entry path


_HOST_PRIORITIES = msgspec.json.Decoder(list[HostPriority])


class ExtenderCallError(RuntimeError):
    """The extender's answer was not usable; the message says which verb and why."""


@dataclass
class ScheduleResult:
    node: str | None = None
    failed_nodes: dict[str, str] = field(default_factory=dict)
    unresolvable_nodes: dict[str, str] = field(default_factory=dict)
    error: str = ""
    scores: dict[str, int] = field(default_factory=dict)  # totals, as kube-scheduler sums them

    @property
    def scheduled(self) -> bool:
        return self.node is not None

    def describe(self) -> str:
        """One line for humans, in the spirit of kube-scheduler's FailedScheduling event."""
        if self.node is not None:
            return f"bound to {self.node}"
        if self.error:
            return f"error: {self.error}"
        reasons = {**self.failed_nodes, **self.unresolvable_nodes}
        total = len(reasons)
        details = "; ".join(f"{node}: {reason}" for node, reason in sorted(reasons.items()))
        return f"0/{total} nodes are available: {details}" if total else "no nodes to try"


def _string_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ExtenderCallError(f"filter: {what} is not a map of node name to reason")
    return value


def interested(pod: dict[str, Any], managed: frozenset[str]) -> bool:
    """kube-scheduler's HTTPExtender.IsInterested: some container or init container names a
    managed resource in its requests or limits (an extender with none takes every pod)."""
    if not managed:
        return True
    spec = pod.get("spec") or {}
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            resources = (container.get("resources") or {}) if isinstance(container, dict) else {}
            for part in ("requests", "limits"):
                if managed & set(resources.get(part) or {}):
                    return True
    return False


class SchedulerSimulator:
    def __init__(
        self,
        extender_url: str,
        timeout_s: float = 5.0,
        weight: int = 1,
        managed_resources: frozenset[str] = frozenset(),
        api_url: str = "",
        scheduler_name: str = "",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if weight < 1:
            raise ValueError(f"extender weight must be at least 1, got {weight}")
        if managed_resources and not api_url:
            raise ValueError("pods the extender does not bind need api_url to be bound")
        self.extender_url = extender_url.rstrip("/")
        self.timeout_s = timeout_s
        self.weight = weight
        self.managed = managed_resources
        self.api_url = api_url.rstrip("/")
        # The profile this scheduler is: a pod naming another scheduler ("" = any) is left to
        # the default scheduler, which binds it through the API server without the extender.
        self.scheduler_name = scheduler_name
        if scheduler_name and not api_url:
            raise ValueError("pods of other schedulers need api_url to be bound")
        self._ssl = ssl_context  # client certificate for an HTTPS extender
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True),
            )
        return self._session

    async def schedule(self, pod: dict[str, Any], node_names: list[str]) -> ScheduleResult:
        """Schedule one pod onto one of `node_names` through the extender."""
        metadata = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
            return ScheduleResult(error="the pod has no metadata.name")
        if not isinstance(node_names, list) or not all(isinstance(n, str) for n in node_names):
            return ScheduleResult(error="node_names must be a list of node names")
        namespace = metadata.get("namespace") or "default"
        name = metadata["name"]
        # The pod's trace starts here unless the caller is already inside one.
        with _tracer.start_as_current_span(f"schedule {namespace}/{name}") as span:
            try:
                result = await self._schedule(pod, namespace, name, metadata, node_names)
            except ExtenderCallError as exc:
                result = ScheduleResult(error=str(exc))
            if result.error:
                span.set_status(Status(StatusCode.ERROR, result.error))
            span.set_attribute("vgpu.node", result.node or "")
            return result

    async def _schedule(
        self,
        pod: dict[str, Any],
        namespace: str,
        name: str,
        metadata: dict[str, Any],
        node_names: list[str],
    ) -> ScheduleResult:
        if not interested(pod, self.managed) or not self._ours(pod):
            return await self._schedule_elsewhere(pod, namespace, name, node_names)
        filtered = await self._call("filter", {"Pod": pod, "Nodes": None, "NodeNames": node_names})
        if not isinstance(filtered, dict):
            raise ExtenderCallError("filter: the answer is not an ExtenderFilterResult object")
        result = ScheduleResult(
            failed_nodes=_string_map(filtered.get("FailedNodes"), "FailedNodes"),
            unresolvable_nodes=_string_map(
                filtered.get("FailedAndUnresolvableNodes"), "FailedAndUnresolvableNodes"
            ),
        )
        error = filtered.get("Error") or ""
        if error:
            result.error = f"filter: {error}"
            return result
        passed = filtered.get("NodeNames")
        if passed is None:
            passed = []  # kube-scheduler: no names back means no node passed
        if not isinstance(passed, list) or not all(isinstance(n, str) for n in passed):
            raise ExtenderCallError("filter: NodeNames is not a list of node names")
        strangers = [n for n in passed if n not in node_names]
        if strangers:
            raise ExtenderCallError(
                f"filter: the extender returned node(s) it was not given: {', '.join(strangers)}"
            )
        if not passed:
            return result

        result.scores = await self._scores(pod, passed)
        best = min(passed, key=lambda n: (-result.scores.get(n, 0), n))
        bound = await self._call(
            "bind",
            {
                "PodName": name,
                "PodNamespace": namespace,
                "PodUID": metadata.get("uid") or "",
                "Node": best,
            },
        )
        if not isinstance(bound, dict):
            raise ExtenderCallError("bind: the answer is not an ExtenderBindingResult object")
        if bound.get("Error"):
            result.error = f"bind to {best}: {bound['Error']}"
            return result
        result.node = best
        return result

    def _ours(self, pod: dict[str, Any]) -> bool:
        if not self.scheduler_name:
            return True
        spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
        return (spec.get("schedulerName") or "default-scheduler") == self.scheduler_name

    async def _schedule_elsewhere(
        self, pod: dict[str, Any], namespace: str, name: str, node_names: list[str]
    ) -> ScheduleResult:
        """A pod the filter-and-bind extender does not manage: every node passes (this
        stand-in has no filter plugins), the extender still scores, DefaultBinder binds."""
        if not node_names:
            return ScheduleResult()
        result = ScheduleResult(scores=await self._scores(pod, node_names))
        best = min(node_names, key=lambda n: (-result.scores.get(n, 0), n))
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace,
                         "uid": (pod.get("metadata") or {}).get("uid") or ""},
            "target": {"apiVersion": "v1", "kind": "Node", "name": best},
        }  # fmt: skip
        url = f"{self.api_url}/api/v1/namespaces/{namespace}/pods/{name}/binding"
        try:
            async with self._http().post(url, json=binding) as response:
                if response.status not in (200, 201):
                    text = (await response.read())[:300].decode(errors="replace")
                    result.error = f"binding to {best}: HTTP {response.status}: {text}"
                    return result
        except (TimeoutError, aiohttp.ClientError) as exc:
            result.error = f"binding to {best}: cannot reach {url}: {exc}"
            return result
        result.node = best
        return result

    async def _scores(
        self, pod: dict[str, Any], passed: list[str], verb: str = "prioritize"
    ) -> dict[str, int]:
        """Totals per node; kube-scheduler ignores a failed prioritize, so do we (all zero)."""
        totals = dict.fromkeys(passed, 0)
        try:
            payload = await self._post(verb, {"Pod": pod, "Nodes": None, "NodeNames": passed})
        except ExtenderCallError:
            return totals
        factor = self.weight * SCORE_FACTOR
        try:  # the well-formed answer, typed in one pass (hundreds of entries per call)
            priorities = _HOST_PRIORITIES.decode(payload)
        except msgspec.ValidationError:
            pass  # odd entries: judged one by one below
        except msgspec.DecodeError:
            return totals  # not JSON
        else:
            for entry in priorities:
                if entry.Host in totals:
                    totals[entry.Host] += entry.Score * factor
            return totals
        answer = msgspec.json.decode(payload)
        if not isinstance(answer, list):
            return totals
        for entry in answer:
            if not isinstance(entry, dict):
                continue
            host, score = entry.get("Host"), entry.get("Score")
            if host in totals and isinstance(score, int) and not isinstance(score, bool):
                totals[host] += score * factor
        return totals

    async def _call(self, verb: str, body: dict[str, Any]) -> Any:
        payload = await self._post(verb, body)
        try:
            return msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise ExtenderCallError(
                f"{verb}: the answer from {self.extender_url}/{verb} is not JSON: {exc}"
            ) from exc

    async def _post(self, verb: str, body: dict[str, Any]) -> bytes:
        """The extender's answer to one call, unparsed; ExtenderCallError unless HTTP 200."""
        url = f"{self.extender_url}/{verb}"
        with _tracer.start_as_current_span(f"extender-call {verb}", kind=SpanKind.CLIENT):
            headers = inject_headers({"Content-Type": "application/json"})
            try:
                async with self._http().post(
                    url, data=msgspec.json.encode(body), headers=headers
                ) as response:
                    payload = await response.read()
                    status = response.status
            except TimeoutError as exc:
                raise ExtenderCallError(
                    f"{verb}: no answer from {url} in {self.timeout_s}s"
                ) from exc
            except aiohttp.ClientError as exc:
                raise ExtenderCallError(f"{verb}: cannot reach {url}: {exc}") from exc
            if status != 200:
                text = payload[:300].decode(errors="replace")
                raise ExtenderCallError(f"{verb}: HTTP {status} from {url}: {text}")
            return payload


# -- kube-scheduler's default profile with extenders --------------------------------------


@dataclass(frozen=True)
class ExtenderConfig:
    """One `extenders[]` entry of a KubeSchedulerConfiguration."""

    url: str
    filter_verb: str = ""
    prioritize_verb: str = ""
    bind_verb: str = ""
    weight: int = 1
    managed: dict[str, bool] = field(default_factory=dict)  # name -> ignoredByScheduler
    timeout_s: float = 5.0

    @classmethod
    def from_entry(cls, entry: dict[str, Any], url: str | None = None) -> ExtenderConfig:
        timeout = str(entry.get("httpTimeout") or "5s")
        return cls(
            url=(url or entry.get("urlPrefix") or "").rstrip("/"),
            filter_verb=entry.get("filterVerb") or "",
            prioritize_verb=entry.get("prioritizeVerb") or "",
            bind_verb=entry.get("bindVerb") or "",
            weight=int(entry.get("weight") or 1),
            managed={
                m["name"]: bool(m.get("ignoredByScheduler"))
                for m in entry.get("managedResources") or []
            },
            timeout_s=float(timeout.rstrip("s")) if timeout.endswith("s") else 5.0,
        )

    def interested(self, pod: dict[str, Any]) -> bool:
        """kube-scheduler's IsInterested: no managed resources, or a container names one."""
        if not self.managed:
            return True
        spec = pod.get("spec") or {}
        for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
            resources = container.get("resources") or {}
            for names in (resources.get("requests") or {}, resources.get("limits") or {}):
                if any(name in self.managed for name in names):
                    return True
        return False


@dataclass(frozen=True)
class SchedulerConfig:
    """What the emulation reads from a KubeSchedulerConfiguration (the deploy one)."""

    extenders: tuple[ExtenderConfig, ...] = ()
    percentage_of_nodes_to_score: int = 0

    @classmethod
    def from_document(
        cls, document: dict[str, Any], extender_url: str | None = None
    ) -> SchedulerConfig:
        profiles = document.get("profiles") or [{}]
        percentage = profiles[0].get("percentageOfNodesToScore")
        if percentage is None:
            percentage = document.get("percentageOfNodesToScore") or 0
        return cls(
            extenders=tuple(
                ExtenderConfig.from_entry(e, extender_url) for e in document.get("extenders") or []
            ),
            percentage_of_nodes_to_score=int(percentage),
        )

    @property
    def ignored_resources(self) -> frozenset[str]:
        return frozenset(n for e in self.extenders for n, ignored in e.managed.items() if ignored)


@dataclass
class CycleResult:
    node: str | None = None
    reason: str = ""
    extender_ms: float = 0.0  # filter + prioritize round trips, the extender's share


class KubeSchedulerEmulation:
    """One kube-scheduler with the default profile and the configured extenders.

    Per pod: NodeResourcesFit filters nodes from a rotating start until it has found
    numFeasibleNodesToFind of them; each interested extender filters the survivors (HTTP);
    with two or more left, the total of each is NodeResourcesFit's LeastAllocated score +
    BalancedAllocation's (weights 1) + 10 x weight x each interested extender's prioritize
    score; the highest total wins, ties uniformly at random (seeded); an interested extender
    with a bind verb binds, otherwise the pod is bound through the API server's binding
    subresource. The node cache is this scheduler's own, updated on every bind it makes
    (kube-scheduler's assume), from Node objects read from the API server."""

    def __init__(self, api_url: str, config: SchedulerConfig, seed: int = 0) -> None:
        self.api_url = api_url.rstrip("/")
        self.config = config
        self.rng = random.Random(seed)
        self.nodes: list[kube_scoring.NodeInfo] = []
        self.columns = NodeColumns(self.nodes)  # the same nodes as arrays, for the scans
        self._next_start = 0
        self._session: aiohttp.ClientSession | None = None
        # One client per extender entry (two entries may share a URL with different verbs).
        self._callers = [SchedulerSimulator(e.url, e.timeout_s, e.weight) for e in config.extenders]

    async def close(self) -> None:
        for caller in self._callers:
            await caller.close()
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def load_nodes(self) -> None:
        """The node cache from the API server's Node objects (status.allocatable)."""
        async with self._http().get(f"{self.api_url}/api/v1/nodes") as response:
            listing = await response.json()
        self.nodes = []
        for item in listing.get("items") or []:
            allocatable = (item.get("status") or {}).get("allocatable") or {}
            self.nodes.append(
                kube_scoring.NodeInfo(
                    name=item["metadata"]["name"],
                    allocatable={
                        name: kube_scoring.quantity(value, milli=name == kube_scoring.CPU)
                        for name, value in allocatable.items()
                    },
                )
            )
        self.columns = NodeColumns(self.nodes)

    def _feasible(self, demand: kube_scoring.PodDemand) -> list[int]:
        """Rows of the nodes that fit, in the order examined from the rotating start."""
        total = len(self.nodes)
        wanted = kube_scoring.num_feasible_nodes_to_find(
            total, self.config.percentage_of_nodes_to_score
        )
        rows, examined = self.columns.feasible(
            demand, self.config.ignored_resources, self._next_start, wanted
        )
        if total:
            self._next_start = (self._next_start + examined) % total
        return rows.tolist()

    async def schedule(self, pod: dict[str, Any]) -> CycleResult:
        metadata = pod["metadata"]
        namespace, name = metadata.get("namespace") or "default", metadata["name"]
        demand = kube_scoring.pod_demand(pod)
        feasible = self._feasible(demand)
        columns = self.columns
        if not feasible:
            return CycleResult(reason="no node fits the pod's cpu/memory/resources")
        interested = [
            (extender, caller)
            for extender, caller in zip(self.config.extenders, self._callers, strict=True)
            if extender.interested(pod)
        ]
        names = [columns.names[row] for row in feasible]
        extender_s = 0.0
        timer = time.perf_counter
        for extender, caller in interested:
            if not extender.filter_verb or not names:
                continue
            begin = timer()
            try:
                answer = await caller._call(
                    extender.filter_verb, {"Pod": pod, "Nodes": None, "NodeNames": names}
                )
            except ExtenderCallError as exc:  # kube-scheduler: the cycle fails, the pod waits
                return CycleResult(reason=f"extender filter: {exc}")
            extender_s += timer() - begin
            if not isinstance(answer, dict) or answer.get("Error"):
                error = answer.get("Error") if isinstance(answer, dict) else "bad answer"
                return CycleResult(reason=f"extender filter: {error}")
            passed = set(answer.get("NodeNames") or [])
            names = [n for n in names if n in passed]
        if not names:
            return CycleResult(
                reason="the extender filtered out every node", extender_ms=extender_s * 1000
            )
        if len(names) == 1:
            chosen = names[0]
        else:
            rows = np.array([columns.row[n] for n in names], dtype=np.int64)
            totals = columns.scores(rows, demand).tolist()
            position = {n: i for i, n in enumerate(names)}
            for extender, caller in interested:
                if not extender.prioritize_verb:
                    continue
                begin = timer()
                scores = await caller._scores(pod, names, extender.prioritize_verb)
                extender_s += timer() - begin
                for host, value in scores.items():
                    totals[position[host]] += value  # already x weight x 10
            chosen = kube_scoring.select_host(list(zip(names, totals, strict=True)), self.rng)
        binder = next(((e, c) for e, c in interested if e.bind_verb), None)
        if binder is not None:
            try:
                answer = await binder[1]._call(
                    binder[0].bind_verb,
                    {
                        "PodName": name,
                        "PodNamespace": namespace,
                        "PodUID": metadata.get("uid") or "",
                        "Node": chosen,
                    },
                )
            except ExtenderCallError as exc:
                # No answer: the bind may still have happened. kube-scheduler learns that
                # from its pod informer; the emulation asks the API server the same thing.
                bound_to = await self._bound_node(namespace, name)
                if bound_to is None:
                    return CycleResult(
                        reason=f"bind to {chosen}: {exc}", extender_ms=extender_s * 1000
                    )
                chosen, answer = bound_to, {}  # bound after all: placed where it is
            if not isinstance(answer, dict) or answer.get("Error"):
                error = answer.get("Error") if isinstance(answer, dict) else "bad answer"
                return CycleResult(
                    reason=f"bind to {chosen}: {error}", extender_ms=extender_s * 1000
                )
        else:
            binding = {
                "apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace, "uid": metadata.get("uid")},
                "target": {"apiVersion": "v1", "kind": "Node", "name": chosen},
            }  # fmt: skip
            url = f"{self.api_url}/api/v1/namespaces/{namespace}/pods/{name}/binding"
            async with self._http().post(url, json=binding) as response:
                if response.status != 201:
                    text = await response.text()
                    return CycleResult(
                        reason=f"binding to {chosen}: HTTP {response.status} {text[:200]}"
                    )
        columns.add(columns.row[chosen], demand)
        return CycleResult(node=chosen, extender_ms=extender_s * 1000)

    async def _bound_node(self, namespace: str, name: str) -> str | None:
        """The node the API server has the pod bound to, if any (None as well when it cannot
        be read: a cycle whose outcome is unknown counts as failed)."""
        url = f"{self.api_url}/api/v1/namespaces/{namespace}/pods/{name}"
        try:
            async with self._http().get(url) as response:
                if response.status != 200:
                    return None
                stored = msgspec.json.decode(await response.read())
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
            return None
        node = (stored.get("spec") or {}).get("nodeName") if isinstance(stored, dict) else None
        return node if isinstance(node, str) and node in self.columns.row else None
