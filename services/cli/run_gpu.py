"""What the NVIDIA container runtime adds to a GPU container, for `vgpu up`'s simulated GPUs.

On a real node the runtime (nvidia-container-toolkit) reads NVIDIA_VISIBLE_DEVICES (or CDI
names) and mounts the driver's libraries and /dev/nvidia* nodes. Here the driver is the
simulated libcuda/libnvidia-ml, and the "device" is a directory the simulated driver shares
between processes: both are mounted, and the simulated driver is told which GPUs it shows.
"""

from __future__ import annotations

from services.cli.container.spec import BindMount
from services.cli.state import UpState
from services.simulators.kubelet_records import AdmittedContainer

DRIVER_DIR = "/usr/local/nvidia/lib64"  # where NVIDIA's CUDA images look (LD_LIBRARY_PATH)
DEVICE_STATE_DIR = "/dev/vgpu-sim"  # the simulated devices, as /dev/nvidia* would be
_NO_GPU = ("", "void", "none")


def visible_gpus(container: AdmittedContainer, node_gpus: list[str]) -> list[str]:
    """The GPU UUIDs the runtime exposes: from the env var strategy or CDI names."""
    named = container.envs.get("NVIDIA_VISIBLE_DEVICES", "")
    cdi = [*container.cdi_devices, *",".join(container.annotations.values()).split(",")]
    uuids = [part.split("=", 1)[1] for part in cdi if "=" in part]
    if named not in _NO_GPU:
        uuids = node_gpus if named == "all" else named.split(",")
    return [uuid for uuid in dict.fromkeys(uuids) if uuid]


def simulated_runtime(
    container: AdmittedContainer, node: str, state: UpState
) -> tuple[list[BindMount], dict[str, str]]:
    """The mounts and env vars the runtime adds; none for a container without GPUs."""
    node_gpus = {gpu.uuid: gpu for gpu in state.gpus.get(node, [])}
    uuids = visible_gpus(container, list(node_gpus))
    if not uuids:
        return [], {}
    mounts: list[BindMount] = []
    env: dict[str, str] = {}
    if state.driver_dir:
        mounts.append(BindMount(state.driver_dir, DRIVER_DIR, read_only=True))
        env["LD_LIBRARY_PATH"] = DRIVER_DIR
    known = [node_gpus[uuid] for uuid in uuids if uuid in node_gpus]
    if known:
        # The simulated driver takes one size for all its GPUs: a pod's GPUs share a model.
        env["VGPU_SIM_GPUS"] = f"{len(known)}x{min(gpu.memory_mib for gpu in known)}"
        env["VGPU_SIM_UUIDS"] = ",".join(gpu.uuid for gpu in known)
    state_dir = state.sim_state_dirs.get(node)
    if state_dir:
        mounts.append(BindMount(state_dir, DEVICE_STATE_DIR))
        env["VGPU_SIM_STATE_DIR"] = DEVICE_STATE_DIR
    return mounts, env
