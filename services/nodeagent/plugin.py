"""The kubelet-facing DevicePlugin gRPC servicer: wire messages in and out, nothing more."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.tracing import context_from_traceparent, tracer
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.dynamic_mig import DynamicMig, DynamicMigError
from services.nodeagent.grant import ContainerGrant, GrantIssuer
from services.nodeagent.preferred import PreferenceAdvisor, spread_pick
from services.nodeagent.resolver import AllocateCall, AllocationResolver

log = logging.getLogger("vgpu.nodeagent")
_tracer = tracer("vgpu.nodeagent")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

ALLOCATE_CALLS = Counter(
    "vgpu_nodeagent_allocate_calls_total", "Allocate calls by outcome", ["node", "outcome"]
)
PREFERRED_ANSWERS = Counter(
    "vgpu_nodeagent_preferred_allocations_total",
    "GetPreferredAllocation answers by where the pick came from",
    ["node", "source"],
)

OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent" and isinstance(value, str):
            return value
    return ""


def device_list(catalog: DeviceCatalog) -> pb.ListAndWatchResponse:
    devices = []
    for advertised in catalog.devices():
        gpu = advertised.gpu
        topology = (
            pb.TopologyInfo(nodes=[pb.NUMANode(ID=gpu.numa_node)]) if gpu.numa_node >= 0 else None
        )
        devices.append(
            pb.Device(
                ID=advertised.device_id,
                health=HEALTHY if gpu.healthy else UNHEALTHY,
                topology=topology,
            )
        )
    return pb.ListAndWatchResponse(devices=devices)


def container_response(grant: ContainerGrant) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=grant.envs,
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in grant.mounts
        ],
        annotations=grant.annotations,
        cdi_devices=[pb.CDIDevice(name=name) for name in grant.cdi_devices],
        devices=[
            pb.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in grant.devices
        ],
    )


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        *,
        node_name: str,
        catalog: DeviceCatalog,
        advisor: PreferenceAdvisor,
        issuer: GrantIssuer,
        resolver: AllocationResolver,
        resolve_unhooked: bool = True,
        dynamic_mig: DynamicMig | None = None,
    ) -> None:
        # Containers on time-slicing/mps/exclusive GPUs of a resource the allocator does not
        # book (a renamed one, e.g. nvidia.com/gpu.shared) have no decision to claim.
        self._resolve_unhooked = resolve_unhooked
        self._dynamic_mig = dynamic_mig
        self._node = node_name
        self._catalog = catalog
        self._advisor = advisor
        self._issuer = issuer
        self._resolver = resolver

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return OPTIONS

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        while True:
            seen = self._catalog.generation
            yield device_list(self._catalog)
            if not await self._catalog.wait_for_change(seen):
                return  # the agent is stopping: end the stream cleanly

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        parent = context_from_traceparent(_traceparent(context))
        answers = []
        with _tracer.start_as_current_span(
            "device-plugin GetPreferredAllocation", context=parent, kind=trace.SpanKind.SERVER
        ):
            for wanted in request.container_requests:
                available = list(wanted.available_deviceIDs)
                must_include = list(wanted.must_include_deviceIDs)
                size = wanted.allocation_size
                try:
                    picked, source = await self._advisor.choose(available, must_include, size)
                except Exception:  # a hint is optional: never fail the kubelet's call
                    log.exception(
                        "preferred allocation failed; spreading", extra={"node": self._node}
                    )
                    picked = spread_pick(available, must_include, size, self._catalog.gpu_of)
                    source = "fallback"
                PREFERRED_ANSWERS.labels(node=self._node, source=source).inc()
                answers.append(pb.ContainerPreferredAllocationResponse(deviceIDs=picked))
        return pb.PreferredAllocationResponse(container_responses=answers)

    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateResponse:
        started = time.time_ns()
        grants: list[ContainerGrant] = []
        for position, wanted in enumerate(request.container_requests):
            try:
                grants.append(self._issuer.issue(list(wanted.devices_ids)))
            except ValueError as exc:  # UnknownDeviceError included: names the bad ID
                ALLOCATE_CALLS.labels(node=self._node, outcome="invalid").inc()
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"container request {position}: {exc}"
                )
            except OSError as exc:
                ALLOCATE_CALLS.labels(node=self._node, outcome="error").inc()
                log.error(
                    "cannot prepare container directory",
                    extra={"node": self._node, "error": str(exc)},
                )
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"cannot prepare container directory: {exc}"
                )
            dynamic = self._dynamic_mig
            if dynamic is not None and dynamic.serves(grants[-1]):
                try:  # the MIG instances exist before the container is told their UUIDs
                    grants[-1] = await dynamic.prepare(grants[-1])
                except DynamicMigError as exc:
                    ALLOCATE_CALLS.labels(node=self._node, outcome="mig_refused").inc()
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION, f"container request {position}: {exc}"
                    )
        response = pb.AllocateResponse(container_responses=[container_response(g) for g in grants])
        ended = time.time_ns()
        caller = _traceparent(context)
        for grant in grants:
            log.info(
                "allocated",
                extra={
                    "node": self._node,
                    "device_ids": list(grant.device_ids),
                    "gpus": list(grant.gpu_uuids),
                    "key": grant.key,
                },
            )
            if grant.hooked or self._resolve_unhooked:
                self._resolver.track(AllocateCall(grant, started, ended, caller))
        ALLOCATE_CALLS.labels(node=self._node, outcome="ok").inc()
        return response

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
