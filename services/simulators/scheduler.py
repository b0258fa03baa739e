"""A kube-scheduler stand-in that drives a scheduler extender exactly as kube-scheduler does.

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

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common.tracing import inject_headers, tracer

_tracer = tracer("vgpu.simulators.scheduler")

SCORE_FACTOR = 10  # kube-scheduler: MaxNodeScore / MaxExtenderPriority


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
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
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
        if not interested(pod, self.managed):
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

    async def _scores(self, pod: dict[str, Any], passed: list[str]) -> dict[str, int]:
        """Totals per node; kube-scheduler ignores a failed prioritize, so do we (all zero)."""
        totals = dict.fromkeys(passed, 0)
        try:
            answer = await self._call(
                "prioritize", {"Pod": pod, "Nodes": None, "NodeNames": passed}
            )
        except ExtenderCallError:
            return totals
        if not isinstance(answer, list):
            return totals
        for entry in answer:
            if not isinstance(entry, dict):
                continue
            host, score = entry.get("Host"), entry.get("Score")
            if host in totals and isinstance(score, int) and not isinstance(score, bool):
                totals[host] += score * self.weight * SCORE_FACTOR
        return totals

    async def _call(self, verb: str, body: dict[str, Any]) -> Any:
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
            try:
                return msgspec.json.decode(payload)
            except msgspec.DecodeError as exc:
                raise ExtenderCallError(
                    f"{verb}: the answer from {url} is not JSON: {exc}"
                ) from exc
