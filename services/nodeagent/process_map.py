"""Attribute NVML's per-process figures (host PIDs) to the containers this agent resolved.

In order of certainty:
1. the PID is the peer of a relay connection (SO_PEERCRED gives the host PID), whose
   directory names the container;
2. the PID's cgroup names a container ID learned from such a peer (child processes that do
   not speak to the relay, e.g. a CUDA program the hook is disabled in);
3. the PID lives in a PID namespace where a relay peer of exactly one container lives (the
   runtime gives each container, or each pod sharing one, its own; the agent's own namespace
   never counts), for runtimes whose cgroup paths name no container;
4. the PID's cgroup names a pod, and that pod has exactly one resolved container on that
   GPU.
Anything else stays unattributed (counted in the GPU's total only). Nothing here is read
from what a container says: the kernel names peers (SO_PEERCRED), cgroups and namespaces.
"""

from __future__ import annotations

import os
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
ContainerProcesses = dict[str, dict[str, list[GpuProcess]]]  # key -> GPU uuid -> processes
_SHARED = ""  # a PID namespace where relay peers of several containers live: ambiguous


def pid_namespace(pid: int | str, proc_root: Path) -> int | None:
    """The inode of the process's PID namespace; None when it is gone or unreadable."""
    try:
        return os.stat(proc_root / str(pid) / "ns" / "pid").st_ino
    except OSError:
        return None


def figures_of(assigned: ContainerProcesses) -> ContainerFigures:
    figures: ContainerFigures = {}
    for key, by_gpu in assigned.items():
        for uuid, processes in by_gpu.items():
            for process in processes:
                figures.setdefault(key, {}).setdefault(uuid, DeviceFigures()).add(process)
    return figures


class ProcessAttributor:
    def __init__(self, proc_root: Path) -> None:
        self._proc = proc_root
        self._container_ids: dict[str, str] = {}  # runtime container ID -> directory key
        self._namespaces: dict[int, str] = {}  # PID namespace inode -> key (or _SHARED)
        self._own_namespace = pid_namespace("self", proc_root)

    def learn(self, pid: int, key: str) -> None:
        """A relay peer of directory `key`: remember its runtime container ID and PID
        namespace."""
        identity = identity_of_pid(pid, self._proc)
        if identity is not None and identity.container_id:
            self._container_ids[identity.container_id] = key
        namespace = pid_namespace(pid, self._proc)
        if namespace is not None and namespace != self._own_namespace:
            known = self._namespaces.get(namespace)
            self._namespaces[namespace] = key if known in (None, key) else _SHARED

    def forget(self, key: str) -> None:
        self._container_ids = {c: k for c, k in self._container_ids.items() if k != key}
        self._namespaces = {n: k for n, k in self._namespaces.items() if k != key}

    def key_of(
        self,
        process: GpuProcess,
        peers: Mapping[int, str],
        by_pod: Mapping[str, list[ResolvedContainer]],
    ) -> str | None:
        if process.pid in peers:
            return peers[process.pid]
        identity = identity_of_pid(process.pid, self._proc)
        if identity is not None and identity.container_id in self._container_ids:
            return self._container_ids[identity.container_id]
        namespace = pid_namespace(process.pid, self._proc)
        if namespace is not None and self._namespaces.get(namespace):
            return self._namespaces[namespace]
        if identity is None:
            return None
        on_gpu = [c for c in by_pod.get(identity.pod_uid, []) if process.uuid in c.gpu_uuids]
        return on_gpu[0].key if len(on_gpu) == 1 else None

    def assign(
        self,
        processes: Iterable[GpuProcess],
        peers: Mapping[int, str],
        containers: Iterable[ResolvedContainer],
    ) -> ContainerProcesses:
        """Each attributed process under its container and GPU."""
        by_pod: dict[str, list[ResolvedContainer]] = {}
        for container in containers:
            if container.pod_uid:
                by_pod.setdefault(container.pod_uid, []).append(container)
        assigned: ContainerProcesses = {}
        for process in processes:
            key = self.key_of(process, peers, by_pod)
            if key is not None:
                assigned.setdefault(key, {}).setdefault(process.uuid, []).append(process)
        return assigned

    def attribute(
        self,
        processes: Iterable[GpuProcess],
        peers: Mapping[int, str],
        containers: Iterable[ResolvedContainer],
    ) -> ContainerFigures:
        return figures_of(self.assign(processes, peers, containers))
