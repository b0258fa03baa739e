"""What a container receives from Allocate, decided from its device IDs alone.

The kubelet calls Allocate with device IDs and no pod identity, so everything here derives
from the IDs: the GPUs to expose, and a per-container host directory keyed by a hash of the
sorted IDs (stable across retries, distinct for concurrently running containers because the
kubelet never hands one device ID to two running containers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.files import ensure_file

CONTAINER_DIR = "/var/run/vgpu"  # where the container sees its limits file
HOOK_CONTAINER_PATH = "/usr/local/vgpu/libvgpu.so"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
PRELOAD_FILE_NAME = "ld.so.preload"  # shared by all containers, under container_root
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
CONTAINER_DIR_ENV = "VGPU_CONTAINER_DIR"


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class ContainerGrant:
    device_ids: tuple[str, ...]  # as the kubelet gave them
    gpu_uuids: tuple[str, ...]  # the GPUs behind them, first-seen order, de-duplicated
    key: str
    host_dir: Path
    envs: dict[str, str]
    mounts: tuple[MountSpec, ...]


def container_key(device_ids: list[str] | tuple[str, ...]) -> str:
    return hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()[:16]


def preload_file(container_root: Path) -> Path:
    return container_root / PRELOAD_FILE_NAME


def plan_grant(
    catalog: DeviceCatalog,
    device_ids: list[str],
    container_root: Path,
    hook_library: Path | None,
) -> ContainerGrant:
    """Raise UnknownDeviceError (naming the ID) or ValueError for an empty request.

    `hook_library` is the host path of the hook when it is installed, else None.
    """
    if not device_ids:
        raise ValueError("Allocate request names no device IDs")
    gpu_uuids = list(dict.fromkeys(catalog.gpu_of(device_id).uuid for device_id in device_ids))
    key = container_key(device_ids)
    host_dir = container_root / key
    mounts = [MountSpec(CONTAINER_DIR, str(host_dir), read_only=False)]
    if hook_library is not None:
        mounts.append(MountSpec(HOOK_CONTAINER_PATH, str(hook_library), read_only=True))
        mounts.append(
            MountSpec(PRELOAD_CONTAINER_PATH, str(preload_file(container_root)), read_only=True)
        )
    return ContainerGrant(
        device_ids=tuple(device_ids),
        gpu_uuids=tuple(gpu_uuids),
        key=key,
        host_dir=host_dir,
        envs={VISIBLE_DEVICES_ENV: ",".join(gpu_uuids), CONTAINER_DIR_ENV: CONTAINER_DIR},
        mounts=tuple(mounts),
    )


class GrantIssuer:
    """Plans a container's grant and prepares its host files (directory, ld.so.preload)."""

    def __init__(self, catalog: DeviceCatalog, container_root: Path, hook_library: Path) -> None:
        self._catalog = catalog
        self._root = container_root
        self._hook = hook_library

    def issue(self, device_ids: list[str]) -> ContainerGrant:
        """UnknownDeviceError/ValueError for bad IDs; OSError when host files cannot be made."""
        # Checked per Allocate so that installing the hook later needs no agent restart.
        hook = self._hook if self._hook.is_file() else None
        grant = plan_grant(self._catalog, device_ids, self._root, hook)
        grant.host_dir.mkdir(parents=True, exist_ok=True)
        if hook is not None:
            ensure_file(preload_file(self._root), HOOK_CONTAINER_PATH + "\n")
        return grant
