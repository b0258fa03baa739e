"""Removes per-container directories of containers that are gone.

A directory is kept while the kubelet lists a container holding exactly its device IDs
(PodResources `List`), and for `grace_s` after its last Allocate: the kubelet records devices
only after Allocate returns, and it never lists plain init containers, which still need their
directory while they run. When the kubelet cannot be asked, nothing is removed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import grpc
from prometheus_client import Counter

from services.common.tasks import stop_task
from services.nodeagent.grant import container_key

log = logging.getLogger("vgpu.nodeagent")

_KEY = re.compile(r"^[0-9a-f]{16}$")

DIRECTORIES_REMOVED = Counter(
    "vgpu_nodeagent_container_dirs_removed_total",
    "Per-container directories removed after their container was gone",
    ["node"],
)


class HeldDevices(Protocol):
    async def held(self, resource_name: str) -> list[set[str]]: ...


class DirectoryJanitor:
    def __init__(
        self,
        *,
        node_name: str,
        container_root: Path,
        resource_name: str,
        locator: HeldDevices,
        on_remove: Callable[[str], Awaitable[object]],
        grace_s: float,
        interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._node = node_name
        self._root = container_root
        self._resource = resource_name
        self._locator = locator
        self._on_remove = on_remove
        self._grace_s = grace_s
        self._interval_s = interval_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Its sweep loop, while started."""
        return [self._task] if self._task is not None else []

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"janitor-{self._node}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("cleaning container directories failed", extra={"node": self._node})

    async def sweep(self) -> list[str]:
        """Remove what is gone; the keys removed."""
        try:
            held = await self._locator.held(self._resource)
        except grpc.aio.AioRpcError as exc:
            log.info(
                "kubelet not answering; no directory removed",
                extra={"node": self._node, "error": f"{exc.code().name}: {exc.details()}"},
            )
            return []
        live = {container_key(list(ids)) for ids in held}
        if not self._root.is_dir():
            return []
        now = self._clock()
        removed: list[str] = []
        for directory in sorted(self._root.iterdir()):
            if not _KEY.match(directory.name) or directory.name in live:
                continue
            try:
                if not directory.is_dir() or now - directory.stat().st_mtime < self._grace_s:
                    continue
            except OSError:
                continue
            await self._on_remove(directory.name)
            shutil.rmtree(directory, ignore_errors=True)
            DIRECTORIES_REMOVED.labels(node=self._node).inc()
            log.info(
                "container directory removed", extra={"node": self._node, "key": directory.name}
            )
            removed.append(directory.name)
        return removed

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop_task(task, "container janitor", fields={"node": self._node})
