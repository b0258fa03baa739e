"""Serve the plugin socket, then register it with the kubelet (in that order: the kubelet
dials the plugin while handling Register), and do both again whenever the kubelet restarts.

A restarting kubelet wipes the plugin directory and re-creates `kubelet.sock`; it forgets
every plugin. The supervisor polls the two sockets (a stat every `watch_interval_s`, which is
cheap and works on every filesystem, unlike inotify inside some container runtimes): when
`kubelet.sock` is a new file, or our own socket is gone, it serves a fresh socket and
registers again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc
from prometheus_client import Counter

from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.tasks import stop_task

log = logging.getLogger("vgpu.nodeagent")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"

REGISTRATIONS = Counter(
    "vgpu_nodeagent_registrations_total",
    "Successful registrations with the kubelet (more than one: the kubelet restarted)",
    ["node"],
)

FileIdentity = tuple[int, int, int]  # device, inode, ctime: a re-created file differs


def file_identity(path: Path) -> FileIdentity | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_ctime_ns)


class DevicePluginServer:
    def __init__(
        self,
        servicer: pb_grpc.DevicePluginServicer,
        *,
        plugin_dir: str,
        socket_name: str,
        resource_name: str,
        options: pb.DevicePluginOptions,
        node_name: str = "",
        retry_s: float = 0.5,
        watch_interval_s: float = 1.0,
    ) -> None:
        self._servicer = servicer
        self._plugin_dir = Path(plugin_dir)
        self._socket_name = socket_name
        self._resource = resource_name
        self._options = options
        self._node = node_name
        self._retry_s = retry_s
        self._watch_s = watch_interval_s
        self._server: grpc.aio.Server | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()
        self.registrations = 0

    @property
    def resource_name(self) -> str:
        return self._resource

    @property
    def socket_path(self) -> Path:
        return self._plugin_dir / self._socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self._plugin_dir / KUBELET_SOCKET

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The loop that registers with the kubelet and serves again after a kubelet restart."""
        return [self._supervisor] if self._supervisor is not None else []

    async def start(self) -> None:
        await self._serve()
        self._supervisor = asyncio.create_task(self._supervise(), name="device-plugin-supervisor")

    async def _serve(self) -> None:
        """(Re)start the gRPC server on a fresh socket file."""
        await self._stop_server(0.5)
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)  # stale socket of an earlier run
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot serve the device plugin on {self.socket_path}")
        await server.start()
        self._server = server
        log.info("device plugin serving", extra={"socket": str(self.socket_path)})

    async def _supervise(self) -> None:
        while True:
            kubelet = await self._register_until_accepted()
            while True:
                await asyncio.sleep(self._watch_s)
                now = file_identity(self.kubelet_socket)
                if not self.socket_path.exists():
                    log.warning(
                        "plugin socket removed (kubelet restart?); serving and registering again",
                        extra={"socket": str(self.socket_path)},
                    )
                    break
                if now is not None and now != kubelet:
                    log.warning(
                        "kubelet.sock was re-created (kubelet restart); registering again",
                        extra={"kubelet_socket": str(self.kubelet_socket)},
                    )
                    break
            self.registered.clear()
            try:
                await self._serve()
            except OSError:
                log.exception("cannot serve the device plugin again; retrying")
                await asyncio.sleep(self._retry_s)

    async def _register_until_accepted(self) -> FileIdentity | None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self._socket_name,  # relative to the plugin directory, as the kubelet wants
            resource_name=self._resource,
            options=self._options,
        )
        attempt = 0
        while True:
            attempt += 1
            identity = file_identity(self.kubelet_socket)
            error = await self._register_once(request)
            if error is None:
                self.registrations += 1
                REGISTRATIONS.labels(node=self._node).inc()
                self.registered.set()
                log.info(
                    "registered with the kubelet",
                    extra={
                        "resource": self._resource,
                        "kubelet_socket": str(self.kubelet_socket),
                        "registrations": self.registrations,
                    },
                )
                return identity
            if attempt == 1 or attempt % 20 == 0:
                log.warning(
                    "kubelet registration failed; retrying",
                    extra={"attempt": attempt, "error": error, "socket": str(self.kubelet_socket)},
                )
            await asyncio.sleep(min(self._retry_s * attempt, 5.0))

    async def _register_once(self, request: pb.RegisterRequest) -> str | None:
        if not self.kubelet_socket.exists():
            return f"{self.kubelet_socket} does not exist yet"
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            try:
                await pb_grpc.RegistrationStub(channel).Register(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
        return None

    async def wait_registered(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self.registered.wait()
        except TimeoutError:
            raise TimeoutError(
                f"device plugin not registered with the kubelet at {self.kubelet_socket} "
                f"within {timeout_s}s"
            ) from None

    async def _stop_server(self, grace_s: float) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
            self.socket_path.unlink(missing_ok=True)

    async def stop(self, grace_s: float = 1.0) -> None:
        task, self._supervisor = self._supervisor, None
        if task is not None:
            await stop_task(
                task,
                "device plugin supervisor",
                fields={"node": self._node, "resource": self._resource},
            )
        await self._stop_server(grace_s)
