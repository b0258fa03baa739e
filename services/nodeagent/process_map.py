"""Attribute NVML's per-process figures (host PIDs) to the containers this agent resolved.

In order of certainty:
1. the PID is the peer of a relay connection (SO_PEERCRED gives the host PID), whose
   directory names the container;
2. the PID's cgroup names a container ID learned from such a peer (child processes that do
   not speak to the relay, e.g. a CUDA program the hook is disabled in);
3. the PID's cgroup names a pod, and that pod has exactly one resolved container on that
   GPU.
Anything else stays unattributed (counted in the GPU's total only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.nodeagent.cgroups import identity_of_pid
from services.nodeagent.containers import ResolvedContainer
from services.nodeagent.gpus.backend import GpuProcess


@dataclass
class DeviceFigures:
    memory_used_mib: int = 0
    sm_util_percent: float = -1.0  # -1: no process of the container was sampled
    pids: int = 0

    def add(self, process: GpuProcess) -> None:
        self.memory_used_mib += process.memory_used_mib
        self.pids += 1
        if process.sm_util_percent >= 0:
            self.sm_util_percent = max(self.sm_util_percent, 0.0) + process.sm_util_percent


ContainerFigures = dict[str, dict[str, DeviceFigures]]  # key -> GPU uuid -> figures


class ProcessAttributor:
    def __init__(self, proc_root: Path) -> None:
        self._proc = proc_root
        self._container_ids: dict[str, str] = {}  # runtime container ID -> directory key

    def learn(self, pid: int, key: str) -> None:
        """A relay peer of directory `key`: remember its runtime container ID."""
        identity = identity_of_pid(pid, self._proc)
        if identity is not None and identity.container_id:
            self._container_ids[identity.container_id] = key

    def forget(self, key: str) -> None:
        self._container_ids = {c: k for c, k in self._container_ids.items() if k != key}

    def key_of(
        self,
        process: GpuProcess,
        peers: Mapping[int, str],
        by_pod: Mapping[str, list[ResolvedContainer]],
    ) -> str | None:
        if process.pid in peers:
            return peers[process.pid]
        identity = identity_of_pid(process.pid, self._proc)
        if identity is None:
            return None
        if identity.container_id in self._container_ids:
            return self._container_ids[identity.container_id]
        on_gpu = [c for c in by_pod.get(identity.pod_uid, []) if process.uuid in c.gpu_uuids]
        return on_gpu[0].key if len(on_gpu) == 1 else None

    def attribute(
        self,
        processes: Iterable[GpuProcess],
        peers: Mapping[int, str],
        containers: Iterable[ResolvedContainer],
    ) -> ContainerFigures:
        by_pod: dict[str, list[ResolvedContainer]] = {}
        for container in containers:
            if container.pod_uid:
                by_pod.setdefault(container.pod_uid, []).append(container)
        figures: ContainerFigures = {}
        for process in processes:
            key = self.key_of(process, peers, by_pod)
            if key is not None:
                figures.setdefault(key, {}).setdefault(process.uuid, DeviceFigures()).add(process)
        return figures
