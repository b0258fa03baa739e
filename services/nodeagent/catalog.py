"""The node's GPUs and the device IDs advertised for them: the only state the agent keeps.

Watchers (ListAndWatch streams) wait on `wait_for_change`; `close` wakes them for good so the
streams end cleanly when the agent stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.common.schemas import GpuDevice
from services.nodeagent.device_ids import DeviceIdError, make_device_id, parse_device_id
from services.nodeagent.modes import ModePlan


class UnknownDeviceError(ValueError):
    pass


@dataclass(frozen=True)
class AdvertisedDevice:
    device_id: str
    gpu: GpuDevice


def _every_gpu(gpu: GpuDevice) -> bool:
    return True


class DeviceCatalog:
    """`plan` gives each GPU its sharing mode and its number of device IDs (modes.py);
    without one every GPU is a vgpu GPU with `split_count` IDs."""

    def __init__(
        self,
        gpus: list[GpuDevice],
        split_count: int,
        plan: ModePlan | None = None,
        advertise: Callable[[GpuDevice], bool] = _every_gpu,
    ) -> None:
        self._advertise = advertise
        self._split_count = split_count
        self._plan = plan or ModePlan(split_count=split_count)
        gpus = self._plan.annotate(gpus)
        self._gpus = list(gpus)
        self._by_uuid = {gpu.uuid: gpu for gpu in gpus}
        self.generation = 0
        self._closed = False
        self._changed = asyncio.Condition()

    @property
    def gpus(self) -> list[GpuDevice]:
        return list(self._gpus)

    @property
    def split_count(self) -> int:
        return self._split_count

    def devices(self) -> list[AdvertisedDevice]:
        return [
            AdvertisedDevice(make_device_id(gpu.uuid, replica), gpu)
            for gpu in self._gpus
            if self._advertise(gpu)
            for replica in range(gpu.replicas or self._split_count)
        ]

    def gpu_of(self, device_id: str) -> GpuDevice:
        """The GPU behind a device ID this node advertises; UnknownDeviceError otherwise."""
        try:
            parsed = parse_device_id(device_id)
        except DeviceIdError as exc:
            raise UnknownDeviceError(str(exc)) from exc
        gpu = self._by_uuid.get(parsed.gpu_uuid)
        if (
            gpu is None
            or parsed.replica >= (gpu.replicas or self._split_count)
            or not self._advertise(gpu)
        ):
            raise UnknownDeviceError(f"unknown device ID {device_id!r}: not advertised here")
        return gpu

    async def update(self, gpus: list[GpuDevice]) -> bool:
        """Take a fresh view of the GPUs; wake watchers and return True if anything changed."""
        gpus = self._plan.annotate(gpus)
        if gpus == self._gpus:
            return False
        async with self._changed:
            self._gpus = list(gpus)
            self._by_uuid = {gpu.uuid: gpu for gpu in gpus}
            self.generation += 1
            self._changed.notify_all()
        return True

    async def wait_for_change(self, seen_generation: int) -> bool:
        """Wait until the generation moves past `seen_generation`; False once closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._closed or self.generation != seen_generation)
            return not self._closed

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
