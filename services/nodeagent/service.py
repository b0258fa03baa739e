"""The node agent: device plugin for the kubelet, GPU inventory and usage for NATS."""

from __future__ import annotations

import contextlib
import logging
from importlib import metadata
from pathlib import Path

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import GpuDevice
from services.common.tracing import setup_tracing
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.device_watch import DeviceWatcher
from services.nodeagent.gpus import GpuBackend, backend_for
from services.nodeagent.grant import GrantIssuer
from services.nodeagent.plugin import OPTIONS, DevicePluginServicer
from services.nodeagent.podresources import PodResourcesClient
from services.nodeagent.preferred import PreferenceAdvisor
from services.nodeagent.publisher import Publisher
from services.nodeagent.registration import DevicePluginServer
from services.nodeagent.resolver import AllocationResolver
from services.nodeagent.settings import NodeAgentSettings, check_settings

log = logging.getLogger("vgpu.nodeagent")


def agent_version() -> str:
    try:
        return metadata.version("vgpu")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class NodeAgent:
    """Serves one node. Keeps no placement state: only which GPU each device ID names."""

    def __init__(self, settings: NodeAgentSettings, gpu_backend: GpuBackend | None = None) -> None:
        check_settings(settings)
        subjects.node_token(settings.node_name)  # the name must fit in a NATS subject
        self._settings = settings
        self._backend = gpu_backend or backend_for(settings.node_name, settings.simulate)
        self._stack = contextlib.AsyncExitStack()
        self._plugin_server: DevicePluginServer | None = None
        self._catalog: DeviceCatalog | None = None

    @property
    def node_name(self) -> str:
        return self._settings.node_name

    @property
    def socket_path(self) -> Path:
        return Path(self._settings.plugin_dir) / self._settings.socket_name

    @property
    def gpu_backend(self) -> GpuBackend:
        return self._backend

    @property
    def gpus(self) -> list[GpuDevice]:
        return self._catalog.gpus if self._catalog is not None else self._backend.devices()

    async def start(self) -> None:
        if self._plugin_server is not None:
            return
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        s = self._settings
        setup_tracing("vgpu-nodeagent", s.otlp_endpoint)
        stack = self._stack
        bus = await Bus.connect(s.nats_url, f"vgpu-nodeagent-{s.node_name}")
        stack.push_async_callback(bus.close)
        locator = PodResourcesClient(s.pod_resources_socket)
        stack.push_async_callback(locator.close)
        catalog = DeviceCatalog(self._backend.devices(), s.split_count)
        self._catalog = catalog
        publisher = Publisher(
            bus=bus,
            node_name=s.node_name,
            backend=self._backend,
            catalog=catalog,
            heartbeat_s=s.heartbeat_s,
            usage_interval_s=s.usage_interval_s,
            agent_version=agent_version(),
        )
        await publisher.start()
        stack.push_async_callback(publisher.stop)
        resolver = AllocationResolver(
            node_name=s.node_name,
            resource_name=s.resource_name,
            bus=bus,
            locator=locator,
            resolve_timeout_s=s.resolve_timeout_s,
        )
        stack.push_async_callback(resolver.stop)
        watcher = DeviceWatcher(
            self._backend, catalog, publisher.publish_inventory, s.usage_interval_s
        )
        watcher.start()
        stack.push_async_callback(watcher.stop)
        servicer = DevicePluginServicer(
            node_name=s.node_name,
            catalog=catalog,
            advisor=PreferenceAdvisor(bus, s.node_name, catalog.gpu_of),
            issuer=GrantIssuer(catalog, Path(s.container_root), Path(s.hook_library)),
            resolver=resolver,
        )
        plugin_server = DevicePluginServer(
            servicer,
            plugin_dir=s.plugin_dir,
            socket_name=s.socket_name,
            resource_name=s.resource_name,
            options=OPTIONS,
        )
        stack.push_async_callback(plugin_server.stop)
        stack.push_async_callback(catalog.close)  # runs first on stop: ends ListAndWatch streams
        await plugin_server.start()
        self._plugin_server = plugin_server
        log.info(
            "node agent started",
            extra={
                "node": s.node_name,
                "gpus": len(catalog.gpus),
                "devices": len(catalog.gpus) * s.split_count,
                "socket": str(self.socket_path),
                "driver": self._backend.driver_version(),
            },
        )

    async def wait_registered(self, timeout_s: float = 10.0) -> None:
        if self._plugin_server is None:
            raise RuntimeError("node agent is not started")
        await self._plugin_server.wait_registered(timeout_s)

    async def stop(self) -> None:
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        self._plugin_server = None
        await stack.aclose()
