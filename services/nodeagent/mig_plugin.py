"""The DevicePlugin servicer of one static MIG resource (`nvidia.com/mig-1g.5gb` under mixed,
`nvidia.com/gpu` under single): NVIDIA's behaviour, device for device.

Device IDs are the MIG UUIDs (`<MIG uuid>::<n>` replicas for a profile resource_config
shares); health is per MIG device (a MIG device is unhealthy when it or
its GPU is); the list follows the node's MIG geometry (a new ListAndWatch answer whenever it
changes). Allocate hands the MIG UUIDs to the runtime as the node's device list strategy
says. MIG isolates in hardware, so no hook, limit file or allocator claim is involved:
kube-scheduler counts these resources itself, as with NVIDIA's plugin.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.schemas import GpuDevice
from services.common.tracing import context_from_traceparent, tracer
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.grant import CDI_ANNOTATION_PREFIX, VISIBLE_DEVICES_ENV
from services.nodeagent.mig_resources import MigEntry, mig_uuid_of
from services.nodeagent.plugin import HEALTHY, UNHEALTHY, _traceparent

log = logging.getLogger("vgpu.nodeagent")
_tracer = tracer("vgpu.nodeagent")

MIG_ALLOCATE_CALLS = Counter(
    "vgpu_nodeagent_mig_allocate_calls_total",
    "Allocate calls for static MIG resources by resource and outcome",
    ["node", "resource", "outcome"],
)

MIG_OPTIONS = pb.DevicePluginOptions(
    pre_start_required=False, get_preferred_allocation_available=True
)


def mig_socket_name(resource: str) -> str:
    """`vgpu-mig-1g.5gb.sock` for nvidia.com/mig-1g.5gb (NVIDIA: nvidia-mig-1g.5gb.sock)."""
    return f"vgpu-{resource.rpartition('/')[2]}.sock"


def mig_device_list(entries: list[MigEntry]) -> pb.ListAndWatchResponse:
    devices = []
    for entry in entries:
        numa = entry.parent.numa_node
        for device_id in entry.device_ids():
            devices.append(
                pb.Device(
                    ID=device_id,
                    health=HEALTHY if entry.healthy else UNHEALTHY,
                    topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)]) if numa >= 0 else None,
                )
            )
    return pb.ListAndWatchResponse(devices=devices)


def mig_container_response(
    mig_uuids: list[str], strategy: str, cdi_kind: str
) -> pb.ContainerAllocateResponse:
    """The runtime's view of the MIG devices: NVIDIA_VISIBLE_DEVICES=MIG-..., or CDI names."""
    cdi_names = [f"{cdi_kind}={mig_uuid}" for mig_uuid in mig_uuids]
    if strategy == "cdi-cri":
        return pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name=n) for n in cdi_names])
    if strategy == "cdi-annotations":
        key = CDI_ANNOTATION_PREFIX + "mig_" + mig_uuids[0].removeprefix("MIG-")[:16]
        return pb.ContainerAllocateResponse(annotations={key: ",".join(cdi_names)})
    return pb.ContainerAllocateResponse(envs={VISIBLE_DEVICES_ENV: ",".join(mig_uuids)})


def distributed_pick(
    available: list[str], must_include: list[str], size: int, parent_of: dict[str, str]
) -> list[str]:
    """NVIDIA's `distributed` pick for MIG: the must-include devices, then devices of the
    GPUs with the fewest MIG devices already taken, in the order offered."""
    picked = list(dict.fromkeys(must_include))[:size]
    offered = set(available)
    taken: dict[str, int] = {}
    for device, parent in parent_of.items():
        if device not in offered or device in picked:
            taken[parent] = taken.get(parent, 0) + 1
    rest = [d for d in available if d not in picked]
    while len(picked) < size and rest:
        best = min(rest, key=lambda d: taken.get(parent_of.get(d, ""), 0))
        picked.append(best)
        rest.remove(best)
        parent = parent_of.get(best, "")
        taken[parent] = taken.get(parent, 0) + 1
    return picked


class MigDevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        *,
        node_name: str,
        resource: str,
        catalog: DeviceCatalog,
        entries: Callable[[list[GpuDevice]], list[MigEntry]],
        device_list_strategy: str,
        cdi_kind: str,
    ) -> None:
        self._node = node_name
        self._resource = resource
        self._catalog = catalog
        self._entries = entries
        self._strategy = device_list_strategy
        self._cdi_kind = cdi_kind

    def current(self) -> list[MigEntry]:
        return self._entries(self._catalog.gpus)

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return MIG_OPTIONS

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        sent: pb.ListAndWatchResponse | None = None
        while True:
            seen = self._catalog.generation
            answer = mig_device_list(self.current())
            if answer != sent:  # the GPUs changed, maybe not this resource's devices
                yield answer
                sent = answer
            if not await self._catalog.wait_for_change(seen):
                return

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        # Spread over GPUs (NVIDIA's distributed); replicas of a shared MIG device spread over
        # MIG devices first, the least-shared first, as time-slicing does over GPUs.
        parent_of = {
            device_id: entry.device.uuid if entry.replicas > 1 else entry.parent.uuid
            for entry in self.current()
            for device_id in entry.device_ids()
        }
        answers = [
            pb.ContainerPreferredAllocationResponse(
                deviceIDs=distributed_pick(
                    list(wanted.available_deviceIDs),
                    list(wanted.must_include_deviceIDs),
                    wanted.allocation_size,
                    parent_of,
                )
            )
            for wanted in request.container_requests
        ]
        return pb.PreferredAllocationResponse(container_responses=answers)

    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateResponse:
        parent = context_from_traceparent(_traceparent(context))
        with _tracer.start_as_current_span(
            "device-plugin Allocate (MIG)", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attribute("vgpu.resource", self._resource)
            known = {d: entry for entry in self.current() for d in entry.device_ids()}
            answers = []
            for position, wanted in enumerate(request.container_requests):
                ids = list(wanted.devices_ids)
                problem = "names no device IDs" if not ids else ""
                unknown = [d for d in ids if d not in known]
                if unknown:
                    problem = (
                        f"unknown MIG device {unknown[0]!r}: not a {self._resource} device "
                        f"of node {self._node}"
                    )
                if problem:
                    MIG_ALLOCATE_CALLS.labels(self._node, self._resource, "invalid").inc()
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"container request {position}: {problem}"
                    )
                # Two replicas of one shared MIG device are still that one device.
                mig_uuids = list(dict.fromkeys(mig_uuid_of(d) for d in ids))
                answers.append(mig_container_response(mig_uuids, self._strategy, self._cdi_kind))
                log.info(
                    "allocated MIG devices",
                    extra={
                        "node": self._node,
                        "resource": self._resource,
                        "device_ids": ids,
                        "mig_devices": mig_uuids,
                        "gpus": sorted({known[d].parent.uuid for d in ids}),
                    },
                )
            MIG_ALLOCATE_CALLS.labels(self._node, self._resource, "ok").inc()
            return pb.AllocateResponse(container_responses=answers)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
