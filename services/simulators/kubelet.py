"""A kubelet for one node, simulated at its device-plugin and PodResources edges.

It speaks the real wire protocols (Registration, DevicePlugin client, PodResourcesLister v1
on unix sockets), so the node agent cannot tell it from a real kubelet, and it admits pods
the way the kubelet's device manager does. `vgpu up` uses it for local clusters; its HTTP API
serves `vgpu submit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import grpc
import msgspec
from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from services.common.http_server import serve
from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.kubelet import podresources_v1_pb2_grpc as pr_grpc
from services.common.tracing import tracer
from services.common.vitals import Vitals
from services.simulators.kubelet_admission import Admitter
from services.simulators.kubelet_checkpoint import (
    CHECKPOINT_FILE,
    CheckpointEntry,
    DeviceCheckpoint,
    devices_per_numa,
)
from services.simulators.kubelet_devices import DeviceRegistry, RegistrationServicer
from services.simulators.kubelet_http import build_app
from services.simulators.kubelet_podresources import PodResourcesServicer
from services.simulators.kubelet_pods import PodError, parse_pod
from services.simulators.kubelet_records import AdmitResult, PodRecords

log = logging.getLogger("vgpu.kubeletsim")
_tracer = tracer("vgpu.kubeletsim")

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = CHECKPOINT_FILE  # the one file a restarting kubelet keeps

__all__ = ["AdmitResult", "KubeletSimSettings", "KubeletSimulator", "PodError"]


class KubeletSimSettings(msgspec.Struct, kw_only=True, frozen=True):
    node_name: str
    plugin_dir: str = "/var/lib/kubelet/device-plugins"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    http_host: str = "127.0.0.1"
    http_port: int = 0
    # Resources the node advertises as device-plugin resources: a pod asking for one while
    # no plugin serves it fails admission instead of silently getting no devices.
    device_resources: tuple[str, ...] = ("nvidia.com/gpu",)


def _clear_socket(socket_path: Path) -> None:
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)  # stale socket of an earlier run


async def _serve(servicer_adder: Any, servicer: Any, socket_path: Path) -> grpc.aio.Server:
    _clear_socket(socket_path)
    server = grpc.aio.server()
    servicer_adder(servicer, server)
    if server.add_insecure_port(f"unix://{socket_path}") == 0:
        raise OSError(f"cannot serve on {socket_path}")
    await server.start()
    return server


def _server_name(socket_path: Path) -> str:
    return f"the gRPC server on {socket_path.name}"


class KubeletSimulator:
    def __init__(self, settings: KubeletSimSettings) -> None:
        if not settings.node_name:
            raise ValueError("node_name must be set")
        self._settings = settings
        self._plugin_dir = Path(settings.plugin_dir)
        self._registry = DeviceRegistry(self._plugin_dir)
        self._records = PodRecords()
        self._checkpoint = DeviceCheckpoint(self._plugin_dir / CHECKPOINT, self._healthy_devices)
        self._admitting: list[tuple[str, str, str]] = []  # entries of the pod being admitted
        self._admitter = Admitter(
            settings.node_name,
            self._registry,
            self._records,
            settings.device_resources,
            on_allocated=self._allocated,
        )
        self._admit_lock = asyncio.Lock()  # the kubelet admits one pod at a time
        self._servers: list[tuple[grpc.aio.Server, Path]] = []
        self._runner: web.AppRunner | None = None
        self._port = 0
        # Its gRPC servers: one terminating unasked is a crash (`vgpu up` restarts it).
        self.vitals = Vitals(f"kubelet simulator {settings.node_name}")

    @property
    def node_name(self) -> str:
        return self._settings.node_name

    @property
    def kubelet_socket(self) -> Path:
        return self._plugin_dir / KUBELET_SOCKET

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("kubelet simulator is not started")
        return f"http://{self._settings.http_host}:{self._port}"

    async def start(self) -> None:
        if self._runner is not None:
            return
        try:
            pod_resources = Path(self._settings.pod_resources_socket)
            servicer = PodResourcesServicer(self._records, self._registry)
            server = await _serve(
                pr_grpc.add_PodResourcesListerServicer_to_server, servicer, pod_resources
            )
            self._servers.append((server, pod_resources))
            registration = RegistrationServicer(self._registry)
            server = await _serve(
                pb_grpc.add_RegistrationServicer_to_server, registration, self.kubelet_socket
            )
            self._servers.append((server, self.kubelet_socket))
            self.vitals = Vitals(f"kubelet simulator {self.node_name}")
            for server, socket_path in self._servers:
                self.vitals.watch_awaitable(
                    _server_name(socket_path), server.wait_for_termination()
                )
            # A restart keeps the HTTP port, so `vgpu submit` finds the kubelet again.
            self._runner, self._port = await serve(
                build_app(self), self._settings.http_host, self._port or self._settings.http_port
            )
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kubelet simulator started",
            extra={
                "node": self.node_name,
                "kubelet_socket": str(self.kubelet_socket),
                "url": self.url,
            },
        )

    async def wait_died(self) -> str:
        """Until one of its gRPC servers terminates unasked (it crashed); which."""
        return await self.vitals.died()

    async def stop(self) -> None:
        ended = {what for what, task in self.vitals.tasks().items() if task.done()}
        self.vitals.stop()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        servers, self._servers = self._servers, []
        for server, socket_path in servers:
            # A server that already terminated (it crashed) never finishes a second stop.
            if _server_name(socket_path) not in ended:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await server.stop(0.5)
            socket_path.unlink(missing_ok=True)
        await self._registry.close()

    async def restart(self) -> None:
        """As a kubelet restart: every plugin is forgotten, the plugin directory is wiped
        (the kubelet keeps only its checkpoint) and `kubelet.sock` is created anew. Admitted
        pods survive, as in the kubelet's checkpoint."""
        await self.stop()
        if self._plugin_dir.is_dir():
            for entry in self._plugin_dir.iterdir():
                if entry.name != CHECKPOINT and not entry.is_dir():
                    entry.unlink(missing_ok=True)
        await self.start()

    async def wait_for_resource(self, name: str, timeout: float = 10.0) -> list[str]:
        """Wait until a plugin for `name` registered and listed devices; their IDs."""
        endpoint = await self._registry.wait_for_resource(name, timeout)
        return list(endpoint.devices)

    def devices(self, resource: str) -> dict[str, str]:
        """The latest device list of `resource`: device ID -> health."""
        endpoint = self._registry.endpoint(resource)
        return {} if endpoint is None else {d.ID: d.health for d in endpoint.devices.values()}

    def topology(self, resource: str, device_id: str) -> list[int]:
        endpoint = self._registry.endpoint(resource)
        return [] if endpoint is None else endpoint.numa_nodes(device_id)

    def resources(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for resource in self._registry.resources:
            endpoint = self._registry.endpoint(resource)
            if endpoint is not None:
                found[resource] = {
                    "connected": endpoint.connected,
                    "devices": len(endpoint.devices),
                    "healthy": len(endpoint.healthy_ids()),
                    "allocated": len(self._records.in_use(resource)),
                }
        return found

    async def admit(self, pod_json: Any) -> AdmitResult:
        """Admit a v1.Pod (JSON form). PodError for a malformed pod; an AdmitResult with
        `error` set when admission fails (the pod then holds nothing)."""
        pod = parse_pod(pod_json)
        with _tracer.start_as_current_span(f"kubelet admit {pod.namespace}/{pod.name}") as span:
            span.set_attribute("k8s.node.name", self.node_name)
            async with self._admit_lock:
                self._admitting = []
                result = await self._admitter.admit(pod)
                if result.error:
                    self._forget_checkpoint(self._admitting)  # a failed pod keeps nothing
            if result.error:
                span.set_status(Status(StatusCode.ERROR, result.error))
            return result

    def remove(self, namespace: str, name: str) -> bool:
        """Forget a pod and free its devices; False if it was not admitted."""
        record = self._records.get(namespace, name)
        removed = self._records.remove(namespace, name)
        if removed:
            log.info("pod removed", extra={"pod": f"{namespace}/{name}"})
        if record is not None:
            self._forget_checkpoint(
                [(record.uid, c.name, r) for c in record.containers for r in c.devices]
            )
        return removed

    def checkpoint_entries(self) -> list[CheckpointEntry]:
        """What `kubelet_internal_checkpoint` holds now."""
        return self._checkpoint.entries()

    def _allocated(
        self,
        pod_uid: str,
        container: str,
        resource: str,
        devices: dict[str, list[int]],
        response: pb.ContainerAllocateResponse,
    ) -> None:
        """After each container's Allocate, as the kubelet: record it in the checkpoint."""
        self._admitting.append((pod_uid, container, resource))
        self._checkpoint.allocated(
            CheckpointEntry(
                pod_uid=pod_uid,
                container=container,
                resource=resource,
                devices=devices_per_numa(devices),
                alloc_resp=response.SerializeToString(deterministic=True),
            )
        )

    def _forget_checkpoint(self, keys: list[tuple[str, str, str]]) -> None:
        try:
            self._checkpoint.forget(keys)
        except OSError as exc:
            log.error(
                "cannot write the device checkpoint",
                extra={"path": str(self._checkpoint.path), "error": str(exc)},
            )

    def _healthy_devices(self) -> dict[str, list[str]]:
        """RegisteredDevices of the checkpoint: every resource's healthy device IDs."""
        found: dict[str, list[str]] = {}
        for resource in self._registry.resources:
            endpoint = self._registry.endpoint(resource)
            if endpoint is not None:
                found[resource] = list(endpoint.healthy_ids())
        return found

    def pods(self) -> list[AdmitResult]:
        return [record.result for record in self._records.pods()]
