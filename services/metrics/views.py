"""What the picture looks like to people and tools: the JSON API's shapes, built in one place.

The dashboard, `vgpu inspect`, the live stream and the Prometheus exporter all read these
views, so every one of them shows the same numbers. Sizes are MiB and compute shares percent
of a GPU's SMs, as on the wire. A figure that is not known (no fresh report) is null, never 0:
a silent node is shown as silent, not as idle.
"""

from __future__ import annotations

import heapq
import operator
import time
from typing import Any, Literal

import msgspec

from services.common.schemas import ContainerRequest, GpuDevice, PendingReason, PodAllocation
from services.metrics.picture import KINDS, ClusterPicture
from services.metrics.stranded import FreeGpu, shapes_of, stranded_memory

NodeStateName = Literal["up", "silent"]
MemoryUnit = Literal["GiB", "MiB"]


class SliceView(msgspec.Struct, kw_only=True):
    """One container's slice of one GPU."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    init: bool
    claimed: bool
    memory_mib: int  # asked: the allocator's decision
    cores: int  # asked, percent
    memory_limit_mib: int  # enforced by the hook (its report; else the decision)
    cores_limit: int  # likewise; 0 = no compute limit
    memory_used_mib: int | None  # null: no fresh report from the container's hook
    sm_util_percent: float | None
    # The node agent's own measurement (NVML, the container's processes); null: none.
    measured_mib: int | None = None
    # Standing findings of the agent's verification: "over_limit", "tampering",
    # "over_compute", comma-separated, or "" (docs/nodeagent.md, "Verification from outside").
    violation: str = ""
    # Of memory_used_mib: spilled to host-pageable managed memory (virtual device memory,
    # on GPUs whose memory scaling is above 1); null: no fresh report.
    spilled_mib: int | None = None
    # The same findings as flags, with the agent's sentences (one per kind; empty when only
    # its usage report's flag was heard) and since when (Unix time; null: none stands).
    over_limit: bool = False
    tampering: bool = False
    over_compute: bool = False
    violation_reasons: list[str] = []
    violation_since: float | None = None


class GpuView(msgspec.Struct, kw_only=True):
    uuid: str
    index: int
    model: str
    healthy: bool
    memory_mib: int
    memory_allocated_mib: int
    memory_used_mib: int | None  # NVML, whole GPU; null while the node is silent
    cores_allocated: int
    sm_util_percent: float | None
    stranded_memory_mib: int
    slices: list[SliceView]
    # How the node shares the GPU (its agent's figures, else what placements on it used):
    # memory slices may sum to memory_scaling x memory_mib, compute to 100 x cores_scaling.
    memory_scaling: float = 1.0
    cores_scaling: float = 1.0
    oversubscribed: bool = False  # memory_scaling > 1: slices may exceed the card
    # The GPU's sharing mode and, outside vgpu mode, its device IDs (docs/modes.md).
    sharing_mode: str = "vgpu"
    replicas: int = 0


def gpu_scaling(gpu: GpuDevice, placed: float) -> tuple[float, float]:
    """(memory, cores) scaling of a GPU: what its agent states, else the highest figure its
    placements recorded (the allocator's setting then), else 1."""
    return gpu.memory_scaling or placed or 1.0, gpu.cores_scaling or 1.0


class NodeView(msgspec.Struct, kw_only=True):
    name: str
    state: NodeStateName
    silent_s: float  # since the last inventory
    agent_version: str
    gpus: list[GpuView]
    address: str = ""  # the node's IP, as its agent states it ("" if unknown)


class ContainerDeviceView(msgspec.Struct, kw_only=True):
    uuid: str
    index: int
    memory_mib: int
    cores: int
    memory_limit_mib: int
    cores_limit: int
    memory_used_mib: int | None
    sm_util_percent: float | None
    measured_mib: int | None = None  # NVML, as the node agent measured it
    violation: str = ""  # as in SliceView
    spilled_mib: int | None = None  # as in SliceView
    over_limit: bool = False  # these five as in SliceView
    tampering: bool = False
    over_compute: bool = False
    violation_reasons: list[str] = []
    violation_since: float | None = None


class ContainerView(msgspec.Struct, kw_only=True):
    name: str
    init: bool
    claimed: bool
    reporting: bool  # a fresh report from its hook exists
    processes: int | None
    launches: int | None
    throttled_ms: int | None
    devices: list[ContainerDeviceView]


class PodView(msgspec.Struct, kw_only=True):
    namespace: str
    name: str
    uid: str
    node: str
    node_state: NodeStateName
    bound_at: float
    memory_mib: int
    cores: int
    containers: list[ContainerView]


class PendingView(msgspec.Struct, kw_only=True):
    namespace: str
    name: str
    uid: str
    waiting_s: float
    unresolvable: bool
    summary: str
    requests: list[ContainerRequest]
    reasons: list[PendingReason]


class Totals(msgspec.Struct, kw_only=True):
    nodes: int = 0
    nodes_up: int = 0
    gpus: int = 0
    gpus_healthy: int = 0
    memory_mib: int = 0
    memory_allocated_mib: int = 0
    memory_used_mib: int = 0  # over GPUs with a fresh report
    cores: int = 0  # 100 per GPU (times its cores scaling)
    cores_allocated: int = 0
    slices: int = 0
    pods: int = 0
    pending_pods: int = 0
    free_memory_mib: int = 0  # on healthy GPUs of nodes that are up
    stranded_memory_mib: int = 0


class ClusterView(msgspec.Struct, kw_only=True):
    generated_at: float
    stale_after_s: float
    totals: Totals
    nodes: list[NodeView]
    pods: list[PodView]
    # Longest waiting first; over HTTP at most `pending_shown` of them: the count of all is
    # totals.pending_pods ("showing 50 of 1,234 pending").
    pending: list[PendingView]
    # The unit the dashboard shows every memory figure in (the figures here stay MiB).
    memory_unit: MemoryUnit = "MiB"


class ChangeView(msgspec.Struct, kw_only=True):
    """One batch of the live stream: what changed since the previous batch."""

    seq: int
    generated_at: float
    totals: Totals
    nodes: list[NodeView] = []
    removed_nodes: list[str] = []
    pods: list[PodView] = []
    removed_pods: list[str] = []
    pending: list[PendingView] | None = None  # the list as shown, when it changed


def pending_summary(reasons: list[PendingReason], unresolvable: bool) -> str:
    if not reasons:
        return "can never fit in this cluster" if unresolvable else "waiting for GPUs"
    ranked = sorted(reasons, key=lambda r: -max(r.node_count, len(r.nodes)))
    first = ranked[0]
    count = max(first.node_count, len(first.nodes))
    more = f" (+{len(ranked) - 1} other reasons)" if len(ranked) > 1 else ""
    where = f"{count} node{'s' if count != 1 else ''}: " if count else ""
    return f"{where}{first.message}{more}"


def _state(picture: ClusterPicture, node: str, now: float) -> NodeStateName:
    return "up" if picture.is_up(node, now) else "silent"


class _Builder:
    """Builds views of one instant; the pieces shared by several views are computed once."""

    def __init__(self, picture: ClusterPicture, now: float | None = None) -> None:
        self.picture = picture
        self.now = picture.clock() if now is None else now
        self.slices: dict[str, list[SliceView]] = {}  # by GPU uuid, in bind order
        self.placed_scaling: dict[str, float] = {}  # by GPU uuid: the pods' memory scaling
        for pod in picture.pods.values():
            for container in pod.containers.values():
                for piece in container.slices:
                    self.placed_scaling[piece.uuid] = max(
                        self.placed_scaling.get(piece.uuid, 0.0), pod.memory_scaling
                    )
                devices = self._container_devices(pod, container.container)
                for piece in container.slices:
                    device = devices.get(piece.uuid)
                    self.slices.setdefault(piece.uuid, []).append(
                        SliceView(
                            namespace=pod.namespace, pod=pod.name, pod_uid=pod.uid,
                            container=container.container, init=container.init,
                            claimed=container.claimed, memory_mib=piece.memory_mib,
                            cores=piece.cores,
                            memory_limit_mib=(device.memory_limit_mib if device
                                              else piece.memory_mib),
                            cores_limit=device.cores_limit if device else piece.cores,
                            memory_used_mib=device.memory_used_mib if device else None,
                            sm_util_percent=device.sm_util_percent if device else None,
                            measured_mib=device.measured_mib if device else None,
                            spilled_mib=device.spilled_mib if device else None,
                            **self._flags(pod, container.container, piece.uuid),
                        )
                    )  # fmt: skip
        self.stranded = self._stranded()

    def _container_devices(
        self, pod: PodAllocation, container: str
    ) -> dict[str, ContainerDeviceView]:
        usage = self.picture.container_usage(pod.node, pod.namespace, pod.name, container,
                                             self.now)  # fmt: skip
        if usage is None:
            return {}
        return {
            d.uuid: ContainerDeviceView(
                uuid=d.uuid, index=d.index, memory_mib=0, cores=0,
                memory_limit_mib=d.memory_limit_mib, cores_limit=d.cores_limit,
                memory_used_mib=d.memory_used_mib,
                sm_util_percent=d.sm_util_percent if d.sm_util_percent >= 0 else None,
                measured_mib=d.measured_mib if d.measured_mib >= 0 else None,
                spilled_mib=d.spilled_mib,
            )
            for d in usage.devices
        }  # fmt: skip

    def _flags(self, pod: PodAllocation, container: str, uuid: str) -> dict[str, Any]:
        """The violation fields of one container's slice of one GPU (see SliceView)."""
        found = self.picture.findings_of(pod.node, pod.namespace, pod.name, container, uuid)
        kinds = [kind for kind in KINDS if kind in found]
        if not kinds:
            return {}
        return {
            "violation": ",".join(kinds),
            "over_limit": "over_limit" in found,
            "tampering": "tampering" in found,
            "over_compute": "over_compute" in found,
            "violation_reasons": [found[k].reason for k in kinds if found[k].reason],
            "violation_since": min(found[k].since for k in kinds),
        }

    def _allocated(self, uuid: str) -> tuple[int, int]:
        pieces = self.slices.get(uuid, [])
        return sum(s.memory_mib for s in pieces), sum(s.cores for s in pieces)

    def _stranded(self) -> dict[str, int]:
        free: list[FreeGpu] = []
        for name, state in self.picture.nodes.items():
            if not self.picture.is_up(name, self.now):
                continue
            for gpu in state.inventory.gpus:
                if gpu.healthy:
                    memory, cores = self._allocated(gpu.uuid)
                    free_memory = max(0, gpu.memory_mib - memory)
                    free.append(FreeGpu(name, gpu.uuid, gpu.memory_mib, free_memory,
                                        max(0, 100 - cores)))  # fmt: skip
        self.free_memory_mib = sum(g.free_memory_mib for g in free)
        shapes = shapes_of(
            request
            for pending in self.picture.pending.values()
            if not pending.pod.unresolvable
            for request in pending.pod.requests
        )
        return stranded_memory(free, shapes)

    def gpu(self, node: str, gpu: GpuDevice) -> GpuView:
        usage = self.picture.fresh_usage(node, self.now).get(gpu.uuid)
        memory, cores = self._allocated(gpu.uuid)
        memory_scaling, cores_scaling = gpu_scaling(gpu, self.placed_scaling.get(gpu.uuid, 0.0))
        return GpuView(
            memory_scaling=memory_scaling, cores_scaling=cores_scaling,
            oversubscribed=memory_scaling > 1,
            sharing_mode=gpu.sharing_mode, replicas=gpu.replicas,
            uuid=gpu.uuid, index=gpu.index, model=gpu.model, healthy=gpu.healthy,
            memory_mib=gpu.memory_mib, memory_allocated_mib=memory,
            memory_used_mib=usage.memory_used_mib if usage else None,
            cores_allocated=cores, sm_util_percent=usage.sm_util_percent if usage else None,
            stranded_memory_mib=self.stranded.get(gpu.uuid, 0),
            slices=self.slices.get(gpu.uuid, []),
        )  # fmt: skip

    def node(self, name: str) -> NodeView | None:
        state = self.picture.nodes.get(name)
        if state is None:
            return None
        gpus = sorted(state.inventory.gpus, key=lambda g: g.index)
        return NodeView(
            name=name, state=_state(self.picture, name, self.now),
            silent_s=round(self.picture.silent_s(name, self.now), 1),
            agent_version=state.inventory.agent_version,
            gpus=[self.gpu(name, gpu) for gpu in gpus],
            address=state.inventory.address,
        )  # fmt: skip

    def pod(self, uid: str) -> PodView | None:
        pod = self.picture.pods.get(uid)
        if pod is None:
            return None
        containers = []
        for container in pod.containers.values():
            usage = self.picture.container_usage(pod.node, pod.namespace, pod.name,
                                                 container.container, self.now)  # fmt: skip
            reported = self._container_devices(pod, container.container)
            devices = []
            for piece in container.slices:
                seen = reported.get(piece.uuid)
                devices.append(ContainerDeviceView(
                    uuid=piece.uuid, index=piece.index, memory_mib=piece.memory_mib,
                    cores=piece.cores,
                    memory_limit_mib=seen.memory_limit_mib if seen else piece.memory_mib,
                    cores_limit=seen.cores_limit if seen else piece.cores,
                    memory_used_mib=seen.memory_used_mib if seen else None,
                    sm_util_percent=seen.sm_util_percent if seen else None,
                    measured_mib=seen.measured_mib if seen else None,
                    spilled_mib=seen.spilled_mib if seen else None,
                    **self._flags(pod, container.container, piece.uuid),
                ))  # fmt: skip
            containers.append(ContainerView(
                name=container.container, init=container.init, claimed=container.claimed,
                reporting=usage is not None,
                processes=usage.processes if usage else None,
                launches=usage.launches if usage else None,
                throttled_ms=usage.throttled_ms if usage else None,
                devices=devices,
            ))  # fmt: skip
        return PodView(
            namespace=pod.namespace, name=pod.name, uid=pod.uid, node=pod.node,
            node_state=_state(self.picture, pod.node, self.now), bound_at=pod.bound_at,
            memory_mib=sum(d.memory_mib for c in containers for d in c.devices),
            cores=sum(d.cores for c in containers for d in c.devices),
            containers=containers,
        )  # fmt: skip

    def pending(self, limit: int | None = None) -> list[PendingView]:
        """Pending pods, longest waiting first; only the first `limit` are built."""
        waiting = self.picture.pending.values()
        first_seen = operator.attrgetter("first_seen")
        chosen = (sorted(waiting, key=first_seen) if limit is None
                  else heapq.nsmallest(limit, waiting, key=first_seen))  # fmt: skip
        return [
            PendingView(
                namespace=p.pod.namespace, name=p.pod.name, uid=p.pod.uid,
                waiting_s=round(self.now - p.first_seen, 1), unresolvable=p.pod.unresolvable,
                summary=pending_summary(p.pod.reasons, p.pod.unresolvable),
                requests=p.pod.requests, reasons=p.pod.reasons,
            )
            for p in chosen
        ]  # fmt: skip

    def totals(self, nodes: list[NodeView]) -> Totals:
        totals = Totals(nodes=len(nodes), pods=len(self.picture.pods),
                        pending_pods=len(self.picture.pending),
                        free_memory_mib=self.free_memory_mib,
                        stranded_memory_mib=sum(self.stranded.values()))  # fmt: skip
        for node in nodes:
            totals.nodes_up += node.state == "up"
            for gpu in node.gpus:
                totals.gpus += 1
                totals.gpus_healthy += gpu.healthy
                totals.memory_mib += gpu.memory_mib
                totals.memory_allocated_mib += gpu.memory_allocated_mib
                totals.memory_used_mib += gpu.memory_used_mib or 0
                totals.cores += round(100 * gpu.cores_scaling)
                totals.cores_allocated += gpu.cores_allocated
                totals.slices += len(gpu.slices)
        return totals


def cluster_view(picture: ClusterPicture, now: float | None = None,
                 memory_unit: MemoryUnit = "MiB") -> ClusterView:  # fmt: skip
    """The whole picture, every pending pod included (`bounded` cuts that list for
    people; the exporter counts all of them)."""
    build = _Builder(picture, now)
    nodes = [view for name in sorted(picture.nodes) if (view := build.node(name))]
    pods = [view for uid in picture.pods if (view := build.pod(uid))]
    pods.sort(key=lambda p: (p.namespace, p.name))
    return ClusterView(
        generated_at=time.time(), stale_after_s=picture.stale_after_s,
        totals=build.totals(nodes), nodes=nodes, pods=pods, pending=build.pending(),
        memory_unit=memory_unit,
    )  # fmt: skip


def bounded(view: ClusterView, pending_shown: int) -> ClusterView:
    """The view with at most `pending_shown` pending pods, the longest waiting; the totals
    keep the count of all (a flood of pending pods must not flood the page or the stream)."""
    if len(view.pending) <= pending_shown:
        return view
    return msgspec.structs.replace(view, pending=view.pending[:pending_shown])


def change_view(picture: ClusterPicture, seq: int, nodes: set[str], pods: set[str],
                pending: bool, now: float | None = None,
                pending_shown: int | None = None) -> ChangeView:  # fmt: skip
    """The changed nodes and pods as whole views (small: a node holds a few GPUs), and the
    pending list as shown (at most `pending_shown`) when it changed."""
    build = _Builder(picture, now)
    all_nodes = [view for name in sorted(picture.nodes) if (view := build.node(name))]
    changed_nodes = [view for view in all_nodes if view.name in nodes]
    changed_pods = [view for uid in sorted(pods) if (view := build.pod(uid))]
    return ChangeView(
        seq=seq, generated_at=time.time(), totals=build.totals(all_nodes),
        nodes=changed_nodes, removed_nodes=sorted(n for n in nodes if n not in picture.nodes),
        pods=changed_pods, removed_pods=sorted(u for u in pods if u not in picture.pods),
        pending=build.pending(pending_shown) if pending else None,
    )  # fmt: skip


def find_pod(view: ClusterView, namespace: str, name: str) -> PodView | None:
    return next((p for p in view.pods if p.namespace == namespace and p.name == name), None)


def namespaces_in(view: ClusterView | ChangeView) -> set[str]:
    """Every namespace a view names (pods, pending pods, slices)."""
    found = {pod.namespace for pod in view.pods}
    found.update(p.namespace for p in view.pending or ())
    found.update(s.namespace for node in view.nodes for gpu in node.gpus for s in gpu.slices)
    return found


def visible_view(view: ClusterView, namespaces: set[str]) -> ClusterView:
    """What a caller who may list pods only in `namespaces` sees (docs/security.md, "Who sees
    what"): its own pods, pending pods and slices, and only the GPUs that hold one of its
    slices. A shown GPU keeps its whole-card figures (allocated, used, stranded), as
    `nvidia-smi` in the caller's own container shows them; other tenants' names never appear.
    The totals are over what is shown; the allocated and used figures are the caller's own."""
    nodes = []
    for node in view.nodes:
        gpus = []
        for gpu in node.gpus:
            mine = [s for s in gpu.slices if s.namespace in namespaces]
            if mine:
                gpus.append(msgspec.structs.replace(gpu, slices=mine))
        if gpus:
            nodes.append(msgspec.structs.replace(node, gpus=gpus))
    pods = [p for p in view.pods if p.namespace in namespaces]
    pending = [p for p in view.pending if p.namespace in namespaces]
    totals = Totals(nodes=len(nodes), pods=len(pods), pending_pods=len(pending))
    for node in nodes:
        totals.nodes_up += node.state == "up"
        for gpu in node.gpus:
            totals.gpus += 1
            totals.gpus_healthy += gpu.healthy
            totals.memory_mib += gpu.memory_mib
            totals.cores += 100
            totals.slices += len(gpu.slices)
            totals.memory_allocated_mib += sum(s.memory_mib for s in gpu.slices)
            totals.cores_allocated += sum(s.cores for s in gpu.slices)
            totals.memory_used_mib += sum(s.memory_used_mib or 0 for s in gpu.slices)
            totals.stranded_memory_mib += gpu.stranded_memory_mib
            if gpu.healthy and node.state == "up":
                totals.free_memory_mib += max(0, gpu.memory_mib - gpu.memory_allocated_mib)
    return msgspec.structs.replace(view, nodes=nodes, pods=pods, pending=pending, totals=totals)
