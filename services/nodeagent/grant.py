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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.schemas import GpuDevice
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
from services.nodeagent.modes import MPS, VGPU

HOOK_CONTAINER_PATH = "/usr/local/vgpu/libvgpu.so"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
PRELOAD_FILE_NAME = "ld.so.preload"  # shared by all containers, under container_root
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
STRATEGIES = ("envvar", "volume-mounts", "cdi-cri", "cdi-annotations")
ID_STRATEGIES = ("uuid", "index")
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/vgpu_"
# volume-mounts: the runtime reads the GPU list from the names of files under this directory.
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# MPS: each GPU's control daemon's directories, as the container sees them.
MPS_PIPE_MOUNT = "/mps/pipe"
MPS_LOG_MOUNT = "/mps/log"
SHARED_REQUEST_ERROR = "maximum request size for shared resources is 1"  # NVIDIA's words


def parse_strategies(text: str) -> tuple[str, ...]:
    """`envvar` or a comma-separated list (NVIDIA's deviceListStrategy); ValueError naming a
    bad one."""
    found: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if item not in STRATEGIES:
            raise ValueError(
                f"device_list_strategy must be one of {', '.join(STRATEGIES)} (or several, "
                f"comma-separated), got {item!r}"
            )
        if item not in found:
            found.append(item)
    return tuple(found)


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceSpec:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class MpsShare:
    """One MPS client's share of its GPU: what the control daemon holds it to."""

    memory_mib: int
    thread_percent: int


@dataclass(frozen=True)
class GrantOptions:
    """How GPUs reach the container runtime (NVIDIA's plugin flags, same meaning)."""

    strategies: tuple[str, ...] = ("envvar",)
    id_strategy: str = "uuid"
    cdi_kind: str = "nvidia.com/gpu"
    pass_device_specs: bool = False
    driver_root: str = "/"
    max_ids_per_container: int = 0  # 1: NVIDIA's failRequestsGreaterThanOne; 0 = any
    mps_root: str = "/run/nvidia/mps"


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
    devices: tuple[DeviceSpec, ...] = ()
    hooked: bool = True  # the hook is preloaded and held to a limit file (vgpu mode)


def container_key(device_ids: list[str] | tuple[str, ...]) -> str:
    return hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()[:16]


def preload_file(container_root: Path) -> Path:
    return container_root / PRELOAD_FILE_NAME


def mps_dirs(mps_root: str | Path, gpu_uuid: str) -> tuple[Path, Path]:
    """(pipe, log) directories of one GPU's MPS control daemon on the host."""
    base = Path(mps_root) / gpu_uuid
    return base / "pipe", base / "log"


def _device_specs(gpus: list[GpuDevice], driver_root: str) -> tuple[DeviceSpec, ...]:
    """NVIDIA's passDeviceSpecs: control nodes that exist, then /dev/nvidia<minor> per GPU."""
    root = Path(driver_root)
    specs = []
    for name in CONTROL_DEVICES:
        host = root / "dev" / name
        if host.exists():
            specs.append(DeviceSpec(f"/dev/{name}", str(host)))
    for gpu in gpus:
        specs.append(
            DeviceSpec(f"/dev/nvidia{gpu.index}", str(root / "dev" / f"nvidia{gpu.index}"))
        )
    return tuple(specs)


def plan_grant(
    catalog: DeviceCatalog,
    device_ids: list[str],
    container_root: Path,
    hook_library: Path | None,
    strategy: str = "envvar",
    cdi_kind: str = "nvidia.com/gpu",
    options: GrantOptions | None = None,
    mps_share: MpsShare | None = None,
) -> ContainerGrant:
    """Raise UnknownDeviceError (naming the ID) or ValueError for a request it cannot serve.

    `hook_library` is the host path of the hook when it is installed, else None. Only GPUs
    in vgpu mode get the hook; the others (time-slicing, mps, exclusive) get the GPUs alone,
    and mps GPUs their control daemon's directories and the client's share.
    """
    if options is None:
        options = GrantOptions(strategies=parse_strategies(strategy), cdi_kind=cdi_kind)
    if not device_ids:
        raise ValueError("Allocate request names no device IDs")
    gpus = list({gpu.uuid: gpu for gpu in (catalog.gpu_of(d) for d in device_ids)}.values())
    gpu_uuids = [gpu.uuid for gpu in gpus]
    modes = {gpu.sharing_mode for gpu in gpus}
    if options.max_ids_per_container and len(device_ids) > options.max_ids_per_container:
        raise ValueError(f"{SHARED_REQUEST_ERROR} (got {len(device_ids)} device IDs)")
    hooked = modes == {VGPU}
    if len(modes) > 1:
        raise ValueError(
            f"device IDs span GPUs in different sharing modes ({', '.join(sorted(modes))})"
        )
    key = container_key(device_ids)
    host_dir = container_root / key
    mounts: list[MountSpec] = []
    envs: dict[str, str] = {}
    if hooked:
        mounts = [
            MountSpec(CONFIG_MOUNT, str(config_dir(host_dir)), read_only=True),
            MountSpec(STATE_MOUNT, str(state_dir(host_dir)), read_only=False),
        ]
        if hook_library is not None:
            mounts.append(MountSpec(HOOK_CONTAINER_PATH, str(hook_library), read_only=True))
            mounts.append(
                MountSpec(PRELOAD_CONTAINER_PATH, str(preload_file(container_root)), read_only=True)
            )
    elif modes == {MPS}:
        if len(gpus) != 1:
            raise ValueError(
                f"an MPS client reaches one control daemon: one GPU per container, got {len(gpus)}"
            )
        pipe, logs = mps_dirs(options.mps_root, gpus[0].uuid)
        mounts = [
            MountSpec(MPS_PIPE_MOUNT, str(pipe), read_only=False),
            MountSpec(MPS_LOG_MOUNT, str(logs), read_only=False),
        ]
        envs = {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_MOUNT, "CUDA_MPS_LOG_DIRECTORY": MPS_LOG_MOUNT}
        if mps_share is not None:
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps_share.thread_percent)
            envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mps_share.memory_mib}M"
    # No VGPU_* variable: inside a container the hook reads only the read-only mount.
    names = [str(gpu.index) for gpu in gpus] if options.id_strategy == "index" else gpu_uuids
    cdi_names = tuple(f"{options.cdi_kind}={name}" for name in names)
    cdi_devices: tuple[str, ...] = ()
    annotations: dict[str, str] = {}
    strategies = options.strategies
    for strategy_name in strategies:
        if strategy_name == "envvar":
            envs[VISIBLE_DEVICES_ENV] = ",".join(names)
        elif strategy_name == "volume-mounts":
            envs[VISIBLE_DEVICES_ENV] = DEVICE_LIST_DIR
            mounts.extend(
                MountSpec(f"{DEVICE_LIST_DIR}/{name}", "/dev/null", read_only=True)
                for name in names
            )
        elif strategy_name == "cdi-cri":
            cdi_devices = cdi_names
        elif strategy_name == "cdi-annotations":
            annotations = {CDI_ANNOTATION_PREFIX + key: ",".join(cdi_names)}
        else:
            raise ValueError(
                f"unknown device list strategy {strategy_name!r} (one of {STRATEGIES})"
            )
    only_cdi = all(name.startswith("cdi-") for name in strategies)
    devices = (
        _device_specs(gpus, options.driver_root)
        if options.pass_device_specs and not only_cdi
        else ()
    )
    return ContainerGrant(
        device_ids=tuple(device_ids),
        gpu_uuids=tuple(gpu_uuids),
        key=key,
        host_dir=host_dir,
        envs=envs,
        mounts=tuple(mounts),
        cdi_devices=cdi_devices,
        annotations=annotations,
        devices=devices,
        hooked=hooked,
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
        options: GrantOptions | None = None,
        mps_share: Callable[[list[str]], MpsShare] | None = None,
    ) -> None:
        self._catalog = catalog
        self._hook_settings = hook_settings or HookSettings()
        self._root = container_root
        self._hook = hook_library
        self._options = options or GrantOptions(
            strategies=parse_strategies(strategy), cdi_kind=cdi_kind
        )
        self._mps_share = mps_share

    @property
    def options(self) -> GrantOptions:
        return self._options

    def issue(self, device_ids: list[str]) -> ContainerGrant:
        """UnknownDeviceError/ValueError for bad IDs; OSError when host files cannot be made."""
        # Checked per Allocate so that installing the hook later needs no agent restart.
        hook = self._hook if self._hook.is_file() else None
        share = None
        if self._mps_share is not None and any(
            self._catalog.gpu_of(d).sharing_mode == MPS for d in device_ids
        ):
            share = self._mps_share(device_ids)
        grant = plan_grant(
            self._catalog, device_ids, self._root, hook, options=self._options, mps_share=share
        )
        prepare(grant.host_dir, self._hook_settings)
        if hook is not None and grant.hooked:
            ensure_file(preload_file(self._root), HOOK_CONTAINER_PATH + "\n")
        return grant
