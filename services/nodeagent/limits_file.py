"""The limit file the in-container hook reads: `/var/run/vgpu/limits` (host side: the
container directory's read-only `config/`, container_files.py), key=value lines.

version=1
namespace=<ns>
pod=<pod>
container=<container>
device_count=N
device.<i>.uuid=<gpu uuid>            i = 0..N-1 in NVIDIA_VISIBLE_DEVICES order
device.<i>.memory_limit_mib=<MiB>      0 = unlimited
device.<i>.cores=<percent of SMs>      0 = no compute limit
context_overhead_mib=<MiB>            optional: charged per CUDA context (see context_overhead)
device.<i>.virtual_memory=1           optional: the GPU's memory scaling is > 1; what the card
                                      cannot hold spills to managed memory (virtual device memory)
spill_limit_mib=<MiB>                 with virtual memory: host memory the container's spilled
                                      allocations may take in all
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from services.common.schemas import ContainerAllocation
from services.nodeagent.files import atomic_write

FILE_NAME = "limits"
FORMAT_VERSION = 1


class LimitsError(ValueError):
    """The allocator's decision cannot be turned into a limit file for these GPUs."""


@dataclass(frozen=True)
class DeviceLimit:
    uuid: str
    memory_limit_mib: int
    cores: int
    virtual_memory: bool = False  # spill to managed memory when the card is full


@dataclass(frozen=True)
class ContainerLimits:
    namespace: str
    pod: str
    container: str
    devices: tuple[DeviceLimit, ...]
    context_overhead_mib: int = 0  # 0: not written (the hook then charges nothing)
    spill_limit_mib: int = 0  # host memory spilled allocations may take (virtual memory)


def with_virtual_memory(limits: ContainerLimits, spill_limit_mib: int) -> ContainerLimits:
    """The limits with virtual device memory on every device, spilling at most
    spill_limit_mib of host memory (a node whose memory scaling is above 1)."""
    devices = tuple(replace(d, virtual_memory=True) for d in limits.devices)
    return replace(limits, devices=devices, spill_limit_mib=spill_limit_mib)


def limits_from_decision(
    namespace: str,
    pod: str,
    container: str,
    gpu_uuids: tuple[str, ...],
    decision: ContainerAllocation,
) -> ContainerLimits:
    """Order the decision's slices as the container sees its GPUs; the two must match."""
    slices = {piece.uuid: piece for piece in decision.slices}
    missing = [uuid for uuid in gpu_uuids if uuid not in slices]
    extra = sorted(set(slices) - set(gpu_uuids))
    if missing or extra:
        raise LimitsError(
            f"decision for {namespace}/{pod}/{container} does not match its GPUs: "
            f"no slice on {missing or 'none'}, slices on unexposed GPUs {extra or 'none'}"
        )
    return ContainerLimits(
        namespace=namespace,
        pod=pod,
        container=container,
        devices=tuple(
            DeviceLimit(uuid, slices[uuid].memory_mib, slices[uuid].cores) for uuid in gpu_uuids
        ),
    )


def _value(name: str, value: str) -> str:
    if not value or any(c in value for c in "\n\r\0"):
        raise LimitsError(f"limit file field {name} has an unusable value {value!r}")
    return value


def render(limits: ContainerLimits) -> str:
    lines = [
        f"version={FORMAT_VERSION}",
        f"namespace={_value('namespace', limits.namespace)}",
        f"pod={_value('pod', limits.pod)}",
        f"container={_value('container', limits.container)}",
        f"device_count={len(limits.devices)}",
    ]
    for index, device in enumerate(limits.devices):
        if device.memory_limit_mib < 0 or not 0 <= device.cores <= 100:
            raise LimitsError(f"device {device.uuid}: limits out of range: {device}")
        lines += [
            f"device.{index}.uuid={_value('uuid', device.uuid)}",
            f"device.{index}.memory_limit_mib={device.memory_limit_mib}",
            f"device.{index}.cores={device.cores}",
        ]
        if device.virtual_memory:
            lines.append(f"device.{index}.virtual_memory=1")
    if limits.context_overhead_mib < 0:
        raise LimitsError(f"context overhead out of range: {limits.context_overhead_mib}")
    if limits.context_overhead_mib:
        lines.append(f"context_overhead_mib={limits.context_overhead_mib}")
    if limits.spill_limit_mib < 0:
        raise LimitsError(f"spill limit out of range: {limits.spill_limit_mib}")
    if any(d.virtual_memory for d in limits.devices):
        lines.append(f"spill_limit_mib={limits.spill_limit_mib}")
    return "\n".join(lines) + "\n"


def write(container_dir: Path, limits: ContainerLimits) -> Path:
    path = container_dir / FILE_NAME
    container_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, render(limits))
    return path


def parse(text: str) -> ContainerLimits:
    """Read back a limit file this agent wrote (after an agent restart); LimitsError if not."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    try:
        if values.get("version") != str(FORMAT_VERSION):
            raise LimitsError(f"unsupported limit file version {values.get('version')!r}")
        count = int(values["device_count"])
        devices = tuple(
            DeviceLimit(
                uuid=values[f"device.{i}.uuid"],
                memory_limit_mib=int(values[f"device.{i}.memory_limit_mib"]),
                cores=int(values.get(f"device.{i}.cores", "0")),
                virtual_memory=values.get(f"device.{i}.virtual_memory") == "1",
            )
            for i in range(count)
        )
        return ContainerLimits(
            namespace=values["namespace"],
            pod=values["pod"],
            container=values["container"],
            devices=devices,
            context_overhead_mib=int(values.get("context_overhead_mib", "0")),
            spill_limit_mib=int(values.get("spill_limit_mib", "0")),
        )
    except KeyError as exc:
        raise LimitsError(f"limit file lacks {exc.args[0]}") from exc
    except ValueError as exc:
        raise LimitsError(f"limit file has a bad number: {exc}") from exc
