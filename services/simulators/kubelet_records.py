"""What the simulated kubelet remembers about admitted pods, and what it answers with."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class MountInfo(msgspec.Struct, kw_only=True):
    container_path: str
    host_path: str
    read_only: bool = False


class DeviceSpecInfo(msgspec.Struct, kw_only=True):
    container_path: str
    host_path: str
    permissions: str = ""


class AdmittedContainer(msgspec.Struct, kw_only=True):
    name: str
    init: bool = False
    device_ids: list[str] = []
    envs: dict[str, str] = {}  # from the device plugin's Allocate answers
    # The container's own env as the kubelet resolves it (downward API included); the
    # runtime appends it after `envs`, so it wins where both name a variable.
    container_env: dict[str, str] = {}
    mounts: list[MountInfo] = []
    devices: list[DeviceSpecInfo] = []
    annotations: dict[str, str] = {}
    cdi_devices: list[str] = []


class AdmitResult(msgspec.Struct, kw_only=True):
    namespace: str
    name: str
    uid: str
    containers: list[AdmittedContainer] = []
    error: str = ""  # non-empty: the pod failed admission and holds nothing

    @property
    def admitted(self) -> bool:
        return not self.error


@dataclass
class ContainerRecord:
    name: str
    init: bool
    restartable: bool
    # resource -> device ID -> NUMA nodes of the device at allocation time
    devices: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    @property
    def listed(self) -> bool:
        """The PodResources API lists app containers and sidecars, not plain init ones."""
        return not self.init or self.restartable


@dataclass
class PodRecord:
    namespace: str
    name: str
    uid: str
    containers: list[ContainerRecord]
    result: AdmitResult


class PodRecords:
    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], PodRecord] = {}

    def add(self, record: PodRecord) -> None:
        self._pods[(record.namespace, record.name)] = record

    def get(self, namespace: str, name: str) -> PodRecord | None:
        return self._pods.get((namespace, name))

    def remove(self, namespace: str, name: str) -> bool:
        return self._pods.pop((namespace, name), None) is not None

    def pods(self) -> list[PodRecord]:
        return list(self._pods.values())

    def in_use(self, resource: str) -> set[str]:
        return {
            device_id
            for pod in self._pods.values()
            for container in pod.containers
            for device_id in container.devices.get(resource, {})
        }
