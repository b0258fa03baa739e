"""The allocator's engine: the placement core plus the cluster, the journal and events.

Filter and prioritize only look (core.py). Bind places and records in one synchronous step,
makes the record durable (journal.py, compare-and-set per node), then annotates and binds
the pod in the cluster; any failure after the record rolls it back. Claims and hints serve
the node agents. Nothing here knows HTTP or NATS subjects' payload formats beyond the schemas.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from services.common import subjects
from services.common.resources import RequestError
from services.common.schemas import (
    AllocationEvent,
    ClaimRequest,
    ContainerAllocation,
    GpuSlice,
    NodeInventory,
    PodAllocation,
)

from . import gpushare
from .backend import ClusterBackend
from .cluster import Charge, ClusterState
from .core import FilterOutcome, PlacementCore, PodRef, Unplaceable, pod_ref
from .journal import Journal, JournalError, LostRace
from .ledger import Ledger
from .placement import NoFit, overbooked, pod_charges, slices_on
from .pod_request import PodRequest

if TYPE_CHECKING:
    from .bind_guard import BindGuard

log = logging.getLogger("vgpu.allocator")

ALLOCATION_ANNOTATION = "vgpu.io/allocation"
MAX_SCORE = 10
POD_CACHE_SIZE = 4096  # pods seen in filter, kept for bind; bounded so floods cannot grow it
PARSED_CACHE_SIZE = 64  # requests read from pods, by what parse reads (filter, prioritize)
BIND_ATTEMPTS = 3  # re-placements after losing a race with another replica

EventKind = Literal["bound", "claimed", "released"]

__all__ = [
    "ALLOCATION_ANNOTATION",
    "BindError",
    "ClaimError",
    "FilterOutcome",
    "PlacementEngine",
    "PodRef",
    "pod_ref",
]


class EventSink(Protocol):
    async def publish(self, subject: str, message: msgspec.Struct) -> None: ...


class BindError(Exception):
    """A bind was refused; the message is the reason the scheduler shows, ``reason`` the
    metric label."""

    def __init__(self, message: str, reason: str = "placement") -> None:
        super().__init__(message)
        self.reason = reason


class ClaimError(Exception):
    """A claim was refused; the message names the pod, container or GPUs at fault."""


class _UnknownRules(Exception):
    """Pods to displace whose request (selection, policy) this replica never parsed."""

    def __init__(self, uids: set[str], reason: str) -> None:
        self.uids = uids
        super().__init__(
            f"{reason}; the pods reserving them could not be read from the cluster to place "
            f"them again: {', '.join(sorted(uids))}"
        )


@dataclass
class _Move:
    """A container whose slices a claim changed, with the slices it had before."""

    allocation: PodAllocation
    container: str
    slices: list[GpuSlice]


def annotation_value(allocation: PodAllocation) -> str:
    """The pod annotation: {"<container>": [GpuSlice...]} — by name, for people and rebuilds."""
    return msgspec.json.encode(
        {c.container: c.slices for c in allocation.containers.values()}
    ).decode()


def request_key(pod: Mapping[str, Any]) -> bytes | None:
    """Every part of a pod that parse_pod reads (pod_request.py, services/common/resources.py
    and host_requests.py: the annotations; each container's name, resources and
    restartPolicy; the pod's resources and overhead), encoded: pods equal in these parts have
    the same request, whatever their names and uids. None when a part is not of the shape
    the API server stores (the parse then says what is wrong) or not JSON."""
    metadata, spec = pod.get("metadata"), pod.get("spec")
    if not isinstance(metadata, Mapping) or not isinstance(spec, Mapping):
        return None
    parts: list[Any] = [metadata.get("annotations"), spec.get("resources"), spec.get("overhead")]
    for field in ("containers", "initContainers"):
        containers = spec.get(field) or []
        if not isinstance(containers, list):
            return None
        for container in containers:
            if not isinstance(container, Mapping):
                return None
            get = container.get
            parts.append((field, get("name"), get("resources"), get("restartPolicy")))
    try:
        return msgspec.json.encode(parts)
    except (TypeError, msgspec.EncodeError):
        return None


class PlacementEngine:
    def __init__(
        self,
        core: PlacementCore,
        backend: ClusterBackend,
        events: EventSink | None = None,
        journal: Journal | None = None,
        guard: BindGuard | None = None,
    ) -> None:
        self.core = core
        self.guard = guard  # None: binds are not checked against filter passes (embedding)
        self.cluster: ClusterState = core.cluster
        self.ledger: Ledger = core.ledger
        self.backend = backend
        self.journal = journal or Journal(core.ledger)
        self._events = events
        self._seen_pods: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._binding: set[str] = set()  # uids of the binds in progress here
        # gpushare pods bound but not yet claimed (their ASSIGNED annotation still "false").
        self._gpushare_unassigned: OrderedDict[str, None] = OrderedDict()
        self._observed: OrderedDict[str, None] = OrderedDict()
        self._parsed: OrderedDict[bytes, PodRequest] = OrderedDict()

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

    def parse(self, pod: dict[str, Any]) -> PodRequest:
        """core.parse, remembered by what it reads of the pod (request_key): kube-scheduler
        sends the same pod to filter and then to prioritize (and again when it retries), the
        pods of one Deployment or Job ask alike, and reading the request costs far more than
        encoding those parts to look it up. RequestError as core.parse (refusals are not
        kept: they are rare and cheap to read again)."""
        key = request_key(pod)
        if key is None:  # not the usual shapes, or not JSON: just read (and refuse)
            return self.core.parse(pod)
        request = self._parsed.get(key)
        if request is None:
            request = self.core.parse(pod)
            self._parsed[key] = request
            if len(self._parsed) > PARSED_CACHE_SIZE:
                self._parsed.popitem(last=False)
        return request

    def _observe_once(self, uid: str, request: PodRequest) -> None:
        """Count each pod once in the workload mix, however often it is retried."""
        if not uid or uid in self._observed:
            return
        self._observed[uid] = None
        while len(self._observed) > POD_CACHE_SIZE:
            self._observed.popitem(last=False)
        self.core.observe(request)

    # -- inventory ------------------------------------------------------------------------

    def on_inventory(self, inventory: NodeInventory) -> bool:
        """Take a node agent's inventory; True when the node's GPUs changed (or are new)."""
        changed = self.cluster.update(inventory)
        if changed:
            self.ledger.reapply(inventory.node)  # usage of GPUs the node lists now
        return changed

    # -- filter / prioritize ------------------------------------------------------------------

    def filter(
        self, pod: dict[str, Any], node_names: list[str], *, record: bool = True
    ) -> FilterOutcome:
        """Which nodes could take the pod now; reasons for the others. The passed nodes are
        what a bind may then ask for (BindGuard); without `record`, the caller records them
        (`record_filtered`: a filter answered in slices passes the union of its slices)."""
        self._remember(pod)
        try:
            request = self.parse(pod)
        except RequestError as exc:
            names = list(dict.fromkeys(node_names))
            return FilterOutcome(unresolvable={n: f"invalid GPU request: {exc}" for n in names})
        uid = pod_ref(pod).uid
        if request.containers:
            self._observe_once(uid, request)
        outcome = self.core.filter(request, node_names)
        placed = self.ledger.get(uid)
        if placed is not None and placed.node in node_names and placed.node not in outcome.passed:
            # Already placed there (a bind whose answer was lost): its own slices hold the room.
            outcome.failed.pop(placed.node, None)
            outcome.unresolvable.pop(placed.node, None)
            outcome.passed.append(placed.node)
        if record:
            self.record_filtered(pod, outcome.passed)
        return outcome

    def record_filtered(self, pod: dict[str, Any], passed: list[str]) -> None:
        if self.guard is not None:
            self.guard.filtered(pod, passed)

    def prioritize(self, pod: dict[str, Any], node_names: list[str]) -> dict[str, int]:
        try:
            request = self.parse(pod)
        except RequestError:
            return dict.fromkeys(dict.fromkeys(node_names), 0)
        scores = self.core.prioritize(request, node_names)
        placed = self.ledger.get(pod_ref(pod).uid)
        if placed is not None and placed.node in scores:
            scores[placed.node] = MAX_SCORE
        return scores

    # -- bind -----------------------------------------------------------------------------

    async def _pod_for_bind(self, ref: PodRef) -> dict[str, Any]:
        pod = self._seen_pods.get(ref.uid)
        if pod is None:
            try:
                pod = await self.backend.get_pod(ref.namespace, ref.name)
            except Exception as exc:
                raise BindError(f"cannot read pod {ref} from the cluster: {exc}") from exc
        if pod is None:
            raise BindError(
                f"pod {ref} (uid {ref.uid}) is unknown: this allocator never filtered it and "
                f"the cluster has no such pod"
            )
        known_uid = pod_ref(pod).uid
        if known_uid and known_uid != ref.uid:
            raise BindError(f"pod {ref} now has uid {known_uid}, not {ref.uid}: it was re-created")
        return pod

    async def _read_pod(self, ref: PodRef) -> dict[str, Any] | None:
        """The pod as the cluster has it now (a bind decides on nothing a caller sent)."""
        try:
            return await self.backend.get_pod(ref.namespace, ref.name)
        except Exception as exc:
            raise BindError(
                f"cannot read pod {ref} from the cluster: {exc}", reason="cluster_unreachable"
            ) from exc

    async def _cluster_node_of(self, ref: PodRef, pod: dict[str, Any] | None = None) -> str | None:
        """The node the cluster has the pod bound to (None: not bound, or no such pod).
        A pod that cannot be read is a BindError, never "not bound": taking it for unbound
        would release the booking of a pod that may run."""
        if pod is None:
            pod = await self._read_pod(ref)
        if pod is None or pod_ref(pod).uid not in ("", ref.uid):
            return None
        return (pod.get("spec") or {}).get("nodeName") or None

    async def bind(
        self, namespace: str, name: str, uid: str, node: str, traceparent: str = ""
    ) -> PodAllocation | None:
        """Place the pod on `node`, record it durably, tell the cluster; None for no GPU."""
        ref = PodRef(namespace, name, uid)
        if not uid:
            raise BindError(f"pod {ref}: a bind needs the pod's uid", reason="no_uid")
        if uid in self._binding:
            # A retry while the first bind still runs (its caller timed out): two binds of one
            # pod at once could release each other's record; the retry comes back later.
            raise BindError(f"pod {ref}: a bind of this pod is in progress", reason="in_progress")
        self._binding.add(uid)
        try:
            return await self._bind(ref, node, traceparent)
        finally:
            self._binding.discard(uid)

    async def _bind(self, ref: PodRef, node: str, traceparent: str) -> PodAllocation | None:
        uid = ref.uid
        cluster_pod: dict[str, Any] | None = None
        if self.guard is not None:
            await self.guard.check_filtered(ref, node)
            cluster_pod = await self._read_pod(ref)
            placed = self.ledger.get(uid)
            self.guard.check_pod(ref, cluster_pod, node, placed.node if placed else None)
        existing = self.ledger.get(uid)
        if existing is not None:
            bound_to = await self._cluster_node_of(ref, cluster_pod)
            if existing.node == node:
                # A retried bind (the caller timed out) may find the first one's record still
                # waiting on its write: bind only once the record is stored, never before, or
                # the first bind's rollback leaves a pod bound that nothing books.
                await self._stored(ref, node)
                if bound_to != node:  # recorded, but a crash came before the binding
                    await self._tell_cluster(ref, existing)
                return self.ledger.get(uid) or existing
            if bound_to is not None:
                raise BindError(f"pod {ref} is already bound to node {existing.node!r}")
            # Recorded by a replica that died before binding: the record is stale.
            await self.release(uid)
        pod = cluster_pod if cluster_pod is not None else await self._pod_for_bind(ref)
        try:
            request = self.parse(pod)
        except RequestError as exc:
            raise BindError(f"pod {ref}: invalid GPU request: {exc}") from exc
        if not request.containers:
            await self._cluster_bind(ref, node)
            return None
        self._observe_once(uid, request)
        allocation = await self._record_durably(ref, node, request, traceparent)
        await self._tell_cluster(ref, allocation, self._gpushare_annotations(pod, allocation))
        self._seen_pods.pop(uid, None)
        log.info(
            "pod bound",
            extra={
                "pod": str(ref),
                "uid": uid,
                "node": node,
                "policy": allocation.policy,
                "slices": {n: [s.uuid for s in c.slices] for n, c in allocation.containers.items()},
                "traceparent": traceparent,
            },
        )
        await self._publish(node, "bound", allocation)
        return allocation

    async def _record_durably(
        self, ref: PodRef, node: str, request: PodRequest, traceparent: str
    ) -> PodAllocation:
        try:
            self.journal.check_reachable()
        except JournalError as exc:
            raise BindError(
                f"pod {ref}: no decision is made: {exc}", reason="store_unreachable"
            ) from exc
        for _ in range(BIND_ATTEMPTS):
            try:
                allocation = self.core.commit(ref, node, request, traceparent)
            except Unplaceable as exc:
                raise BindError(str(exc)) from exc
            self.ledger.set_pod_request(ref.uid, request)  # a claim may re-place it later
            self.journal.added(node, ref.uid)
            try:
                await self.journal.save(node, ref.uid)
            except LostRace:
                continue  # another replica took the room: place again on what is left
            except JournalError as exc:
                self.ledger.release(ref.uid)
                self.journal.removed(node, ref.uid)
                raise BindError(f"pod {ref}: the decision could not be stored: {exc}") from exc
            # The stored version: a merge with the store may have kept an earlier write of
            # this pod (one whose answer was lost), and the annotation must match the store.
            return self.ledger.get(ref.uid) or allocation
        raise BindError(f"pod {ref}: node {node!r} kept filling up under concurrent binds")

    async def _stored(self, ref: PodRef, node: str) -> None:
        """Wait until the pod's record on `node` is in the store (a no-op when it is)."""
        try:
            await self.journal.save(node, ref.uid)
        except JournalError as exc:  # LostRace too: the record is gone
            raise BindError(
                f"pod {ref}: its decision for node {node!r} is not stored: {exc}",
                reason="not_stored",
            ) from exc

    def _gpushare_annotations(
        self, pod: dict[str, Any], allocation: PodAllocation
    ) -> dict[str, str]:
        """gpushare's bind annotations for a pod asking aliyun.com/gpu-mem ({} otherwise)."""
        total = gpushare.pod_total(pod, self.core.request_config)
        first = gpushare.first_gpu(pod, allocation)
        if total is None or first is None:
            return {}
        self._gpushare_unassigned[allocation.uid] = None
        while len(self._gpushare_unassigned) > 10_000:  # pods never started: forget the oldest
            self._gpushare_unassigned.popitem(last=False)
        gpus = self.cluster.gpus(allocation.node) or ()
        memory = next((g.memory_mib for g in gpus if g.uuid == first.uuid), first.memory_mib)
        unit = self.core.request_config.aliyun_unit_mib
        return gpushare.bind_annotations(total, first.index, memory, unit_mib=unit)

    async def _gpushare_assigned(self, allocation: PodAllocation) -> None:
        """gpushare's device plugin marks its pod assigned once it has allocated it; vgpu's
        node agent does so when it claims (best effort: the flag is informational)."""
        if allocation.uid not in self._gpushare_unassigned:
            return
        del self._gpushare_unassigned[allocation.uid]
        try:
            await self.backend.annotate(allocation.namespace, allocation.name,
                                        gpushare.assigned_annotations())  # fmt: skip
        except Exception as exc:
            log.warning("cannot mark a gpushare pod assigned",
                        extra={"pod": f"{allocation.namespace}/{allocation.name}",
                               "node": allocation.node, "error": str(exc)})  # fmt: skip

    async def _tell_cluster(
        self, ref: PodRef, allocation: PodAllocation, extra: dict[str, str] | None = None
    ) -> None:
        """Annotate, then bind (so the annotations are there when the node sees the pod)."""
        try:
            await self.backend.annotate(
                ref.namespace,
                ref.name,
                {**(extra or {}), ALLOCATION_ANNOTATION: annotation_value(allocation)},
            )
            await self._cluster_bind(ref, allocation.node)
        except Exception as exc:
            if await self._bound_anyway(ref, allocation, exc):
                return
            self.ledger.release(ref.uid)
            self.journal.removed(allocation.node, ref.uid)
            try:
                await self.journal.save(allocation.node)
            except JournalError as store_exc:
                log.error(
                    "cannot undo a stored decision",
                    extra={"pod": str(ref), "uid": ref.uid, "node": allocation.node,
                           "reason": str(exc), "error": str(store_exc)},
                )  # fmt: skip
            if isinstance(exc, BindError):
                raise
            raise BindError(f"cannot annotate pod {ref}: {exc}") from exc

    async def _bound_anyway(self, ref: PodRef, allocation: PodAllocation, exc: Exception) -> bool:
        """After a failed annotate or bind: whether the pod is bound to the booking's node all
        the same (the binding was made but its answer lost, or made by an earlier attempt),
        so the booking must stay. When the pod cannot be read the outcome is unknown: the
        booking stays too (a booking of a pod never bound is freed by the reconciler within
        release_unbound_after_s; a pod bound without one shares its GPUs with the next), and
        the bind fails."""
        try:
            bound_to = await self._cluster_node_of(ref)
        except BindError as read_exc:
            log.error(
                "bind outcome unknown: the booking is kept",
                extra={"pod": str(ref), "uid": ref.uid, "node": allocation.node,
                       "reason": str(exc), "error": str(read_exc)},
            )  # fmt: skip
            raise BindError(
                f"pod {ref}: binding to node {allocation.node!r} failed ({exc}) and the pod "
                f"cannot be read back ({read_exc}); its booking is kept until the cluster "
                f"says whether it was bound",
                reason="outcome_unknown",
            ) from exc
        if bound_to != allocation.node:
            return False
        log.warning(
            "the pod is bound although the bind call failed; the booking stays",
            extra={"pod": str(ref), "uid": ref.uid, "node": allocation.node, "reason": str(exc)},
        )
        return True

    async def _cluster_bind(self, ref: PodRef, node: str) -> None:
        try:
            await self.backend.bind(ref.namespace, ref.name, ref.uid, node)
        except Exception as exc:
            raise BindError(f"cannot bind pod {ref} to node {node!r}: {exc}") from exc

    # -- claim / preferred ----------------------------------------------------------------

    async def claim(self, request: ClaimRequest) -> tuple[PodAllocation, ContainerAllocation]:
        """The node agent reports the devices a container got; return its decision. The pod is
        named by namespace/name, or by `pod_uid` alone when both are empty."""
        node, container = request.node, request.container
        device_ids, gpu_uuids = list(request.device_ids), list(request.gpu_uuids)
        for attempt in range(2):
            allocation, decided = self._claimed_container(request)
            if decided.claimed and sorted(decided.device_ids) == sorted(device_ids):
                return allocation, decided  # the agent asked again: same answer
            try:
                moves = self._follow_kubelet(allocation, decided, list(dict.fromkeys(gpu_uuids)))
                break
            except _UnknownRules as exc:
                if attempt:
                    raise ClaimError(str(exc)) from exc
                await self._learn_rules(exc.uids)  # then plan again from scratch
        namespace, pod = allocation.namespace, allocation.name  # also when claimed by uid
        was = (decided.claimed, decided.device_ids)
        decided.device_ids = list(device_ids)
        decided.claimed = True
        touched = {allocation.uid: allocation, **{m.allocation.uid: m.allocation for m in moves}}
        for uid in touched:
            self.journal.changed(node, uid)
        try:
            await self.journal.save(node)
        except JournalError as exc:
            decided.claimed, decided.device_ids = was
            self._undo(moves)
            raise ClaimError(
                f"pod {namespace}/{pod}: the claim could not be stored: {exc}"
            ) from exc
        log.info(
            "container claimed",
            extra={
                "pod": f"{namespace}/{pod}",
                "container": container,
                "node": node,
                "gpus": [piece.uuid for piece in decided.slices],
                "device_ids": device_ids,
            },
        )
        await self._publish(node, "claimed", allocation)
        await self._gpushare_assigned(allocation)
        for uid, other in touched.items():
            if uid != allocation.uid:  # still bound, unclaimed: its reservation moved
                await self._publish(node, "bound", other)
        return allocation, decided

    def _claimed_container(
        self, request: ClaimRequest
    ) -> tuple[PodAllocation, ContainerAllocation]:
        node, namespace, pod = request.node, request.namespace, request.pod
        container, pod_uid = request.container, request.pod_uid
        if namespace or pod:
            allocation = self.ledger.find(node, namespace, pod)
            if allocation is None:
                raise ClaimError(f"no pod {namespace}/{pod} is bound to node {node!r}")
        else:  # from the kubelet checkpoint, which names pods by UID only
            if not pod_uid:
                raise ClaimError(f"claim on node {node!r} names neither a pod nor a pod uid")
            allocation = self.ledger.get(pod_uid)
            if allocation is None or allocation.node != node:
                raise ClaimError(f"no pod with uid {pod_uid} is bound to node {node!r}")
            namespace, pod = allocation.namespace, allocation.name
        decided = allocation.containers.get(container)
        if decided is None:
            known = ", ".join(repr(c) for c in allocation.containers) or "none"
            raise ClaimError(
                f"pod {namespace}/{pod} on node {node!r} has no GPU allocation for container "
                f"{container!r} (containers with one: {known})"
            )
        if not request.device_ids or not request.gpu_uuids:
            raise ClaimError(
                f"claim for {namespace}/{pod} container {container!r} names no devices"
            )
        return allocation, decided

    def _follow_kubelet(
        self, allocation: PodAllocation, decided: ContainerAllocation, uuids: list[str]
    ) -> list[_Move]:
        """Make the decision's slices lie on the GPUs the kubelet really handed over; return
        the moves made (the ledger already holds them) so a failed write can undo them.

        Same GPUs: only reorder to the kubelet's order. Other GPUs: move the slices there when
        they have room; when only unclaimed containers' reservations stand in the way, re-plan
        around them (_make_room); otherwise refuse, since the container would run on GPUs
        nobody reserved.
        """
        where = f"pod {allocation.namespace}/{allocation.name} container {decided.container!r}"
        by_uuid = {piece.uuid: piece for piece in decided.slices}
        if set(uuids) == set(by_uuid):
            decided.slices = [by_uuid[u] for u in uuids]
            return []
        planned = [piece.uuid for piece in decided.slices]
        state = self.cluster.node(allocation.node)
        unknown = [u for u in uuids if state is None or u not in state.by_uuid]
        if unknown or state is None:
            raise ClaimError(
                f"{where} got GPU(s) {', '.join(unknown)}, which node {allocation.node!r} "
                f"never reported"
            )
        request = self.ledger.request_of(allocation.uid, decided.container)
        if request is None:  # recorded without its request: cannot recompute
            raise ClaimError(f"{where}: the allocator lost its request")
        refused = (
            f"{where} was given GPUs {', '.join(uuids)} by the kubelet but the allocator "
            f"chose {', '.join(planned)}, and the given GPUs cannot take it"
        )
        try:
            slices = slices_on(request, [state.by_uuid[u] for u in uuids])
        except NoFit as exc:
            raise ClaimError(f"{refused}: {exc}") from exc
        before = self.ledger.charges_of(allocation.uid)
        moved = {
            **allocation.containers,
            decided.container: msgspec.structs.replace(decided, slices=slices),
        }
        full = overbooked(state, before, pod_charges(moved))
        if full:
            moves = self._make_room(allocation, decided, slices, full, refused)
        else:
            moves = [_Move(allocation, decided.container, list(decided.slices))]
            self.ledger.move(allocation.uid, decided.container, slices)
        log.warning(
            "moved a container onto the GPUs the kubelet gave it",
            extra={
                "pod": f"{allocation.namespace}/{allocation.name}",
                "container": decided.container,
                "node": allocation.node,
                "planned": planned,
                "given": uuids,
                "reason": "the kubelet chose other devices than the allocator's hint",
            },
        )
        return moves

    def _make_room(
        self,
        allocation: PodAllocation,
        decided: ContainerAllocation,
        slices: list[GpuSlice],
        full: list[str],
        refused: str,
    ) -> list[_Move]:
        """Take the given GPUs from unclaimed reservations, and place those again.

        The kubelet admitted pods in another order than they were bound, so it handed this
        container GPUs reserved for containers that have not started yet. Those (any pod on
        the node, this one included; never a claimed container) step aside: this container
        takes its slices where it really runs, then each displaced pod's containers are
        placed again on what remains by the node's placement (the pod's own policy and
        selection, as at bind). All or nothing: on any failure every move is undone.
        """
        node = allocation.node
        claimant = (allocation.uid, decided.container)
        victims: dict[str, tuple[PodAllocation, list[str]]] = {}
        for other in self.ledger.on_node(node):  # bind order
            for name, held in other.containers.items():
                if held.claimed or (other.uid, name) == claimant:
                    continue
                if any(piece.uuid in full for piece in held.slices):
                    victims.setdefault(other.uid, (other, []))[1].append(name)
        if not victims:
            raise ClaimError(
                f"{refused}: {', '.join(full)} lack the room (held by claimed containers)"
            )
        unknown = {uid for uid in victims if self.ledger.pod_request_of(uid) is None}
        if unknown:
            raise _UnknownRules(unknown, f"{refused}: {', '.join(full)} lack the room")
        moves = [
            _Move(other, name, list(other.containers[name].slices))
            for other, names in victims.values()
            for name in names
        ]
        moves.append(_Move(allocation, decided.container, list(decided.slices)))
        for move in moves[:-1]:
            self.ledger.move(move.allocation.uid, move.container, [])
        self.ledger.move(allocation.uid, decided.container, slices)
        state = self.cluster.node(node)
        assert state is not None
        given = {piece.uuid: Charge() for piece in slices}
        still_full = overbooked(state, {}, given)
        if still_full:
            self._undo(moves)
            raise ClaimError(
                f"{refused}: {', '.join(still_full)} lack the room even without the "
                f"reservations of unclaimed containers (claimed containers hold it)"
            )
        for uid, (other, names) in victims.items():
            rules = self.ledger.pod_request_of(uid)
            assert rules is not None
            wanted = tuple(r for r in rules.containers if r.container in names)
            displaced = dataclasses.replace(rules, containers=wanted, cpu_milli=0, memory_mib=0)
            try:
                if len(wanted) != len(names):
                    raise Unplaceable(f"its request no longer names {', '.join(names)}")
                placement = self.core.placement(displaced, node)
            except Unplaceable as exc:
                self._undo(moves)
                raise ClaimError(
                    f"{refused}: {', '.join(full)} are reserved for unclaimed containers "
                    f"{', '.join(names)} of pod {other.namespace}/{other.name}, which cannot "
                    f"be placed elsewhere: {exc}"
                ) from exc
            for name in names:
                self.ledger.move(uid, name, placement.slices[name])
                self.ledger.unmark_hinted(uid, name)  # its new GPUs are a fresh hint
        for move in moves[:-1]:
            log.warning(
                "displaced an unclaimed container to make room for a claim",
                extra={
                    "pod": f"{move.allocation.namespace}/{move.allocation.name}",
                    "container": move.container,
                    "node": node,
                    "planned": [piece.uuid for piece in move.slices],
                    "now": [
                        piece.uuid for piece in move.allocation.containers[move.container].slices
                    ],
                    "for_pod": f"{allocation.namespace}/{allocation.name}",
                    "for_container": decided.container,
                },
            )
        return moves

    def _undo(self, moves: list[_Move]) -> None:
        for move in reversed(moves):
            self.ledger.move(move.allocation.uid, move.container, move.slices)

    async def _learn_rules(self, uids: set[str]) -> None:
        """Read pods whose records came from storage (no request kept) from the cluster."""
        for uid in uids:
            allocation = self.ledger.get(uid)
            if allocation is None:
                continue
            try:
                pod = await self.backend.get_pod(allocation.namespace, allocation.name)
                if pod is None or pod_ref(pod).uid != uid:
                    continue
                self.ledger.set_pod_request(uid, self.core.parse(pod))
            except Exception as exc:  # the claim is refused below, naming the pod
                log.warning(
                    "cannot read a pod's request from the cluster",
                    extra={
                        "pod": f"{allocation.namespace}/{allocation.name}",
                        "uid": uid,
                        "node": allocation.node,
                        "error": str(exc),
                    },
                )

    def preferred(self, node: str, available_gpus: list[str], size: int) -> list[str]:
        """GPUs of the oldest bound-but-unclaimed, not yet hinted container of `size` slices."""
        return [piece.uuid for piece in self.preferred_slices(node, available_gpus, size)]

    def preferred_slices(self, node: str, available_gpus: list[str], size: int) -> list[GpuSlice]:
        """The slices of the oldest bound-but-unclaimed, not yet hinted container of `size`
        slices whose GPUs are all available (marked hinted)."""
        available = set(available_gpus)
        for allocation in self.ledger.on_node(node):
            for name, container in allocation.containers.items():
                if container.claimed or self.ledger.is_hinted(allocation.uid, name):
                    continue
                uuids = [piece.uuid for piece in container.slices]
                if len(uuids) == size and available.issuperset(uuids):
                    self.ledger.mark_hinted(allocation.uid, name)
                    return list(container.slices)
        return []

    def mig_placement(
        self, node: str, gpu_uuid: str, key: str
    ) -> tuple[PodAllocation, str, GpuSlice]:
        """The MIG instance the container of directory `key` should get on dynamic-MIG GPU
        `gpu_uuid`: the one already given to `key` (a retried Allocate), else that of the
        oldest bound, unclaimed container with a MIG slice there not yet served, which is
        then marked served for `key`. ClaimError when no container waits for one."""
        waiting: tuple[PodAllocation, str, GpuSlice] | None = None
        for allocation in self.ledger.on_node(node):
            for name, container in allocation.containers.items():
                for piece in container.slices:
                    if piece.uuid != gpu_uuid or not piece.mig_profile:
                        continue
                    served = self.ledger.mig_key(allocation.uid, name, gpu_uuid)
                    if served == key:
                        return allocation, name, piece
                    if served is None and not container.claimed and waiting is None:
                        waiting = (allocation, name, piece)
        if waiting is None:
            raise ClaimError(
                f"no pod bound to node {node!r} waits for a MIG instance on GPU {gpu_uuid}"
            )
        allocation, name, piece = waiting
        self.ledger.mark_mig(allocation.uid, name, gpu_uuid, key)
        log.info(
            "MIG placement handed to the node agent",
            extra={
                "pod": f"{allocation.namespace}/{allocation.name}",
                "container": name,
                "node": node,
                "gpu": gpu_uuid,
                "profile": piece.mig_profile,
                "start": piece.mig_start,
            },
        )
        return waiting

    # -- release / rebuild / views --------------------------------------------------------

    async def release(self, uid: str, reason: str = "pod gone") -> PodAllocation | None:
        """Forget a pod's slices (the pod is gone, `reason` says how); None when it was not
        recorded."""
        allocation = self.ledger.release(uid)
        if allocation is None:
            return None
        self.journal.removed(allocation.node, uid)
        try:
            await self.journal.save(allocation.node)
        except JournalError as exc:
            log.error(
                "cannot store a release",
                extra={"pod": f"{allocation.namespace}/{allocation.name}", "uid": uid,
                       "node": allocation.node, "reason": reason, "error": str(exc)},
            )  # fmt: skip
        log.info(
            "pod released",
            extra={
                "pod": f"{allocation.namespace}/{allocation.name}",
                "uid": uid,
                "node": allocation.node,
                "gpus": sorted({s.uuid for c in allocation.containers.values() for s in c.slices}),
                "reason": reason,
            },
        )
        await self._publish(allocation.node, "released", allocation)
        return allocation

    async def adopt(self, allocation: PodAllocation) -> bool:
        """Take a decision found on a pod's annotation that the store lacks (rebuild)."""
        if allocation.uid in self.ledger:
            return False
        self.ledger.record(allocation)
        self.journal.added(allocation.node, allocation.uid)
        try:
            await self.journal.save(allocation.node)
        except JournalError as exc:
            log.error(
                "cannot store an adopted decision",
                extra={"pod": f"{allocation.namespace}/{allocation.name}", "uid": allocation.uid,
                       "node": allocation.node, "error": str(exc)},
            )  # fmt: skip
        return True

    def allocations(self) -> list[PodAllocation]:
        return self.ledger.all()

    async def _publish(self, node: str, kind: EventKind, allocation: PodAllocation) -> None:
        if self._events is None:
            return
        try:
            await self._events.publish(
                subjects.alloc_events(node), AllocationEvent(kind=kind, allocation=allocation)
            )
        except Exception as exc:  # the decision stands; listeners resync from /allocations
            log.warning(
                "cannot publish allocation event",
                extra={
                    "pod": f"{allocation.namespace}/{allocation.name}",
                    "node": node,
                    "kind": kind,
                    "uid": allocation.uid,
                    "error": str(exc),
                },
            )


def decode_annotation(
    value: str, pod: Mapping[str, Any], node: str, init_names: set[str]
) -> PodAllocation:
    """A PodAllocation from the `vgpu.io/allocation` annotation of a bound pod (rebuild)."""
    by_name = msgspec.json.decode(value, type=dict[str, list[GpuSlice]])
    ref = pod_ref(pod)
    return PodAllocation(
        namespace=ref.namespace,
        name=ref.name,
        uid=ref.uid,
        node=node,
        containers={
            name: ContainerAllocation(container=name, slices=slices, init=name in init_names)
            for name, slices in by_name.items()
        },
    )
