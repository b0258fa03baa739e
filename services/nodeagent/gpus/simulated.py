"""Simulated GPUs for laptops, CI and `vgpu up`: a spec such as "2xA100-40GB,1xT4".

UUIDs are uuid5(node name, index), so an agent restarted on the same node advertises the same
device IDs. Utilisation follows a smooth deterministic wave per GPU (see `usage`), so graphs
move without randomness and tests can pin the clock.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.common.schemas import GpuDevice, GpuUsage


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_mib: int
    sm_count: int


MODELS: dict[str, GpuModel] = {
    model.name.upper(): model
    for model in (
        GpuModel("A100-40GB", 40960, 108),
        GpuModel("A100-80GB", 81920, 108),
        GpuModel("H100-80GB", 81559, 132),
        GpuModel("H200", 143771, 132),
        GpuModel("V100-16GB", 16160, 80),
        GpuModel("V100-32GB", 32510, 80),
        GpuModel("T4", 15360, 40),
        GpuModel("A10", 22731, 72),
        GpuModel("L4", 23034, 58),
    )
}

_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://vgpu.io/simulated-gpu")
SIMULATED_DRIVER_VERSION = "550.54.15-sim"
_SPEC_PART = re.compile(r"^(?P<count>\d+)\s*[xX]\s*(?P<model>\S+)$")
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
        if model is None:
            known = ", ".join(m.name for m in MODELS.values())
            raise ValueError(
                f"bad GPU spec part {part!r}: unknown model {model_name!r} (known: {known})"
            )
        gpus.extend([model] * count)
    return gpus


def simulated_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}')}"


class SimulatedGpuBackend:
    """A GpuBackend over simulated GPUs; `set_healthy` lets demos and tests fail a GPU."""

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
            )
            for index, model in enumerate(models)
        ]

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        for position, device in enumerate(self._devices):
            if device.uuid == gpu_uuid:
                self._devices[position] = GpuDevice(
                    uuid=device.uuid,
                    index=device.index,
                    model=device.model,
                    memory_mib=device.memory_mib,
                    sm_count=device.sm_count,
                    numa_node=device.numa_node,
                    healthy=healthy,
                )
                return
        raise ValueError(f"no simulated GPU with uuid {gpu_uuid!r}")

    def usage(self) -> list[GpuUsage]:
        """SM utilisation 50% +- 40% on a sine of period USAGE_PERIOD_S, shifted per GPU by
        index/count of a period; memory use follows the same wave at 20-60% of the card."""
        now = self._clock()
        count = len(self._devices)
        found: list[GpuUsage] = []
        for device in self._devices:
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
