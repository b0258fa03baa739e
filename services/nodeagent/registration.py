"""Serve the plugin socket, then register it with the kubelet (in that order: the kubelet
dials the plugin while handling Register)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc

from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = logging.getLogger("vgpu.nodeagent")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


class DevicePluginServer:
    def __init__(
        self,
        servicer: pb_grpc.DevicePluginServicer,
        *,
        plugin_dir: str,
        socket_name: str,
        resource_name: str,
        options: pb.DevicePluginOptions,
        retry_s: float = 0.5,
    ) -> None:
        self._servicer = servicer
        self._plugin_dir = Path(plugin_dir)
        self._socket_name = socket_name
        self._resource = resource_name
        self._options = options
        self._retry_s = retry_s
        self._server: grpc.aio.Server | None = None
        self._register_task: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()

    @property
    def socket_path(self) -> Path:
        return self._plugin_dir / self._socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self._plugin_dir / KUBELET_SOCKET

    async def start(self) -> None:
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)  # stale socket of an earlier run
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot serve the device plugin on {self.socket_path}")
        await server.start()
        self._server = server
        log.info("device plugin serving", extra={"socket": str(self.socket_path)})
        self._register_task = asyncio.create_task(self._register_until_accepted())

    async def _register_until_accepted(self) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self._socket_name,  # relative to the plugin directory, as the kubelet wants
            resource_name=self._resource,
            options=self._options,
        )
        attempt = 0
        while True:
            attempt += 1
            error = await self._register_once(request)
            if error is None:
                self.registered.set()
                log.info(
                    "registered with the kubelet",
                    extra={"resource": self._resource, "kubelet_socket": str(self.kubelet_socket)},
                )
                return
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
            await asyncio.wait_for(self.registered.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"device plugin not registered with the kubelet at {self.kubelet_socket} "
                f"within {timeout_s}s"
            ) from None

    async def stop(self, grace_s: float = 1.0) -> None:
        task, self._register_task = self._register_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
            self.socket_path.unlink(missing_ok=True)
