"""Publishes the node's inventory (on start, on change, every heartbeat) and GPU usage."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import GpuDevice, GpuUsage, NodeInventory, NodeUsage
from services.common.tasks import stop_task
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.gpus.backend import GpuBackend, GpuProcess

# Called with every usage sample, e.g. to attribute processes to containers.
SampleSink = Callable[[list[GpuUsage], list[GpuProcess]], Awaitable[None]]

log = logging.getLogger("vgpu.nodeagent")


async def _every(interval_s: float, action: Callable[[], Awaitable[None]], what: str) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await action()
        except Exception:  # keep the loop alive; NATS reconnects by itself
            log.exception(f"{what} failed")


@dataclass(frozen=True)
class HostCapacity:
    """The node's allocatable CPU (milli), memory (MiB) and pods, as stated in the inventory
    (0 = not stated: the allocator reads the Node object in a cluster)."""

    cpu_milli: int = 0
    memory_mib: int = 0
    pods: int = 0


@dataclass(frozen=True)
class GpuSharing:
    """How this node shares each of its GPUs, stated in the inventory for the allocator
    (0 = not stated: the allocator's own settings apply)."""

    memory_scaling: float = 0.0
    cores_scaling: float = 0.0
    split_count: int = 0

    def describe(self, gpus: list[GpuDevice]) -> list[GpuDevice]:
        return [
            msgspec.structs.replace(
                gpu,
                memory_scaling=self.memory_scaling,
                cores_scaling=self.cores_scaling,
                split_count=self.split_count,
            )
            for gpu in gpus
        ]


class Publisher:
    def __init__(
        self,
        *,
        sharing: GpuSharing | None = None,
        bus: Bus,
        node_name: str,
        backend: GpuBackend,
        catalog: DeviceCatalog,
        heartbeat_s: float,
        usage_interval_s: float,
        agent_version: str,
        on_sample: SampleSink | None = None,
        host: HostCapacity | None = None,
        address: str = "",
    ) -> None:
        self._host = host or HostCapacity()
        self._address = address
        self._sharing = sharing or GpuSharing()
        self._bus = bus
        self._node = node_name
        self._backend = backend
        self._catalog = catalog
        self._heartbeat_s = heartbeat_s
        self._usage_interval_s = usage_interval_s
        self._agent_version = agent_version
        self._on_sample = on_sample
        self._seq = 0
        self._lock = asyncio.Lock()  # one publication at a time keeps seq in send order
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The heartbeat and usage loops, while started."""
        return list(self._tasks)

    async def start(self) -> None:
        await self.publish_inventory()
        await self.publish_usage()
        self._tasks = [
            asyncio.create_task(_every(self._heartbeat_s, self.publish_inventory, "inventory")),
            asyncio.create_task(_every(self._usage_interval_s, self.publish_usage, "usage")),
        ]

    async def publish_inventory(self) -> None:
        async with self._lock:
            self._seq += 1
            inventory = NodeInventory(
                node=self._node,
                gpus=self._sharing.describe(self._catalog.gpus),
                agent_version=self._agent_version,
                heartbeat_s=self._heartbeat_s,
                seq=self._seq,
                driver_version=self._backend.driver_version(),
                cuda_version=self._backend.cuda_version(),
                cpu_milli=self._host.cpu_milli,
                host_memory_mib=self._host.memory_mib,
                max_pods=self._host.pods,
                address=self._address,
            )
            await self._bus.publish(subjects.inventory(self._node), inventory)

    def _sample(self) -> tuple[list[GpuUsage], list[GpuProcess]]:
        processes = self._backend.processes() if self._on_sample is not None else []
        return self._backend.usage(), processes

    async def publish_usage(self) -> None:
        gpus, processes = await asyncio.to_thread(self._sample)  # NVML calls block
        await self._bus.publish(subjects.usage(self._node), NodeUsage(node=self._node, gpus=gpus))
        if self._on_sample is not None:
            await self._on_sample(gpus, processes)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await stop_task(task, "heartbeat loop", fields={"node": self._node})
