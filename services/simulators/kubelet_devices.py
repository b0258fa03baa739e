"""The kubelet's device manager, simulated: Registration server side and plugin clients.

As in the kubelet, Register validates the request, dials the plugin's socket and asks for its
options before answering; the ListAndWatch stream then runs in the background and keeps the
latest device list per resource.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.tasks import stop_task

log = logging.getLogger("vgpu.kubeletsim")

SUPPORTED_VERSIONS = ("v1beta1",)
HEALTHY = "Healthy"

Metadata = tuple[tuple[str, str], ...]


class RegistrationError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PluginEndpoint:
    """The kubelet's client of one device plugin (one resource)."""

    def __init__(self, resource: str, socket_path: Path) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.options = pb.DevicePluginOptions()
        self.devices: dict[str, pb.Device] = {}  # in the plugin's order
        self.connected = False
        self.has_list = False
        self._channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        self._stub = pb_grpc.DevicePluginStub(self._channel)
        self._watch: asyncio.Task[None] | None = None

    async def connect(self, timeout_s: float, on_update: asyncio.Condition) -> None:
        """Dial, fetch options, start watching; grpc errors propagate."""
        async with asyncio.timeout(timeout_s):
            await self._channel.channel_ready()
        self.options = await self._stub.GetDevicePluginOptions(pb.Empty(), timeout=timeout_s)
        self.connected = True
        self._watch = asyncio.create_task(self._list_and_watch(on_update))

    async def _list_and_watch(self, on_update: asyncio.Condition) -> None:
        try:
            async for response in self._stub.ListAndWatch(pb.Empty()):
                async with on_update:
                    self.devices = {device.ID: device for device in response.devices}
                    self.has_list = True
                    on_update.notify_all()
                log.info(
                    "device list received",
                    extra={"resource": self.resource, "devices": len(response.devices)},
                )
            log.warning("ListAndWatch ended by the plugin", extra={"resource": self.resource})
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "ListAndWatch failed",
                extra={"resource": self.resource, "code": exc.code().name, "error": exc.details()},
            )
        finally:
            self.connected = False

    def healthy_ids(self) -> list[str]:
        return [d.ID for d in self.devices.values() if d.health == HEALTHY]

    def numa_nodes(self, device_id: str) -> list[int]:
        device = self.devices.get(device_id)
        if device is None or not device.HasField("topology"):
            return []
        return [node.ID for node in device.topology.nodes]

    async def preferred(
        self, available: list[str], must_include: list[str], size: int, metadata: Metadata
    ) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        response = await self._stub.GetPreferredAllocation(request, timeout=10, metadata=metadata)
        if not response.container_responses:
            return []
        return list(response.container_responses[0].deviceIDs)

    async def allocate(self, device_ids: list[str], metadata: Metadata) -> pb.AllocateResponse:
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)]
        )
        return await self._stub.Allocate(request, timeout=10, metadata=metadata)

    async def close(self) -> None:
        task, self._watch = self._watch, None
        if task is not None:
            await stop_task(task, "ListAndWatch client", fields={"resource": self.resource})
        self.connected = False
        await self._channel.close()


def _check_request(request: pb.RegisterRequest) -> None:
    if request.version not in SUPPORTED_VERSIONS:
        raise RegistrationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"requested device plugin version {request.version!r} is not supported. "
            f"Supported versions are {list(SUPPORTED_VERSIONS)}",
        )
    domain, sep, name = request.resource_name.partition("/")
    if not sep or not domain or not name or domain.endswith("kubernetes.io"):
        raise RegistrationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the ResourceName {request.resource_name!r} is invalid: "
            "expected an extended resource such as vendor.com/device",
        )
    endpoint = request.endpoint
    if not endpoint or "/" in endpoint or endpoint in (".", ".."):
        raise RegistrationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"endpoint {endpoint!r} must be the plugin socket's file name, "
            "relative to the device plugin directory",
        )


class DeviceRegistry:
    """Registered plugins by resource name."""

    def __init__(self, plugin_dir: Path, dial_timeout_s: float = 5.0) -> None:
        self._plugin_dir = plugin_dir
        self._dial_timeout_s = dial_timeout_s
        self._endpoints: dict[str, PluginEndpoint] = {}
        self._changed = asyncio.Condition()

    def endpoint(self, resource: str) -> PluginEndpoint | None:
        return self._endpoints.get(resource)

    @property
    def resources(self) -> list[str]:
        return list(self._endpoints)

    async def register(self, request: pb.RegisterRequest) -> None:
        _check_request(request)
        socket_path = self._plugin_dir / request.endpoint
        if not socket_path.is_socket():
            raise RegistrationError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot reach device plugin at {socket_path}: no socket there",
            )
        endpoint = PluginEndpoint(request.resource_name, socket_path)
        try:
            await endpoint.connect(self._dial_timeout_s, self._changed)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            await endpoint.close()
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
            raise RegistrationError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot reach device plugin at {endpoint.socket_path}: {detail}",
            ) from exc
        old = self._endpoints.get(request.resource_name)
        async with self._changed:
            self._endpoints[request.resource_name] = endpoint
            self._changed.notify_all()
        if old is not None:
            await old.close()
        log.info(
            "device plugin registered",
            extra={"resource": request.resource_name, "endpoint": request.endpoint},
        )

    async def wait_for_resource(self, resource: str, timeout_s: float) -> PluginEndpoint:
        def ready() -> bool:
            endpoint = self._endpoints.get(resource)
            return endpoint is not None and endpoint.has_list

        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(ready)
        except TimeoutError:
            raise TimeoutError(
                f"no device plugin for {resource} registered and listed devices within {timeout_s}s"
            ) from None
        return self._endpoints[resource]

    async def close(self) -> None:
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            await endpoint.close()


class RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, registry: DeviceRegistry) -> None:
        self._registry = registry

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        try:
            await self._registry.register(request)
        except RegistrationError as exc:
            log.warning(
                "registration refused",
                extra={"resource": request.resource_name, "error": str(exc)},
            )
            await context.abort(exc.code, str(exc))
        return pb.Empty()
