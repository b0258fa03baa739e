"""Simulated GPUs for laptops, CI and `vgpu up`: a spec such as "2xA100-40GB,1xT4".

UUIDs are uuid5(node name, index), so an agent restarted on the same node advertises the same
device IDs. A simulated GPU reports only the load of what runs on it: idle, it reads 0 % SM,
0 % memory and 0 MiB. The node agent tells the backend (the optional `LoadSink` protocol)
which container holds which slice (`attach`) and when it is gone (`detach`); each attached
slice then runs a deterministic synthetic workload inside its limits, a smooth wave keyed on
the container key (see `slice_load`), so graphs move without randomness and tests can pin
the clock. A GPU's load is the sum over its slices, clamped at the card; each attached
container also shows as one compute process with a fake PID (see `simulated_pid`).
`set_usage` pins a GPU's figures instead (its synthetic load and processes are then hidden);
`add_process` lists a process by hand.

Real programs on the simulated CUDA driver (libvgpu-hook/sim) show too: given the driver's
state directory (`driver_state_dir`, the VGPU_SIM_STATE_DIR of the node's containers, whose
VGPU_SIM_UUIDS are these GPUs' UUIDs), every live process the driver gave memory or a context
is listed with its host PID and what it really holds (`sim_driver.py`), hook or no hook, as
NVML lists processes on hardware, and its memory counts in the GPU's used memory. Each also
shows its SM share between two samples (the GPU time of the kernels it queued over the wall
time, as NVML's per-process utilisation samples), and a GPU with live driver processes reports
their figures instead of the synthetic load: what runs there is measured, not made up.

Faults for demos and tests: `inject_xid` (goes through the same health policy as NVML's XID
events), `remove_gpu` (the GPU stops answering) and `set_healthy` (a GPU's or a MIG device's UUID).
A model missing from the table can be given inline as `<count>x<name>:<memory MiB>:<SMs>`.

MIG (A100-40GB, A100-80GB, H100-80GB): NVML's MIG calls (`set_mig_mode`,
`create_gpu_instance`, `create_compute_instance`, their destroy calls, `mig_devices`) with
NVML's rules (sim_mig.py); `mig_geometry` gives the instances the node starts with.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from services.common.schemas import GpuDevice, GpuUsage, MigDevice
from services.nodeagent.gpus import sim_driver
from services.nodeagent.gpus.backend import GpuProcess, HealthEvent
from services.nodeagent.gpus.sim_mig import SimulatedMig, parse_geometry


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

log = logging.getLogger("vgpu.nodeagent")

_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://vgpu.io/simulated-gpu")
SIMULATED_DRIVER_VERSION = "550.54.15-sim"
SIMULATED_CUDA_VERSION = "12.4"
_SPEC_PART = re.compile(r"^(?P<count>\d+)\s*[xX]\s*(?P<model>\S+)$")
_INLINE_MODEL = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+):(?P<memory>\d+):(?P<sms>\d+)$")
# Period of a slice's synthetic workload; each container's wave has its own phase.
USAGE_PERIOD_S = 120.0
# A slice's synthetic memory use moves between these fractions of its memory limit.
MEMORY_LOW, MEMORY_HIGH = 0.5, 0.9
# Its SM utilisation moves between these fractions of its cores share (100 % if uncapped).
SM_LOW, SM_HIGH = 0.25, 1.0
# Memory-controller utilisation follows SM utilisation at this ratio.
MEMORY_UTIL_PER_SM = 0.5
# Linux PIDs never exceed 2**22 (PID_MAX_LIMIT), so fake PIDs from here on can never name a
# real process: /proc lookups for them find nothing and attribute them to no container.
FAKE_PID_BASE = 1 << 22
MIB = 1024 * 1024


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


def _digest(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def simulated_pid(key: str) -> int:
    """The fake PID a container's synthetic workload shows under: stable per key, and above
    any PID Linux can hand out (FAKE_PID_BASE), below 2**31."""
    return FAKE_PID_BASE + _digest(key) % ((1 << 31) - FAKE_PID_BASE)


@dataclass(frozen=True)
class SliceLoad:
    """What one attached slice uses at one moment."""

    memory_used_mib: int
    sm_util_percent: float
    memory_util_percent: float


@dataclass(frozen=True)
class _Slice:
    key: str
    gpu_uuid: str
    memory_limit_mib: int  # already resolved: 0 (whole card) and oversize become the card
    cores: int  # already resolved: 0 (uncapped) becomes 100


def slice_load(key: str, memory_limit_mib: int, cores: int, now: float) -> SliceLoad:
    """The synthetic workload of container `key` in a slice of `memory_limit_mib` MiB and
    `cores` percent of the SMs, at time `now`: memory between MEMORY_LOW and MEMORY_HIGH of
    the limit, SM between SM_LOW and SM_HIGH of `cores`, both on a sine of period
    USAGE_PERIOD_S whose phase comes from the key (SM a quarter period after memory)."""
    phase = _digest(key) / 2**64
    turn = now / USAGE_PERIOD_S + phase
    memory_level = (1 + math.sin(2 * math.pi * turn)) / 2  # 0 .. 1
    sm_level = (1 + math.sin(2 * math.pi * (turn + 0.25))) / 2
    low = math.ceil(memory_limit_mib * MEMORY_LOW)
    high = max(low, math.floor(memory_limit_mib * MEMORY_HIGH))
    sm = round(cores * (SM_LOW + (SM_HIGH - SM_LOW) * sm_level), 2)
    return SliceLoad(
        memory_used_mib=low + round((high - low) * memory_level),
        sm_util_percent=sm,
        memory_util_percent=round(sm * MEMORY_UTIL_PER_SM, 2),
    )


class _BusyRates:
    """Each driver process's SM share between two looks: its GPU time over the wall time,
    as NVML's per-process utilisation samples measure it on hardware (-1 at first sight).
    Looks closer together than MIN_WINDOW_S (usage() and processes() of one sample) give
    the previous figure, so a sample is never judged on a few microseconds."""

    MIN_WINDOW_S = 0.05

    def __init__(self) -> None:
        # (gpu, pid, slot) -> (busy ns, when, share then)
        self._seen: dict[tuple[str, int, int], tuple[int, float, float]] = {}

    def share(self, gpu_uuid: str, process: sim_driver.DriverProcess, now: float) -> float:
        key = (gpu_uuid, process.pid, process.slot)
        before = self._seen.get(key)
        if before is None or process.busy_ns < before[0]:  # new, or its slot was retaken
            self._seen[key] = (process.busy_ns, now, -1.0)
            return -1.0
        busy, when, last = before
        if now - when < self.MIN_WINDOW_S:
            return last
        share = round(min(100.0, (process.busy_ns - busy) / 1e9 / (now - when) * 100), 2)
        self._seen[key] = (process.busy_ns, now, share)
        return share

    def forget_except(self, live: set[tuple[str, int]]) -> None:
        self._seen = {k: v for k, v in self._seen.items() if (k[0], k[1]) in live}


class SimulatedGpuBackend:
    """A GpuBackend over simulated GPUs, with load from attached slices (a LoadSink) and
    faults under the caller's control."""

    def __init__(
        self,
        node_name: str,
        spec: str,
        clock: Callable[[], float] = time.time,
        driver_state_dir: str | Path = "",
        mig_geometry: str = "",
    ) -> None:
        models = parse_spec(spec)
        self._clock = clock
        self._driver_dir = Path(driver_state_dir) if driver_state_dir else None
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
        # Replaced, never mutated: usage() reads it in a worker thread while attach() runs.
        self._slices: dict[tuple[str, str], _Slice] = {}
        self._events: queue.Queue[HealthEvent] = queue.Queue()
        self._removed: set[str] = set()
        self._busy = _BusyRates()
        self._mig = SimulatedMig()
        for device in self._devices:
            self._mig.add_gpu(device.uuid, device.model, device.sm_count)
        for index, profiles in parse_geometry(mig_geometry, count).items():
            try:
                self._mig.apply_geometry(self._devices[index].uuid, profiles)
            except ValueError as exc:
                raise ValueError(f"MIG geometry of GPU {index}: {exc}") from None

    def _position(self, gpu_uuid: str) -> int:
        for position, device in enumerate(self._devices):
            if device.uuid == gpu_uuid:
                return position
        raise ValueError(f"no simulated GPU with uuid {gpu_uuid!r}")

    def devices(self) -> list[GpuDevice]:
        return [
            msgspec.structs.replace(
                device, mig_mode=True, mig_devices=self._mig.devices(device.uuid)
            )
            if self._mig.mig_mode(device.uuid)
            else device
            for device in self._devices
        ]

    # NVML's MIG calls (nvmlDeviceSetMigMode, nvmlDeviceCreateGpuInstanceWithPlacement, ...):
    # MigError (a ValueError) with NVML's reason when refused.
    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> None:
        self._mig.set_mig_mode(gpu_uuid, enabled)

    def create_gpu_instance(self, gpu_uuid: str, profile: str, start: int = -1) -> int:
        return self._mig.create_gpu_instance(gpu_uuid, profile, start)

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None:
        self._mig.destroy_gpu_instance(gpu_uuid, gi_id)

    def create_compute_instance(self, gpu_uuid: str, gi_id: int, slices: int = 0) -> int:
        return self._mig.create_compute_instance(gpu_uuid, gi_id, slices)

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        self._mig.destroy_compute_instance(gpu_uuid, gi_id, ci_id)

    def mig_devices(self, gpu_uuid: str) -> list[MigDevice]:
        return self._mig.devices(gpu_uuid)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        if gpu_uuid.startswith("MIG-"):
            self._mig.set_healthy(gpu_uuid, healthy)
            return
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
        if gpu_uuid.startswith("MIG-"):
            if self._mig.owner_of(gpu_uuid) is None:
                raise ValueError(f"no simulated MIG device with uuid {gpu_uuid!r}")
        elif gpu_uuid:
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
        """Pin a GPU's figures: it reports them instead of its slices' synthetic load."""
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

    def attach(self, key: str, gpu_uuid: str, memory_limit_mib: int, cores: int) -> None:
        """Container `key` now holds a slice of `gpu_uuid` (memory_limit_mib 0 = the whole
        card, cores 0 = uncapped); it replaces what `key` held on that GPU."""
        position = self._position(gpu_uuid)
        if memory_limit_mib < 0 or cores < 0:
            raise ValueError(
                f"bad slice for {key!r} on {gpu_uuid}: memory_limit_mib={memory_limit_mib} and "
                f"cores={cores} must not be negative"
            )
        card = self._devices[position].memory_mib
        held = _Slice(
            key=key,
            gpu_uuid=gpu_uuid,
            memory_limit_mib=min(memory_limit_mib, card) if memory_limit_mib else card,
            cores=min(cores, 100) if cores else 100,
        )
        self._slices = {**self._slices, (key, gpu_uuid): held}

    def detach(self, key: str) -> None:
        """Container `key` is gone: its slices stop loading their GPUs."""
        self._slices = {k: held for k, held in self._slices.items() if held.key != key}

    def _loads(
        self, now: float, measured: list[GpuProcess] | None = None
    ) -> list[tuple[_Slice, SliceLoad]]:
        """Every attached slice on a GPU that reports synthetic load (not pinned or removed,
        and no real program on it among `measured`, the driver's processes)."""
        real = {process.uuid for process in measured or []}
        return [
            (held, slice_load(held.key, held.memory_limit_mib, held.cores, now))
            for held in self._slices.values()
            if held.gpu_uuid not in self._pinned
            and held.gpu_uuid not in self._removed
            and held.gpu_uuid not in real
        ]

    def _driver_processes(self) -> list[GpuProcess]:
        """What the simulated CUDA driver's live processes hold on these GPUs, and their SM
        share since the previous look."""
        if self._driver_dir is None:
            return []
        now = time.monotonic()
        found: list[GpuProcess] = []
        for device in self._devices:
            if device.uuid in self._removed:
                continue
            try:
                live = sim_driver.live_processes(self._driver_dir, device.uuid)
            except (OSError, ValueError) as exc:
                log.warning(
                    "cannot read the simulated driver's processes",
                    extra={"gpu": device.uuid, "error": str(exc)},
                )
                continue
            found += [
                GpuProcess(
                    pid=p.pid,
                    uuid=device.uuid,
                    memory_used_mib=p.used_bytes // MIB,
                    sm_util_percent=self._busy.share(device.uuid, p, now),
                )
                for p in live
            ]
        self._busy.forget_except({(process.uuid, process.pid) for process in found})
        return found

    def processes(self) -> list[GpuProcess]:
        """Processes added by hand, the simulated driver's, then one per attached slice
        (pid `simulated_pid(key)`)."""
        measured = self._driver_processes()
        synthetic = [
            GpuProcess(
                pid=simulated_pid(held.key),
                uuid=held.gpu_uuid,
                memory_used_mib=load.memory_used_mib,
                sm_util_percent=load.sm_util_percent,
            )
            for held, load in self._loads(self._clock(), measured)
        ]
        return list(self._processes.values()) + measured + synthetic

    def usage(self) -> list[GpuUsage]:
        """Per GPU, the sum of its attached slices' synthetic load, clamped at the card's
        memory and 100 %; zero without slices. A GPU the simulated driver's processes use
        reports theirs instead. Pinned GPUs report their pinned figures; removed ones report
        nothing."""
        measured = self._driver_processes()
        by_gpu: dict[str, list[SliceLoad]] = {}
        for held, load in self._loads(self._clock(), measured):
            by_gpu.setdefault(held.gpu_uuid, []).append(load)
        real: dict[str, int] = {}
        real_sm: dict[str, float] = {}
        for process in measured:
            real[process.uuid] = real.get(process.uuid, 0) + process.memory_used_mib
            real_sm[process.uuid] = real_sm.get(process.uuid, 0.0) + max(
                process.sm_util_percent, 0.0
            )
        found: list[GpuUsage] = []
        for device in self._devices:
            if device.uuid in self._removed:
                continue
            pinned = self._pinned.get(device.uuid)
            if pinned is not None:
                found.append(pinned)
                continue
            loads = by_gpu.get(device.uuid, [])
            memory = sum(load.memory_used_mib for load in loads) + real.get(device.uuid, 0)
            sm = sum(load.sm_util_percent for load in loads) + real_sm.get(device.uuid, 0.0)
            memory_util = sum(load.memory_util_percent for load in loads)
            if device.uuid in real_sm:
                memory_util = sm * MEMORY_UTIL_PER_SM
            found.append(
                GpuUsage(
                    uuid=device.uuid,
                    memory_used_mib=min(memory, device.memory_mib),
                    sm_util_percent=round(min(sm, 100.0), 2),
                    memory_util_percent=round(min(memory_util, 100.0), 2),
                )
            )
        return found

    def driver_version(self) -> str:
        return SIMULATED_DRIVER_VERSION

    def cuda_version(self) -> str:
        return SIMULATED_CUDA_VERSION

    def close(self) -> None:
        pass
