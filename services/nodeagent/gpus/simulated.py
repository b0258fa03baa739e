"""Simulated GPUs for laptops, CI and `vgpu up`: a spec such as "2xA100-40GB,1xT4".

UUIDs are uuid5(node name, index), so an agent restarted on the same node advertises the same
device IDs. Utilisation follows a smooth deterministic wave per GPU (see `usage`), so graphs
move without randomness and tests can pin the clock; `set_usage` pins it per GPU instead.
Faults for demos and tests: `inject_xid` (goes through the same health policy as NVML's XID
events), `remove_gpu` (the GPU stops answering) and `set_healthy`. A model missing from the
table can be given inline as `<count>x<name>:<memory MiB>:<SMs>`.
"""

from __future__ import annotations

import math
import queue
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from services.common.schemas import GpuDevice, GpuUsage
from services.nodeagent.gpus.backend import GpuProcess, HealthEvent


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_mib: int
    sm_count: int
    compute_capability: str = ""


MODELS: dict[str, GpuModel] = {
    model.name.upper(): model
    for model in (
        GpuModel("A100-40GB", 40960, 108, "8.0"),
        GpuModel("A100-80GB", 81920, 108, "8.0"),
        GpuModel("H100-80GB", 81559, 132, "9.0"),
        GpuModel("H200", 143771, 132, "9.0"),
        GpuModel("V100-16GB", 16160, 80, "7.0"),
        GpuModel("V100-32GB", 32510, 80, "7.0"),
        GpuModel("T4", 15360, 40, "7.5"),
        GpuModel("A10", 22731, 72, "8.6"),
        GpuModel("L4", 23034, 58, "8.9"),
    )
}

_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://vgpu.io/simulated-gpu")
SIMULATED_DRIVER_VERSION = "550.54.15-sim"
SIMULATED_CUDA_VERSION = "12.4"
_SPEC_PART = re.compile(r"^(?P<count>\d+)\s*[xX]\s*(?P<model>\S+)$")
_INLINE_MODEL = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+):(?P<memory>\d+):(?P<sms>\d+)$")
# Period of the synthetic utilisation wave; GPUs are phase-shifted so they differ.
USAGE_PERIOD_S = 120.0


def parse_spec(spec: str) -> list[GpuModel]:
    """One GpuModel per simulated GPU, in index order; ValueError names the bad part."""
    if not spec or not spec.strip():
        raise ValueError("empty GPU spec: expected e.g. '4xA100-40GB' or '2xA100-40GB,1xT4'")
    gpus: list[GpuModel] = []
    for raw in spec.split(","):
        part = raw.strip()
        matched = _SPEC_PART.match(part)
        if matched is None:
            raise ValueError(
                f"bad GPU spec part {part!r}: expected <count>x<model>, e.g. 4xA100-40GB"
            )
        count, model_name = int(matched["count"]), matched["model"]
        if count < 1:
            raise ValueError(f"bad GPU spec part {part!r}: count must be at least 1")
        model = MODELS.get(model_name.upper())
        inline = _INLINE_MODEL.match(model_name)
        if model is None and inline is not None:
            model = GpuModel(inline["name"], int(inline["memory"]), int(inline["sms"]))
            if model.memory_mib < 1:
                raise ValueError(f"bad GPU spec part {part!r}: memory must be at least 1 MiB")
        if model is None:
            known = ", ".join(m.name for m in MODELS.values())
            raise ValueError(
                f"bad GPU spec part {part!r}: unknown model {model_name!r} (known: {known}; "
                "or give <name>:<memory MiB>:<SMs>)"
            )
        gpus.extend([model] * count)
    return gpus


def simulated_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}')}"


class SimulatedGpuBackend:
    """A GpuBackend over simulated GPUs, with utilisation and faults under the caller's control."""

    def __init__(self, node_name: str, spec: str, clock: Callable[[], float] = time.time) -> None:
        models = parse_spec(spec)
        self._clock = clock
        count = len(models)
        self._devices = [
            GpuDevice(
                uuid=simulated_uuid(node_name, index),
                index=index,
                model=model.name,
                memory_mib=model.memory_mib,
                sm_count=model.sm_count,
                numa_node=index * 2 // count,  # first half of the GPUs on NUMA 0, rest on 1
                healthy=True,
                pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
                compute_capability=model.compute_capability,
            )
            for index, model in enumerate(models)
        ]
        self._pinned: dict[str, GpuUsage] = {}
        self._processes: dict[tuple[int, str], GpuProcess] = {}
        self._events: queue.Queue[HealthEvent] = queue.Queue()
        self._removed: set[str] = set()

    def _position(self, gpu_uuid: str) -> int:
        for position, device in enumerate(self._devices):
            if device.uuid == gpu_uuid:
                return position
        raise ValueError(f"no simulated GPU with uuid {gpu_uuid!r}")

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        position = self._position(gpu_uuid)
        self._devices[position] = msgspec.structs.replace(self._devices[position], healthy=healthy)

    def remove_gpu(self, gpu_uuid: str) -> None:
        """The GPU falls off the bus: it stays listed, unhealthy, and reports no usage."""
        self.set_healthy(gpu_uuid, False)
        self._removed.add(gpu_uuid)
        self._pinned.pop(gpu_uuid, None)
        self._processes = {k: p for k, p in self._processes.items() if p.uuid != gpu_uuid}

    def inject_xid(self, gpu_uuid: str, xid: int) -> None:
        """Deliver an XID event as NVML would; the agent's health policy decides what it means."""
        if gpu_uuid:
            self._position(gpu_uuid)
        self._events.put(HealthEvent(uuid=gpu_uuid, xid=xid))

    def wait_for_health_event(self, timeout_s: float) -> HealthEvent | None:
        try:
            return self._events.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None

    def set_usage(
        self, gpu_uuid: str, sm_util_percent: float, memory_used_mib: int, memory_util: float = 0.0
    ) -> None:
        """Pin a GPU's utilisation instead of the wave."""
        self._position(gpu_uuid)
        self._pinned[gpu_uuid] = GpuUsage(
            uuid=gpu_uuid,
            memory_used_mib=memory_used_mib,
            sm_util_percent=sm_util_percent,
            memory_util_percent=memory_util,
        )

    def add_process(
        self, pid: int, gpu_uuid: str, memory_used_mib: int, sm_util_percent: float = -1.0
    ) -> None:
        """A compute process (host PID) on a GPU, as NVML's process list would show it."""
        self._position(gpu_uuid)
        self._processes[(pid, gpu_uuid)] = GpuProcess(
            pid=pid, uuid=gpu_uuid, memory_used_mib=memory_used_mib, sm_util_percent=sm_util_percent
        )

    def remove_process(self, pid: int) -> None:
        self._processes = {k: p for k, p in self._processes.items() if p.pid != pid}

    def processes(self) -> list[GpuProcess]:
        return list(self._processes.values())

    def usage(self) -> list[GpuUsage]:
        """SM utilisation 50% +- 40% on a sine of period USAGE_PERIOD_S, shifted per GPU by
        index/count of a period; memory use follows the same wave at 20-60% of the card.
        Pinned GPUs report their pinned figures; removed ones report nothing."""
        now = self._clock()
        count = len(self._devices)
        found: list[GpuUsage] = []
        for device in self._devices:
            if device.uuid in self._removed:
                continue
            pinned = self._pinned.get(device.uuid)
            if pinned is not None:
                found.append(pinned)
                continue
            phase = 2 * math.pi * (now / USAGE_PERIOD_S + device.index / count)
            wave = math.sin(phase)  # -1 .. 1
            found.append(
                GpuUsage(
                    uuid=device.uuid,
                    memory_used_mib=int(device.memory_mib * (0.4 + 0.2 * wave)),
                    sm_util_percent=round(50.0 + 40.0 * wave, 2),
                    memory_util_percent=round(30.0 + 20.0 * wave, 2),
                )
            )
        return found

    def driver_version(self) -> str:
        return SIMULATED_DRIVER_VERSION

    def cuda_version(self) -> str:
        return SIMULATED_CUDA_VERSION

    def close(self) -> None:
        pass
