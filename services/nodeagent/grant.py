"""What a container receives from Allocate, decided from its device IDs alone.

The kubelet calls Allocate with device IDs and no pod identity, so everything here derives
from the IDs: the GPUs to expose, and a per-container host directory keyed by a hash of the
sorted IDs (stable across retries, distinct for concurrently running containers because the
kubelet never hands one device ID to two running containers). The directory's layout and its
two mounts (limits read-only, the hook's state read-write) are container_files.py's.

The GPUs reach the container runtime as `NVIDIA_VISIBLE_DEVICES` (strategy `envvar`, the
default) or as CDI device names `<cdi_kind>=<uuid>` (`cdi-cri`: the CDIDevice field of the
response; `cdi-annotations`: a `cdi.k8s.io/` annotation), as NVIDIA's plugin offers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.container_files import (
    CONFIG_MOUNT,
    STATE_MOUNT,
    HookSettings,
    config_dir,
    prepare,
    state_dir,
)
from services.nodeagent.files import ensure_file

HOOK_CONTAINER_PATH = "/usr/local/vgpu/libvgpu.so"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
PRELOAD_FILE_NAME = "ld.so.preload"  # shared by all containers, under container_root
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
STRATEGIES = ("envvar", "cdi-cri", "cdi-annotations")
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/vgpu_"


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
    cdi_devices: tuple[str, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)


def container_key(device_ids: list[str] | tuple[str, ...]) -> str:
    return hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()[:16]


def preload_file(container_root: Path) -> Path:
    return container_root / PRELOAD_FILE_NAME


def plan_grant(
    catalog: DeviceCatalog,
    device_ids: list[str],
    container_root: Path,
    hook_library: Path | None,
    strategy: str = "envvar",
    cdi_kind: str = "nvidia.com/gpu",
) -> ContainerGrant:
    """Raise UnknownDeviceError (naming the ID) or ValueError for an empty request.

    `hook_library` is the host path of the hook when it is installed, else None.
    """
    if not device_ids:
        raise ValueError("Allocate request names no device IDs")
    gpu_uuids = list(dict.fromkeys(catalog.gpu_of(device_id).uuid for device_id in device_ids))
    key = container_key(device_ids)
    host_dir = container_root / key
    mounts = [
        MountSpec(CONFIG_MOUNT, str(config_dir(host_dir)), read_only=True),
        MountSpec(STATE_MOUNT, str(state_dir(host_dir)), read_only=False),
    ]
    if hook_library is not None:
        mounts.append(MountSpec(HOOK_CONTAINER_PATH, str(hook_library), read_only=True))
        mounts.append(
            MountSpec(PRELOAD_CONTAINER_PATH, str(preload_file(container_root)), read_only=True)
        )
    # No VGPU_* variable: inside a container the hook reads only the read-only mount.
    envs: dict[str, str] = {}
    cdi_names = tuple(f"{cdi_kind}={uuid}" for uuid in gpu_uuids)
    cdi_devices: tuple[str, ...] = ()
    annotations: dict[str, str] = {}
    if strategy == "envvar":
        envs = {VISIBLE_DEVICES_ENV: ",".join(gpu_uuids), **envs}
    elif strategy == "cdi-cri":
        cdi_devices = cdi_names
    elif strategy == "cdi-annotations":
        annotations = {CDI_ANNOTATION_PREFIX + key: ",".join(cdi_names)}
    else:
        raise ValueError(f"unknown device list strategy {strategy!r} (one of {STRATEGIES})")
    return ContainerGrant(
        device_ids=tuple(device_ids),
        gpu_uuids=tuple(gpu_uuids),
        key=key,
        host_dir=host_dir,
        envs=envs,
        mounts=tuple(mounts),
        cdi_devices=cdi_devices,
        annotations=annotations,
    )


class GrantIssuer:
    """Plans a container's grant and prepares its host files (directory, ld.so.preload)."""

    def __init__(
        self,
        catalog: DeviceCatalog,
        container_root: Path,
        hook_library: Path,
        strategy: str = "envvar",
        cdi_kind: str = "nvidia.com/gpu",
        hook_settings: HookSettings | None = None,
    ) -> None:
        self._catalog = catalog
        self._hook_settings = hook_settings or HookSettings()
        self._root = container_root
        self._hook = hook_library
        self._strategy = strategy
        self._cdi_kind = cdi_kind

    def issue(self, device_ids: list[str]) -> ContainerGrant:
        """UnknownDeviceError/ValueError for bad IDs; OSError when host files cannot be made."""
        # Checked per Allocate so that installing the hook later needs no agent restart.
        hook = self._hook if self._hook.is_file() else None
        grant = plan_grant(
            self._catalog, device_ids, self._root, hook, self._strategy, self._cdi_kind
        )
        prepare(grant.host_dir, self._hook_settings)
        if hook is not None:
            ensure_file(preload_file(self._root), HOOK_CONTAINER_PATH + "\n")
        return grant
