"""Re-reads the GPUs' health from the backend and propagates changes (ListAndWatch, NATS)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.common.schemas import GpuDevice
from services.common.tasks import stop_task
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.gpus.backend import GpuBackend
from services.nodeagent.health import HealthMarks

log = logging.getLogger("vgpu.nodeagent")


class DeviceWatcher:
    def __init__(
        self,
        backend: GpuBackend,
        catalog: DeviceCatalog,
        on_change: Callable[[], Awaitable[None]],
        interval_s: float,
        marks: HealthMarks | None = None,
        view: Callable[[list[GpuDevice]], list[GpuDevice]] | None = None,
        node_name: str = "",
    ) -> None:
        self._node = node_name  # named in its log lines
        self._backend = backend
        self._catalog = catalog
        self._on_change = on_change
        self._interval_s = interval_s
        self._marks = marks or HealthMarks()
        # What the agent makes of the backend's list (health marks, dynamic-MIG marks).
        self._view = view or self._marks.apply
        self._lock = asyncio.Lock()  # the poll and the XID monitor may refresh at once
        self._task: asyncio.Task[None] | None = None

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Its poll loop, while started."""
        return [self._task] if self._task is not None else []

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def current(self) -> list[GpuDevice]:
        return self._view(self._backend.devices())

    async def refresh(self) -> bool:
        """Take the backend's current view; True when it changed (watchers were woken)."""
        async with self._lock:
            gpus = await asyncio.to_thread(self.current)  # NVML calls block
            if not await self._catalog.update(gpus):
                return False
        log.info(
            "GPU set or health changed",
            extra={
                "node": self._node,
                "gpus": [gpu.uuid for gpu in gpus],
                "unhealthy": [gpu.uuid for gpu in gpus if not gpu.healthy],
            },
        )
        await self._on_change()
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("reading GPU health failed", extra={"node": self._node})

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop_task(task, "device watch", fields={"node": self._node})
