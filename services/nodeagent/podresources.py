"""Client of the kubelet's PodResources v1 API: which container holds these device IDs?"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.kubelet import podresources_v1_pb2 as pr
from services.common.kubelet import podresources_v1_pb2_grpc as pr_grpc

_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the kubelet's own client limit


@dataclass(frozen=True)
class ContainerRef:
    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def holders_of(
    response: pr.ListPodResourcesResponse, resource_name: str, device_ids: set[str]
) -> list[ContainerRef]:
    """Containers whose devices of `resource_name` are exactly `device_ids`.

    The kubelet splits one container's devices into several entries (one per NUMA node), so
    entries are joined before comparing.
    """
    found: list[ContainerRef] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            held = {
                device_id
                for devices in container.devices
                if devices.resource_name == resource_name
                for device_id in devices.device_ids
            }
            if held == device_ids:
                found.append(ContainerRef(pod.namespace, pod.name, container.name))
    return found


class PodResourcesClient:
    def __init__(self, socket_path: str, call_timeout_s: float = 2.0) -> None:
        self._channel = grpc.aio.insecure_channel(
            f"unix://{socket_path}",
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)],
        )
        self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        self._timeout_s = call_timeout_s

    async def holders(self, resource_name: str, device_ids: set[str]) -> list[ContainerRef]:
        """Raises grpc.aio.AioRpcError when the kubelet does not answer."""
        response = await self._stub.List(pr.ListPodResourcesRequest(), timeout=self._timeout_s)
        return holders_of(response, resource_name, device_ids)

    async def held(self, resource_name: str) -> list[set[str]]:
        """Raises grpc.aio.AioRpcError when the kubelet does not answer."""
        response = await self._stub.List(pr.ListPodResourcesRequest(), timeout=self._timeout_s)
        return held_device_sets(response, resource_name)

    async def close(self) -> None:
        await self._channel.close()


def held_device_sets(response: pr.ListPodResourcesResponse, resource_name: str) -> list[set[str]]:
    """Every listed container's device IDs of `resource_name` (non-empty sets only)."""
    found: list[set[str]] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            held = {
                device_id
                for devices in container.devices
                if devices.resource_name == resource_name
                for device_id in devices.device_ids
            }
            if held:
                found.append(held)
    return found
