"""PodResourcesLister v1 served from the simulated kubelet's records, shaped as the kubelet
shapes them (a container's devices grouped per NUMA node; plain init containers omitted)."""

from __future__ import annotations

import grpc

from services.common.kubelet import podresources_v1_pb2 as pr
from services.common.kubelet import podresources_v1_pb2_grpc as pr_grpc
from services.simulators.kubelet_devices import DeviceRegistry
from services.simulators.kubelet_records import ContainerRecord, PodRecord, PodRecords

NO_TOPOLOGY = -1


def _topology(numa: int) -> pr.TopologyInfo | None:
    return None if numa == NO_TOPOLOGY else pr.TopologyInfo(nodes=[pr.NUMANode(ID=numa)])


def container_devices(container: ContainerRecord) -> list[pr.ContainerDevices]:
    found: list[pr.ContainerDevices] = []
    for resource, devices in container.devices.items():
        by_numa: dict[int, list[str]] = {}
        for device_id, numa_nodes in devices.items():
            for numa in numa_nodes or [NO_TOPOLOGY]:
                by_numa.setdefault(numa, []).append(device_id)
        for numa, ids in by_numa.items():
            found.append(
                pr.ContainerDevices(
                    resource_name=resource, device_ids=ids, topology=_topology(numa)
                )
            )
    return found


def pod_resources(pod: PodRecord) -> pr.PodResources:
    return pr.PodResources(
        name=pod.name,
        namespace=pod.namespace,
        containers=[
            pr.ContainerResources(name=c.name, devices=container_devices(c))
            for c in pod.containers
            if c.listed
        ],
    )


class PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, records: PodRecords, registry: DeviceRegistry) -> None:
        self._records = records
        self._registry = registry

    async def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(
            pod_resources=[pod_resources(pod) for pod in self._records.pods()]
        )

    async def Get(
        self, request: pr.GetPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        pod = self._records.get(request.pod_namespace, request.pod_name)
        if pod is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return pr.GetPodResourcesResponse(pod_resources=pod_resources(pod))

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        devices: list[pr.ContainerDevices] = []
        for resource in self._registry.resources:
            endpoint = self._registry.endpoint(resource)
            if endpoint is None:
                continue
            for device_id in endpoint.devices:
                for numa in endpoint.numa_nodes(device_id) or [NO_TOPOLOGY]:
                    devices.append(
                        pr.ContainerDevices(
                            resource_name=resource,
                            device_ids=[device_id],
                            topology=_topology(numa),
                        )
                    )
        return pr.AllocatableResourcesResponse(devices=devices)
