"""The placement engine: filter, prioritize, bind, claim and hint, with no wire format.

Used by the scheduler extender now and by simulators and benchmarks later. Filter and
prioritize only look; bind places again and records in one synchronous step (no await in
between), so two binds racing for the same GPU can never both win.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from services.common import subjects
from services.common.resources import RequestError, container_requests
from services.common.schemas import (
    AllocationEvent,
    ContainerAllocation,
    ContainerRequest,
    GpuDevice,
    PodAllocation,
)

from .backend import ClusterBackend
from .inventory import InventoryStore
from .ledger import Ledger
from .placement import NoFit, capacity_problem, never_fits, place, place_on

log = logging.getLogger("vgpu.allocator")

ALLOCATION_ANNOTATION = "vgpu.io/allocation"
MAX_SCORE = 10
POD_CACHE_SIZE = 4096  # pods seen in filter, kept for bind; bounded so floods cannot grow it

EventKind = Literal["bound", "claimed", "released"]


class EventSink(Protocol):
    async def publish(self, subject: str, message: msgspec.Struct) -> None: ...


class BindError(Exception):
    """A bind was refused; the message is the reason the scheduler shows."""


class ClaimError(Exception):
    """A claim was refused; the message names the pod, container or GPUs at fault."""


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_ref(pod: dict[str, Any]) -> PodRef:
    metadata = pod.get("metadata") or {}
    return PodRef(
        namespace=metadata.get("namespace") or "default",
        name=metadata.get("name") or "",
        uid=metadata.get("uid") or "",
    )


def pod_requests(pod: dict[str, Any]) -> list[ContainerRequest]:
    """The pod's GPU requests; RequestError when malformed (duplicate names included)."""
    requests = container_requests(pod)
    seen: set[str] = set()
    for request in requests:
        if request.container in seen:
            raise RequestError(f"container name {request.container!r} is used twice in the pod")
        seen.add(request.container)
    return requests


@dataclass
class FilterOutcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


class PlacementEngine:
    def __init__(
        self,
        inventory: InventoryStore,
        ledger: Ledger,
        backend: ClusterBackend,
        events: EventSink | None = None,
    ) -> None:
        self.inventory = inventory
        self.ledger = ledger
        self.backend = backend
        self._events = events
        self._seen_pods: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def set_event_sink(self, events: EventSink | None) -> None:
        self._events = events

    def _remember(self, pod: dict[str, Any]) -> None:
        uid = pod_ref(pod).uid
        if not uid:
            return
        self._seen_pods[uid] = pod
        self._seen_pods.move_to_end(uid)
        while len(self._seen_pods) > POD_CACHE_SIZE:
            self._seen_pods.popitem(last=False)

    # -- filter / prioritize ------------------------------------------------------------

    def filter(self, pod: dict[str, Any], node_names: list[str]) -> FilterOutcome:
        """Which nodes could take the pod now; reasons for the others."""
        self._remember(pod)
        names = _unique(node_names)
        outcome = FilterOutcome()
        try:
            requests = pod_requests(pod)
        except RequestError as exc:
            outcome.unresolvable = {node: f"invalid GPU request: {exc}" for node in names}
            return outcome
        if not requests:
            outcome.passed = names  # no GPU asked: not ours to judge
            return outcome
        never = never_fits(requests, self.inventory.all_gpus())
        if never:
            outcome.unresolvable = dict.fromkeys(names, never)
            return outcome
        for node in names:
            status = self.inventory.status(node)
            if not status.available or status.gpus is None:
                outcome.failed[node] = status.reason
                continue
            problem = capacity_problem(requests, status.gpus)
            if problem is not None:
                outcome.unresolvable[node] = f"node {node!r} can never hold it: {problem}"
                continue
            try:
                place(requests, status.gpus, self.ledger.reserved(node))
            except NoFit as exc:
                outcome.failed[node] = f"node {node!r}: {exc}"
                continue
            outcome.passed.append(node)
        return outcome

    def prioritize(self, pod: dict[str, Any], node_names: list[str]) -> dict[str, int]:
        """Scores 0..10: binpack, the fuller the node's GPU memory after placing, the higher."""
        names = _unique(node_names)
        try:
            requests = pod_requests(pod)
        except RequestError:
            requests = []
        if not requests:
            return dict.fromkeys(names, 0)
        return {node: self._binpack_score(node, requests) for node in names}

    def _binpack_score(self, node: str, requests: list[ContainerRequest]) -> int:
        status = self.inventory.status(node)
        if not status.available or not status.gpus:
            return 0
        reserved = self.ledger.reserved(node)
        try:
            placed = place(requests, status.gpus, reserved)
        except NoFit:
            return 0
        total = sum(gpu.memory_mib for gpu in status.gpus)
        used = sum(reserved[g.uuid].memory_mib for g in status.gpus if g.uuid in reserved)
        used += sum(piece.memory_mib for slices in placed.values() for piece in slices)
        return max(0, min(MAX_SCORE, round(MAX_SCORE * used / total))) if total else 0

    # -- bind -----------------------------------------------------------------------------

    async def bind(
        self, namespace: str, name: str, uid: str, node: str, traceparent: str = ""
    ) -> PodAllocation | None:
        """Place the pod on `node`, record it, tell the cluster; None for a pod with no GPU."""
        ref = PodRef(namespace, name, uid)
        if not uid:
            raise BindError(f"pod {ref}: a bind needs the pod's uid")
        existing = self.ledger.get(uid)
        if existing is not None:
            if existing.node == node:
                return existing  # a retried bind: already done
            raise BindError(f"pod {ref} is already bound to node {existing.node!r}")
        pod = self._seen_pods.get(uid)
        if pod is None:
            try:
                pod = await self.backend.get_pod(namespace, name)
            except Exception as exc:
                raise BindError(f"cannot read pod {ref} from the cluster: {exc}") from exc
        if pod is None:
            raise BindError(
                f"pod {ref} (uid {uid}) is unknown: this allocator never filtered it and "
                f"the cluster has no such pod"
            )
        known_uid = pod_ref(pod).uid
        if known_uid and known_uid != uid:
            raise BindError(f"pod {ref} now has uid {known_uid}, not {uid}: it was re-created")
        try:
            requests = pod_requests(pod)
        except RequestError as exc:
            raise BindError(f"pod {ref}: invalid GPU request: {exc}") from exc
        if not requests:
            await self._cluster_bind(ref, node)
            return None

        allocation = self._place_and_record(ref, node, requests, traceparent)
        try:
            annotation = msgspec.json.encode(
                {c.container: c.slices for c in allocation.containers.values()}
            ).decode()
            await self.backend.annotate(namespace, name, {ALLOCATION_ANNOTATION: annotation})
            await self._cluster_bind(ref, node)
        except BindError:
            self.ledger.release(uid)
            raise
        except Exception as exc:
            self.ledger.release(uid)
            raise BindError(f"cannot annotate pod {ref}: {exc}") from exc
        self._seen_pods.pop(uid, None)
        log.info(
            "pod bound",
            extra={
                "pod": str(ref),
                "uid": uid,
                "node": node,
                "slices": {n: [s.uuid for s in c.slices] for n, c in allocation.containers.items()},
                "traceparent": traceparent,
            },
        )
        await self._publish(node, "bound", allocation)
        return allocation

    def _place_and_record(
        self, ref: PodRef, node: str, requests: list[ContainerRequest], traceparent: str
    ) -> PodAllocation:
        # Synchronous on purpose: nothing else runs between the fit check and the record.
        status = self.inventory.status(node)
        if not status.available or status.gpus is None:
            raise BindError(status.reason)
        try:
            placed = place(requests, status.gpus, self.ledger.reserved(node))
        except NoFit as exc:
            raise BindError(f"node {node!r} no longer fits pod {ref}: {exc}") from exc
        allocation = PodAllocation(
            namespace=ref.namespace,
            name=ref.name,
            uid=ref.uid,
            node=node,
            containers={
                r.container: ContainerAllocation(
                    container=r.container, slices=placed[r.container], init=r.init
                )
                for r in requests
            },
            traceparent=traceparent,
        )
        self.ledger.record(allocation, {r.container: r for r in requests})
        return allocation

    async def _cluster_bind(self, ref: PodRef, node: str) -> None:
        try:
            await self.backend.bind(ref.namespace, ref.name, ref.uid, node)
        except Exception as exc:
            raise BindError(f"cannot bind pod {ref} to node {node!r}: {exc}") from exc

    # -- claim / preferred ----------------------------------------------------------------

    async def claim(
        self,
        node: str,
        namespace: str,
        pod: str,
        container: str,
        device_ids: list[str],
        gpu_uuids: list[str],
    ) -> tuple[PodAllocation, ContainerAllocation]:
        """The node agent reports the devices a container got; return its decision."""
        allocation = self.ledger.find(node, namespace, pod)
        if allocation is None:
            raise ClaimError(f"no pod {namespace}/{pod} is bound to node {node!r}")
        decided = allocation.containers.get(container)
        if decided is None:
            known = ", ".join(repr(c) for c in allocation.containers) or "none"
            raise ClaimError(
                f"pod {namespace}/{pod} on node {node!r} has no GPU allocation for container "
                f"{container!r} (containers with one: {known})"
            )
        uuids = _unique(gpu_uuids)
        if not device_ids or not uuids:
            raise ClaimError(
                f"claim for {namespace}/{pod} container {container!r} names no devices"
            )
        if decided.claimed and sorted(decided.device_ids) == sorted(device_ids):
            return allocation, decided  # the agent asked again: same answer
        self._follow_kubelet(allocation, decided, uuids)
        decided.device_ids = list(device_ids)
        decided.claimed = True
        log.info(
            "container claimed",
            extra={
                "pod": f"{namespace}/{pod}",
                "container": container,
                "node": node,
                "device_ids": device_ids,
            },
        )
        await self._publish(node, "claimed", allocation)
        return allocation, decided

    def _follow_kubelet(
        self, allocation: PodAllocation, decided: ContainerAllocation, uuids: list[str]
    ) -> None:
        """Make the decision's slices lie on the GPUs the kubelet really handed over.

        Same GPUs: only reorder to the kubelet's order. Other GPUs: move the slices there when
        they have room; otherwise refuse, since the container would run on GPUs nobody reserved.
        """
        where = f"pod {allocation.namespace}/{allocation.name} container {decided.container!r}"
        by_uuid = {piece.uuid: piece for piece in decided.slices}
        if set(uuids) == set(by_uuid):
            decided.slices = [by_uuid[u] for u in uuids]
            return
        planned = [piece.uuid for piece in decided.slices]
        gpus: dict[str, GpuDevice] = {
            gpu.uuid: gpu for gpu in self.inventory.gpus(allocation.node) or ()
        }
        unknown = [u for u in uuids if u not in gpus]
        if unknown:
            raise ClaimError(
                f"{where} got GPU(s) {', '.join(unknown)}, which node {allocation.node!r} "
                f"never reported"
            )
        request = self.ledger.request_of(allocation.uid, decided.container)
        if request is None:  # recorded without its request: cannot recompute
            raise ClaimError(f"{where}: the allocator lost its request")
        reserved = self.ledger.reserved(allocation.node, skip=(allocation.uid, decided.container))
        try:
            slices = place_on(request, [gpus[u] for u in uuids], reserved)
        except NoFit as exc:
            raise ClaimError(
                f"{where} was given GPUs {', '.join(uuids)} by the kubelet but the allocator "
                f"chose {', '.join(planned)}, and the given GPUs cannot take it: {exc}"
            ) from exc
        self.ledger.move(allocation.uid, decided.container, slices)
        log.warning(
            "moved a container onto the GPUs the kubelet gave it",
            extra={
                "pod": f"{allocation.namespace}/{allocation.name}",
                "container": decided.container,
                "planned": planned,
                "given": uuids,
            },
        )

    def preferred(self, node: str, available_gpus: list[str], size: int) -> list[str]:
        """GPUs of the oldest bound-but-unclaimed, not yet hinted container of `size` slices."""
        available = set(available_gpus)
        for allocation in self.ledger.on_node(node):
            for name, container in allocation.containers.items():
                if container.claimed or self.ledger.is_hinted(allocation.uid, name):
                    continue
                uuids = [piece.uuid for piece in container.slices]
                if len(uuids) == size and available.issuperset(uuids):
                    self.ledger.mark_hinted(allocation.uid, name)
                    return uuids
        return []

    # -- release / views ------------------------------------------------------------------

    async def release(self, uid: str) -> PodAllocation | None:
        """Forget a pod's slices (the pod is gone); None when it was not recorded."""
        allocation = self.ledger.release(uid)
        if allocation is not None:
            await self._publish(allocation.node, "released", allocation)
        return allocation

    def allocations(self) -> list[PodAllocation]:
        return self.ledger.all()

    async def _publish(self, node: str, kind: EventKind, allocation: PodAllocation) -> None:
        if self._events is None:
            return
        try:
            await self._events.publish(
                subjects.alloc_events(node),
                AllocationEvent(kind=kind, allocation=allocation),
            )
        except Exception as exc:  # the decision stands; listeners resync from /allocations
            log.warning(
                "cannot publish allocation event",
                extra={"node": node, "kind": kind, "uid": allocation.uid, "error": str(exc)},
            )
