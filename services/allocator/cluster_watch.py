"""The cluster as kube-scheduler sees it: Node allocatable and every bound pod's requests.

List+watch handlers (kube.py runs them through the ``kubernetes`` client; in local mode
backend.py feeds them from its in-memory pods):

- ``NodeHandler``: each Node's ``status.allocatable`` cpu, memory and pods become the node's
  capacity in ClusterState (over the node agent's hints); a deleted Node's are forgotten.
- ``BoundPodHandler``: each pod bound to a node and not ended, GPU or not, holds its
  requests there (host_requests.py counts them as kube-scheduler does); a pod that ends
  (Succeeded, Failed) or is deleted gives them back. A list replaces what was known.
- ``UnboundPodHandler``: the pods no node has yet, as kube-scheduler's pending queue holds
  them; the allocator shows a pod as pending only while it is one of these, and says "no
  longer waiting" when it leaves (bound or deleted).

Both are cheap per event (a dict update), so thousands of pods and nodes stay fast.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from services.common.host_requests import MIB, pod_host_requests
from services.common.quantity import QuantityError, milli_value, parse_quantity, value

from .cluster import Allocatable, ClusterState
from .host_usage import HostUsage

log = logging.getLogger("vgpu.allocator")

ENDED_PHASES = ("Succeeded", "Failed")

WATCH_EVENTS = Counter(
    "vgpu_allocator_cluster_watch_events_total",
    "Node and bound-pod changes taken in (type: list, ADDED, MODIFIED, DELETED)",
    ["resource", "type"],
)
COUNTED_PODS = Gauge(
    "vgpu_allocator_counted_pods", "Pods whose CPU and memory the allocator counts on nodes"
)


def node_allocatable(node: Mapping[str, Any]) -> Allocatable:
    """A Node's allocatable cpu (milli), memory (MiB, rounded down) and pods; 0 where absent
    or unreadable (then the agent's hint, or no check, applies)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    found = []
    for key, convert in (
        ("cpu", milli_value),
        ("memory", lambda amount: value(amount) // MIB),
        ("pods", value),
    ):
        raw = allocatable.get(key)
        if raw is None:
            found.append(0)
            continue
        try:
            found.append(max(0, convert(parse_quantity(raw))))
        except QuantityError as exc:
            name = (node.get("metadata") or {}).get("name")
            log.warning(
                "unreadable node allocatable", extra={"node": name, "resource": key,
                                                      "error": str(exc)},
            )  # fmt: skip
            found.append(0)
    return Allocatable(*found)


class NodeHandler:
    def __init__(self, cluster: ClusterState) -> None:
        self._cluster = cluster
        self._known: set[str] = set()
        self.listed = asyncio.Event()  # the first list was taken in

    def _set(self, name: str, allocatable: Allocatable | None) -> None:
        if self._cluster.set_allocatable(name, allocatable):  # usage carries over
            log.info(
                "node capacity from the cluster",
                extra={"node": name, "allocatable": allocatable and allocatable._asdict()},
            )

    async def on_list(self, items: list[dict[str, Any]], listed_at: float) -> None:
        WATCH_EVENTS.labels(resource="nodes", type="list").inc()
        names = set()
        for node in items:
            name = (node.get("metadata") or {}).get("name")
            if isinstance(name, str) and name:
                names.add(name)
                self._set(name, node_allocatable(node))
        for gone in self._known - names:
            self._set(gone, None)
        self._known = names
        self.listed.set()

    async def on_change(self, kind: str, obj: dict[str, Any]) -> None:
        WATCH_EVENTS.labels(resource="nodes", type=kind).inc()
        name = (obj.get("metadata") or {}).get("name")
        if not isinstance(name, str) or not name:
            return
        if kind == "DELETED":
            self._known.discard(name)
            self._set(name, None)
        else:
            self._known.add(name)
            self._set(name, node_allocatable(obj))


class BoundPodHandler:
    def __init__(
        self,
        host: HostUsage,
        on_gone: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        self._host = host
        # Hears each bound pod that leaves (deleted, or ended): every replica frees its
        # slices at once, so a delete during a leader handover is not held until a relist.
        self._on_gone = on_gone
        self.listed = asyncio.Event()  # the first list was taken in

    def _take(self, pod: Mapping[str, Any]) -> str | None:
        """Count a bound, running pod; its uid, or None when it holds nothing anywhere."""
        metadata = pod.get("metadata") or {}
        uid = metadata.get("uid")
        node = (pod.get("spec") or {}).get("nodeName")
        if not isinstance(uid, str) or not uid:
            return None
        if not node or (pod.get("status") or {}).get("phase") in ENDED_PHASES:
            self._host.end(uid)
            return None
        try:
            needs = pod_host_requests(pod)
        except QuantityError as exc:  # the API server validates these: log, count it as 0
            log.warning(
                "unreadable pod requests",
                extra={"pod": f"{metadata.get('namespace')}/{metadata.get('name')}",
                       "node": node, "error": str(exc)},
            )  # fmt: skip
            needs = None
        cpu, memory = (needs.cpu_milli, needs.memory_mib) if needs is not None else (0, 0)
        self._host.observe(uid, node, cpu, memory)
        return uid

    async def on_list(self, items: list[dict[str, Any]], listed_at: float) -> None:
        WATCH_EVENTS.labels(resource="pods", type="list").inc()
        alive = {uid for pod in items if (uid := self._take(pod)) is not None}
        for uid in self._host.observed_uids() - alive:
            self._host.end(uid)
        log.info("counted the pods bound to nodes", extra={"pods": len(alive)})
        COUNTED_PODS.set(len(self._host))
        self.listed.set()

    async def on_change(self, kind: str, obj: dict[str, Any]) -> None:
        WATCH_EVENTS.labels(resource="pods", type=kind).inc()
        if kind == "DELETED":
            uid = (obj.get("metadata") or {}).get("uid")
            if isinstance(uid, str):
                self._host.end(uid)
                if self._on_gone is not None:
                    await self._on_gone(obj)
        else:
            self._take(obj)
        COUNTED_PODS.set(len(self._host))


class UnboundPodHandler:
    """The pods the API server says wait for a node, by uid; `on_added` hears of each that
    arrives, `on_gone` of each that leaves (bound, ended or deleted)."""

    def __init__(
        self,
        on_gone: Callable[[str], Awaitable[None]] | None = None,
        on_added: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._uids: set[str] = set()
        self._on_gone = on_gone
        self._on_added = on_added
        self.listed = asyncio.Event()  # the first list was taken in

    def __contains__(self, uid: object) -> bool:
        return uid in self._uids

    def __len__(self) -> int:
        return len(self._uids)

    async def _added(self, uid: str) -> None:
        if self._on_added is not None:
            await self._on_added(uid)

    async def _gone(self, uid: str) -> None:
        if self._on_gone is not None:
            await self._on_gone(uid)

    async def on_list(self, items: list[dict[str, Any]], listed_at: float) -> None:
        WATCH_EVENTS.labels(resource="unbound_pods", type="list").inc()
        uids = set()
        for pod in items:
            uid = (pod.get("metadata") or {}).get("uid")
            if (
                isinstance(uid, str)
                and uid
                and (pod.get("status") or {}).get("phase") not in (ENDED_PHASES)
            ):
                uids.add(uid)
        gone, added, self._uids = self._uids - uids, uids - self._uids, uids
        for uid in gone:
            await self._gone(uid)
        for uid in added:
            await self._added(uid)
        self.listed.set()

    async def on_change(self, kind: str, obj: dict[str, Any]) -> None:
        WATCH_EVENTS.labels(resource="unbound_pods", type=kind).inc()
        uid = (obj.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        if kind == "DELETED" or (obj.get("status") or {}).get("phase") in ENDED_PHASES:
            if uid in self._uids:
                self._uids.discard(uid)
                await self._gone(uid)
        elif uid not in self._uids:
            self._uids.add(uid)
            await self._added(uid)
