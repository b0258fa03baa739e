"""The relay: one unix socket per container directory, hook reports in, utilisation out.

The agent listens on `relay.sock` in the container's state directory (the container sees it
at /var/run/vgpu-state/relay.sock) once it knows whose directory it is, so
whatever arrives there speaks for that container and nobody else: names sent by the hook are
never trusted, and device indexes are checked against the container's own limits. A bad line
(oversized, not UTF-8, malformed, out of order, a figure larger than the device) closes that
one connection and is counted by reason; nothing a hook sends can stop the agent. Each
container may hold `max_connections` connections (16 by default, one per CUDA process); more
are refused and counted, and the refusals are logged at most once a minute per container.
What the hooks report is republished as ContainerUsage, at
most once per `publish_interval_s` per container, with the SM share NVML measured for the
container's processes; containers without a hook connection are published from NVML alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from services.common import subjects
from services.common.bus import Bus
from services.common.rate_log import RateLimitedLog
from services.common.schemas import ContainerDeviceUsage, ContainerUsage, GpuUsage
from services.common.tasks import stop_task
from services.nodeagent.container_files import state_dir
from services.nodeagent.containers import ResolvedContainer
from services.nodeagent.process_map import ContainerFigures, DeviceFigures, ProcessAttributor
from services.nodeagent.relay_protocol import (
    MAX_LINE_BYTES,
    Exit,
    Hello,
    HookMessage,
    RelayProtocolError,
    Usage,
    UtilDevice,
    decode_line,
    encode_util,
)

log = logging.getLogger("vgpu.nodeagent")

SOCKET_NAME = "relay.sock"
MAX_CONNECTIONS_PER_CONTAINER = 16  # one per CUDA process; more is a runaway container
# No hook can report more memory than this on one device whose size the agent does not know
# (1 PiB in MiB): a last bound, so that no figure like 10^12 MiB ever reaches the metrics.
UNKNOWN_DEVICE_CEILING_MIB = 1 << 30
REFUSAL_LOG_INTERVAL_S = 60.0
MAX_PENDING_UTIL_BYTES = 16 * 1024  # a hook that does not read gets no more util lines

RELAY_REJECTED = Counter(
    "vgpu_nodeagent_relay_rejected_total",
    "Relay connections closed for a bad message",
    ["node", "reason"],
)
RELAY_MESSAGES = Counter(
    "vgpu_nodeagent_relay_messages_total", "Relay messages accepted", ["node", "type"]
)
RELAY_CONNECTIONS = Gauge("vgpu_nodeagent_relay_connections", "Open relay connections", ["node"])


def peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The connecting process's PID in the agent's PID namespace (the host's, in a DaemonSet
    with hostPID), from SO_PEERCRED."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, _, _ = struct.unpack("3i", raw)
    return pid or None


@dataclass(eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    peer_pid: int | None
    hello: Hello | None = None
    last: Usage | None = None
    exited: bool = False


def open_to_all(socket_path: Path) -> None:
    """chmod 0666 the socket the agent just bound, and nothing else: the directory is the
    container's to write, so the name may have been swapped for a symlink meanwhile. The
    inode is pinned with O_PATH|O_NOFOLLOW and changed through /proc/self/fd."""
    fd = os.open(socket_path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(f"{socket_path} is no longer the agent's socket")
        os.chmod(f"/proc/self/fd/{fd}", 0o666)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class HookClaims:
    """What a container's hooks say about themselves, for the agent to check (verify.py)."""

    hellos: list[tuple[int | None, Hello]]  # (host PID of the peer, its hello), live ones
    used_mib: dict[int, int]  # container ordinal -> the latest container total reported
    reported_at: float  # time.monotonic() of the latest usage report; 0 = none yet


@dataclass(eq=False)
class _Listener:
    container: ResolvedContainer
    server: asyncio.Server
    path: Path
    connections: set[_Connection] = field(default_factory=set)
    used_mib: dict[int, int] = field(default_factory=dict)  # container ordinal -> latest total
    spilled_mib: dict[int, int] = field(default_factory=dict)  # of that, spilled (latest)
    nvml: dict[str, DeviceFigures] = field(default_factory=dict)
    reported_at: float = 0.0  # monotonic time of the latest usage report
    flags: dict[str, str] = field(default_factory=dict)  # GPU uuid -> standing violations
    dirty: bool = True
    published: bool = False  # a report went out: its changes (a finding ending) must too

    def reporting(self) -> list[_Connection]:
        return [c for c in self.connections if c.hello is not None and not c.exited]


class RelayHub:
    def __init__(
        self,
        *,
        node_name: str,
        bus: Bus,
        host_index: dict[str, int] | None = None,
        attributor: ProcessAttributor | None = None,
        publish_interval_s: float = 1.0,
        util_interval_s: float = 0.5,
        device_memory_mib: dict[str, int] | None = None,
        max_connections: int = MAX_CONNECTIONS_PER_CONTAINER,
    ) -> None:
        self._node = node_name
        self._bus = bus
        self._host_index = host_index or {}
        self._device_memory = dict(device_memory_mib or {})  # GPU uuid -> physical MiB
        self._max_connections = max_connections
        self._refusals = RateLimitedLog(log, REFUSAL_LOG_INTERVAL_S)
        self._attributor = attributor
        self._publish_s = publish_interval_s
        self._util_s = util_interval_s
        self._listeners: dict[str, _Listener] = {}
        self._gpu_usage: dict[str, GpuUsage] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()

    def set_host_index(self, host_index: dict[str, int]) -> None:
        self._host_index = dict(host_index)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self._publish_s, self.flush), name="relay-flush"),
            asyncio.create_task(self._every(self._util_s, self.send_util), name="relay-util"),
        ]

    async def _every(self, interval_s: float, action: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except Exception:
                log.exception("relay task failed", extra={"node": self._node})

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await stop_task(task, task.get_name(), fields={"node": self._node})
        for key in list(self._listeners):
            await self.close(key)

    # -- per-container sockets --------------------------------------------------------------

    @property
    def containers(self) -> list[ResolvedContainer]:
        return [listener.container for listener in self._listeners.values()]

    def container(self, key: str) -> ResolvedContainer | None:
        listener = self._listeners.get(key)
        return None if listener is None else listener.container

    async def open(self, container: ResolvedContainer) -> Path:
        """Listen on the container's relay socket (again: the owner may have changed)."""
        existing = self._listeners.get(container.key)
        if existing is not None:
            if existing.container == container:
                return existing.path
            await self.close(container.key)
        path = state_dir(container.host_dir) / SOCKET_NAME
        path.unlink(missing_ok=True)
        holder: list[_Listener] = []

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.add(task)
            try:
                await self._serve_connection(holder[0], reader, writer)
            finally:
                if task is not None:
                    self._handlers.discard(task)

        server = await asyncio.start_unix_server(on_connect, path=str(path), limit=MAX_LINE_BYTES)
        try:
            open_to_all(path)  # the container's processes may run as any user
        except OSError:
            server.close()
            raise
        listener = _Listener(container=container, server=server, path=path)
        holder.append(listener)
        self._listeners[container.key] = listener
        return path

    async def close(self, key: str) -> None:
        listener = self._listeners.pop(key, None)
        if listener is None:
            return
        listener.server.close()
        for connection in list(listener.connections):
            connection.writer.close()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=1.0)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
        # lands as wait_closed() returns, and the janitor cancelled here ran on forever.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await listener.server.wait_closed()
        listener.path.unlink(missing_ok=True)
        if self._attributor is not None:
            self._attributor.forget(key)

    # -- one connection -----------------------------------------------------------------------

    async def _serve_connection(
        self, listener: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        container = listener.container
        if len(listener.connections) >= self._max_connections:
            self._reject(
                container,
                "too_many_connections",
                f"the container already holds {len(listener.connections)} connections "
                f"(the limit, setting relay_max_connections)",
            )
            writer.close()
            return
        connection = _Connection(writer, peer_pid(writer))
        listener.connections.add(connection)
        RELAY_CONNECTIONS.labels(node=self._node).inc()
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    break  # the hook went away (a half line at exit is not an offence)
                except asyncio.LimitOverrunError:
                    self._reject(container, "oversized", f"line over {MAX_LINE_BYTES} bytes")
                    break
                except ConnectionError:
                    break
                try:
                    message = self._check(container, connection, line)
                except RelayProtocolError as exc:
                    self._reject(container, exc.reason, str(exc))
                    break
                self._accept(listener, connection, message)
        finally:
            listener.connections.discard(connection)
            listener.dirty = True
            RELAY_CONNECTIONS.labels(node=self._node).dec()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _check(
        self, container: ResolvedContainer, connection: _Connection, line: bytes
    ) -> HookMessage:
        message = decode_line(line)
        if connection.hello is None and not isinstance(message, Hello):
            raise RelayProtocolError("malformed", f"first message must be hello, got {message}")
        if connection.hello is not None and isinstance(message, Hello):
            raise RelayProtocolError("malformed", "a second hello on one connection")
        count = len(container.limits.devices)
        indexes = [d.index for d in getattr(message, "devices", [])]
        bad = [i for i in indexes if i >= count]
        if bad:
            raise RelayProtocolError(
                "malformed", f"device index {bad[0]} is out of range: the container has {count}"
            )
        self._check_sizes(container, message)
        return message

    def _ceiling_mib(self, container: ResolvedContainer, index: int) -> int:
        """The most memory a hook may report on the container's device `index`: the device's
        size, or the container's limit where that is larger (oversubscribed memory)."""
        limit = container.limits.devices[index]
        size = self._device_memory.get(limit.uuid, 0)
        if not size and not limit.memory_limit_mib:
            return UNKNOWN_DEVICE_CEILING_MIB
        return max(size, limit.memory_limit_mib)

    def _check_sizes(self, container: ResolvedContainer, message: HookMessage) -> None:
        """Refuse usage figures no device of this container can hold (10^12 MiB and the
        like): they would be published as the container's usage."""
        if not isinstance(message, Usage):
            return  # a hello's limits are not relayed: verify.py compares them (tampering)
        for device in message.devices:
            figures = (
                ("used_mib", device.used_mib),
                ("process_used_mib", device.process_used_mib),
            )
            ceiling = self._ceiling_mib(container, device.index)
            for name, value in figures:
                if value > ceiling:
                    raise RelayProtocolError(
                        "over_device_size",
                        f"devices[{device.index}].{name} = {value} MiB is more than the "
                        f"device holds ({ceiling} MiB)",
                    )

    def _accept(self, listener: _Listener, connection: _Connection, message: HookMessage) -> None:
        RELAY_MESSAGES.labels(node=self._node, type=type(message).__name__.lower()).inc()
        listener.dirty = True
        if isinstance(message, Hello):
            connection.hello = message
            if connection.peer_pid is not None and self._attributor is not None:
                self._attributor.learn(connection.peer_pid, listener.container.key)
            log.info(
                "hook connected",
                extra={
                    "node": self._node,
                    "container": listener.container.name,
                    "pid": message.pid,
                    "host_pid": connection.peer_pid,
                    "comm": message.comm,
                },
            )
        elif isinstance(message, Usage):
            connection.last = message
            listener.reported_at = time.monotonic()
            for device in message.devices:
                listener.used_mib[device.index] = device.used_mib
                # The hook's word, bounded by its own total: spilled memory is part of it.
                listener.spilled_mib[device.index] = min(device.spilled_mib, device.used_mib)
        elif isinstance(message, Exit):
            connection.exited = True

    def _reject(self, container: ResolvedContainer, reason: str, message: str) -> None:
        RELAY_REJECTED.labels(node=self._node, reason=reason).inc()
        limits = container.limits
        self._refusals.warning(
            (container.key, reason),
            "relay connection refused: " + message,
            {
                "node": self._node,
                "pod": f"{limits.namespace}/{limits.pod}",
                "container": limits.container,
                "reason": reason,
            },
        )

    # -- NVML figures in, ContainerUsage and util out ----------------------------------------

    def peers(self) -> dict[int, str]:
        """Host PID -> directory key, for every live relay peer."""
        return {
            c.peer_pid: key
            for key, listener in self._listeners.items()
            for c in listener.reporting()
            if c.peer_pid is not None
        }

    def claims(self, key: str) -> HookClaims | None:
        listener = self._listeners.get(key)
        if listener is None:
            return None
        return HookClaims(
            hellos=[(c.peer_pid, c.hello) for c in listener.reporting() if c.hello is not None],
            used_mib=dict(listener.used_mib),
            reported_at=listener.reported_at,
        )

    def set_flags(self, key: str, flags: dict[str, str]) -> None:
        """The verifier's standing findings per GPU uuid, published with the usage."""
        listener = self._listeners.get(key)
        if listener is not None and listener.flags != flags:
            listener.flags = dict(flags)
            listener.dirty = True

    def observe(self, gpu_usage: list[GpuUsage], figures: ContainerFigures) -> None:
        """The latest NVML sample: whole-GPU usage and per-container process figures."""
        self._gpu_usage = {usage.uuid: usage for usage in gpu_usage}
        for key, listener in self._listeners.items():
            mine = figures.get(key, {})
            if mine != listener.nvml:
                listener.dirty = True
            listener.nvml = mine

    def usage_of(self, key: str) -> ContainerUsage | None:
        listener = self._listeners.get(key)
        return None if listener is None else self._usage(listener)

    def _usage(self, listener: _Listener) -> ContainerUsage:
        container = listener.container
        reporting = listener.reporting()
        devices = []
        for ordinal, limit in enumerate(container.limits.devices):
            measured = listener.nvml.get(limit.uuid)
            spilled = 0
            if reporting:
                used = listener.used_mib.get(ordinal, 0)
                spilled = listener.spilled_mib.get(ordinal, 0)
            else:
                used = measured.memory_used_mib if measured else 0
            devices.append(
                ContainerDeviceUsage(
                    uuid=limit.uuid,
                    index=self._host_index.get(limit.uuid, -1),
                    memory_used_mib=used,
                    memory_limit_mib=limit.memory_limit_mib,
                    cores_limit=limit.cores,
                    sm_util_percent=measured.sm_util_percent if measured else -1.0,
                    measured_mib=measured.memory_used_mib if measured else -1,
                    violation=listener.flags.get(limit.uuid, ""),
                    spilled_mib=spilled,
                )
            )
        lasts = [c.last for c in reporting if c.last is not None]
        nvml_pids = max((f.pids for f in listener.nvml.values()), default=0)
        return ContainerUsage(
            node=self._node,
            namespace=container.limits.namespace,
            pod=container.limits.pod,
            container=container.limits.container,
            devices=devices,
            processes=len(reporting) if reporting else nvml_pids,
            launches=sum(last.launches for last in lasts),
            throttled_ms=sum(last.throttled_ms for last in lasts),
        )

    def resend_all(self) -> None:
        """Publish every container again at the next flush (the bus lost what was sent)."""
        for listener in self._listeners.values():
            listener.dirty = True

    async def flush(self) -> int:
        """Publish every container that changed since the last flush; how many were sent."""
        sent = 0
        for listener in list(self._listeners.values()):
            if not listener.dirty:
                continue
            quiet = not listener.connections and not listener.nvml and not listener.used_mib
            if quiet and not listener.published:
                listener.dirty = False
                continue  # nothing ever ran in it: nothing to say
            listener.dirty = False
            listener.published = True
            await self._bus.publish(subjects.container_usage(self._node), self._usage(listener))
            sent += 1
        return sent

    async def send_util(self) -> None:
        for listener in self._listeners.values():
            reporting = listener.reporting()
            if not reporting:
                continue
            devices = []
            for ordinal, limit in enumerate(listener.container.limits.devices):
                whole = self._gpu_usage.get(limit.uuid)
                mine = listener.nvml.get(limit.uuid)
                devices.append(
                    UtilDevice(
                        index=ordinal,
                        sm_util_percent=whole.sm_util_percent if whole else -1.0,
                        container_sm_util_percent=mine.sm_util_percent if mine else -1.0,
                    )
                )
            line = encode_util(devices)
            for connection in reporting:
                transport = connection.writer.transport
                if (
                    transport.is_closing()
                    or transport.get_write_buffer_size() > MAX_PENDING_UTIL_BYTES
                ):
                    continue  # never let a hook that does not read grow our memory
                connection.writer.write(line)
