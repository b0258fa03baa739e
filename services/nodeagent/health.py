"""GPU health from XID critical-error events, as NVIDIA's device plugin judges it.

XIDs that an application causes (13 graphics engine exception, 31 memory page fault, 43 GPU
stopped processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch
timeout) are ignored by default: they mean "that program crashed", not "this GPU is broken".
Any other XID marks the GPU unhealthy until the agent restarts; an event that names no GPU
marks every GPU. The mark is applied on top of the backend's own view (a lost GPU is already
unhealthy there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from prometheus_client import Counter

from services.common.schemas import GpuDevice
from services.nodeagent.gpus.backend import GpuBackend, HealthEvent

log = logging.getLogger("vgpu.nodeagent")

DEFAULT_IGNORED_XIDS = "13,31,43,45,68,109"

XID_EVENTS = Counter(
    "vgpu_nodeagent_xid_events_total",
    "XID critical-error events by what the agent did about them",
    ["node", "xid", "action"],
)


def parse_xids(text: str) -> frozenset[int]:
    """ "13, 31,43" -> {13, 31, 43}; ValueError naming the bad entry."""
    found: set[int] = set()
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if not entry.isdigit():
            raise ValueError(f"ignored_xids: {entry!r} is not an XID number (expected e.g. 13,31)")
        found.add(int(entry))
    return frozenset(found)


class HealthMarks:
    """GPUs the agent has judged unhealthy, applied over the backend's device list."""

    def __init__(self) -> None:
        self._uuids: set[str] = set()
        self._all = False

    def mark(self, uuid: str) -> bool:
        """True when this changed anything."""
        if uuid == "":
            changed, self._all = not self._all, True
            return changed
        if self._all or uuid in self._uuids:
            return False
        self._uuids.add(uuid)
        return True

    def apply(self, gpus: list[GpuDevice]) -> list[GpuDevice]:
        """The GPUs with the marks applied; a marked MIG device (its `MIG-` UUID) turns only
        that device unhealthy, as NVIDIA's plugin matches MIG events to their instance."""
        return [self._apply_one(gpu) for gpu in gpus]

    def _apply_one(self, gpu: GpuDevice) -> GpuDevice:
        if gpu.healthy and (self._all or gpu.uuid in self._uuids):
            gpu = msgspec.structs.replace(gpu, healthy=False)
        if any(m.healthy and m.uuid in self._uuids for m in gpu.mig_devices):
            marked = [
                msgspec.structs.replace(m, healthy=False) if m.uuid in self._uuids else m
                for m in gpu.mig_devices
            ]
            gpu = msgspec.structs.replace(gpu, mig_devices=marked)
        return gpu


class HealthMonitor:
    """Waits for XID events in a worker thread and marks GPUs; `on_change` re-reads devices."""

    def __init__(
        self,
        *,
        node_name: str,
        backend: GpuBackend,
        marks: HealthMarks,
        ignored_xids: frozenset[int],
        on_change: Callable[[], Awaitable[object]],
        wait_s: float = 0.25,
    ) -> None:
        self._node = node_name
        self._backend = backend
        self._marks = marks
        self._ignored = ignored_xids
        self._on_change = on_change
        self._wait_s = wait_s
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"xid-monitor-{self._node}")

    async def handle(self, event: HealthEvent) -> bool:
        """Apply the policy to one event; True when a GPU was newly marked unhealthy."""
        fields = {"node": self._node, "gpu": event.uuid or "all", "xid": event.xid}
        if event.xid in self._ignored:
            XID_EVENTS.labels(node=self._node, xid=str(event.xid), action="ignored").inc()
            log.info("application XID ignored", extra=fields)
            return False
        XID_EVENTS.labels(node=self._node, xid=str(event.xid), action="unhealthy").inc()
        log.error("XID critical error: marking GPU unhealthy", extra=fields)
        if not self._marks.mark(event.uuid):
            return False
        await self._on_change()
        return True

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            try:
                event = await asyncio.to_thread(self._backend.wait_for_health_event, self._wait_s)
                failures = 0
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning(
                        "waiting for XID events failed; retrying",
                        extra={"node": self._node, "error": str(exc), "failures": failures},
                    )
                await asyncio.sleep(min(5.0, self._wait_s * failures))
                continue
            if event is not None:
                try:
                    await self.handle(event)
                except Exception:
                    log.exception("handling an XID event failed", extra={"node": self._node})

    async def stop(self) -> None:
        """Let the worker thread's bounded wait finish, so NVML is never closed under it."""
        self._stopping = True
        task, self._task = self._task, None
        if task is None:
            return
        try:
            async with asyncio.timeout(self._wait_s + 5.0):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
