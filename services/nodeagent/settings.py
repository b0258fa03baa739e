"""Settings of one node agent (YAML section `nodeagent`, env `VGPU_<FIELD>`, flags)."""

from __future__ import annotations

import msgspec

from services.nodeagent.container_files import (
    COMPUTE_POLICIES,
    MAX_LIMIT_WAIT_MS,
    HookSettings,
)
from services.nodeagent.context_overhead import parse_overheads
from services.nodeagent.grant import STRATEGIES
from services.nodeagent.health import DEFAULT_IGNORED_XIDS, parse_xids


class NodeAgentSettings(msgspec.Struct, kw_only=True, frozen=True):
    node_name: str
    nats_url: str = "nats://127.0.0.1:4222"
    # The node's IP as stated in the inventory (e.g. from the downward API's status.hostIP);
    # empty: the address this host reaches NATS from (address.py).
    node_ip: str = ""
    # Simulated GPUs, e.g. "4xA100-40GB" or "2xA100-40GB,1xT4"; empty means real GPUs (NVML).
    simulate: str = ""
    # With `simulate`: the simulated CUDA driver's state directory (VGPU_SIM_STATE_DIR of the
    # node's containers), whose per-process memory the simulated GPUs then list as NVML would.
    simulate_driver_dir: str = ""
    # NVML cannot start: true = exit with the reason (NVIDIA's default); false = idle quietly
    # (for DaemonSets that also land on nodes without GPUs).
    fail_on_init_error: bool = True
    plugin_dir: str = "/var/lib/kubelet/device-plugins"
    socket_name: str = "vgpu.sock"
    resource_name: str = "nvidia.com/gpu"
    split_count: int = 10  # device IDs advertised per physical GPU (max sharers)
    # 4paradigm's --device-memory-scaling and --device-cores-scaling, stated for every GPU in
    # the inventory: memory slices may sum to this x the card (> 1 oversubscribes; the hook
    # then spills what the card cannot hold to host memory), compute shares to 100 x this.
    # 0 = not stated: the allocator's memory_scaling / cores_scaling apply.
    memory_scaling: float = 0.0
    cores_scaling: float = 0.0
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    # Not under /var/run/vgpu: on a host where that exists, a preloaded hook takes itself
    # to be inside a container and ignores the VGPU_* environment.
    container_root: str = "/var/lib/vgpu/containers"
    # The agent's own records (whose each container directory is, the limits it wrote), read
    # back on restart. Never mounted into a container: nothing a container writes is trusted.
    state_dir: str = "/var/lib/vgpu/nodeagent"
    hook_library: str = "/usr/local/vgpu/libvgpu.so"
    # Device memory the hook charges per CUDA context, per GPU model: "A100=420,T4=300,*=350"
    # or one number for all; empty = none (context_overhead.py).
    context_overhead: str = ""
    # How GPUs reach the runtime: envvar (NVIDIA_VISIBLE_DEVICES), cdi-cri or cdi-annotations.
    device_list_strategy: str = "envvar"
    cdi_kind: str = "nvidia.com/gpu"
    # How the hooks hold each container to its cores share (hook.conf, read-only to them):
    # share = only while other containers use the GPU, hard = always, off = never.
    compute_policy: str = "share"
    health_checks: bool = True  # watch NVML XID events
    ignored_xids: str = DEFAULT_IGNORED_XIDS  # application XIDs that say nothing about the GPU
    node_labeler: str = "memory"  # none | memory | kubernetes (patch the Node's labels)
    # The node's allocatable CPU (millicores), memory (MiB) and pod count, published in the
    # inventory. -1: simulated nodes state SIMULATED_NODE (an openb-like 64 cores, 256 GiB,
    # 110 pods); real nodes state nothing (0), as the allocator reads their Node objects.
    cpu_milli: int = -1
    host_memory_mib: int = -1
    max_pods: int = -1
    heartbeat_s: float = 5.0
    usage_interval_s: float = 2.0
    resolve_timeout_s: float = 30.0
    kubelet_watch_interval_s: float = 1.0  # how often to look for a re-created kubelet.sock
    relay_publish_interval_s: float = 1.0  # ContainerUsage at most this often per container
    util_interval_s: float = 0.5  # `util` lines to the hooks
    cleanup_interval_s: float = 30.0  # look for directories of containers that are gone
    container_dir_grace_s: float = 600.0  # keep an unlisted directory this long after Allocate
    proc_root: str = "/proc"  # the host's /proc (the DaemonSet runs with hostPID)
    sysfs_root: str = "/sys"
    # Verification from outside (verify.py): what to do when NVML shows a container over its
    # slice beyond the tolerance: "report" (event, gauge, flag) or "kill" (also SIGKILL its
    # processes on that GPU, newest first, until it is back within).
    on_violation: str = "report"
    violation_tolerance_percent: float = 5.0  # of the slice's memory
    # Allowed per process of the container on the GPU (a context's own footprint the hook
    # may not charge); 0 = the limit file's context_overhead_mib.
    violation_tolerance_mib: int = 0
    violation_confirm_s: float = 1.0  # a finding must hold this long (and 2 samples) to count
    otlp_endpoint: str = ""
    log_level: str = "info"


MAX_SCALING = 100.0  # a typo guard: nobody shares one card's memory or SMs 100 ways over

SIMULATED_NODE = (64_000, 256 * 1024, 110)  # cpu milli, memory MiB, pods


def host_capacity(settings: NodeAgentSettings) -> tuple[int, int, int]:
    """(cpu milli, memory MiB, pods) the inventory states: the settings, -1 filled in."""
    given = (settings.cpu_milli, settings.host_memory_mib, settings.max_pods)
    defaults = SIMULATED_NODE if settings.simulate else (0, 0, 0)
    return tuple(d if g < 0 else g for g, d in zip(given, defaults, strict=True))  # type: ignore[return-value]


def check_settings(settings: NodeAgentSettings) -> None:
    """Reject settings that would only fail later, naming the field."""
    if not settings.node_name:
        raise ValueError("node_name must be set (the Kubernetes node this agent serves)")
    if settings.split_count < 1:
        raise ValueError(f"split_count must be at least 1, got {settings.split_count}")
    for field in ("memory_scaling", "cores_scaling"):
        value = getattr(settings, field)
        if not (value == 0 or 0 < value <= MAX_SCALING):
            raise ValueError(
                f"{field} must be 0 (not stated) or more than 0 and at most {MAX_SCALING:g}, "
                f"got {value}"
            )
    name = settings.socket_name
    if not name or "/" in name or name in (".", "..") or name == "kubelet.sock":
        raise ValueError(
            f"socket_name must be a plain file name other than kubelet.sock, got {name!r}"
        )
    if "/" not in settings.resource_name:
        raise ValueError(
            f"resource_name must be an extended resource like nvidia.com/gpu, "
            f"got {settings.resource_name!r}"
        )
    if settings.device_list_strategy not in STRATEGIES:
        raise ValueError(
            f"device_list_strategy must be one of {', '.join(STRATEGIES)}, "
            f"got {settings.device_list_strategy!r}"
        )
    if settings.compute_policy not in COMPUTE_POLICIES:
        raise ValueError(
            f"compute_policy must be one of {', '.join(COMPUTE_POLICIES)}, "
            f"got {settings.compute_policy!r}"
        )
    if settings.node_labeler not in ("none", "memory", "kubernetes"):
        raise ValueError(
            f"node_labeler must be none, memory or kubernetes, got {settings.node_labeler!r}"
        )
    if settings.on_violation not in ("report", "kill"):
        raise ValueError(f"on_violation must be report or kill, got {settings.on_violation!r}")
    if settings.violation_tolerance_percent < 0 or settings.violation_tolerance_mib < 0:
        raise ValueError(
            "violation_tolerance_percent and violation_tolerance_mib must not be negative, got "
            f"{settings.violation_tolerance_percent} and {settings.violation_tolerance_mib}"
        )
    if settings.violation_confirm_s < 0:
        raise ValueError(
            f"violation_confirm_s must not be negative, got {settings.violation_confirm_s}"
        )
    for field in ("cpu_milli", "host_memory_mib", "max_pods"):
        if getattr(settings, field) < -1:
            raise ValueError(
                f"{field} must be -1 (the default), 0 (not stated) or more, "
                f"got {getattr(settings, field)}"
            )
    parse_xids(settings.ignored_xids)
    parse_overheads(settings.context_overhead)
    for field in (
        "heartbeat_s",
        "usage_interval_s",
        "resolve_timeout_s",
        "kubelet_watch_interval_s",
        "relay_publish_interval_s",
        "util_interval_s",
        "cleanup_interval_s",
    ):
        if getattr(settings, field) <= 0:
            raise ValueError(f"{field} must be positive, got {getattr(settings, field)}")
    if settings.container_dir_grace_s < 0:
        raise ValueError(
            f"container_dir_grace_s must not be negative, got {settings.container_dir_grace_s}"
        )


def hook_settings(settings: NodeAgentSettings) -> HookSettings:
    """hook.conf for every container: the hook waits for its limit file as long as this
    agent keeps trying to resolve whose container it is, and no longer."""
    wait_ms = min(int(settings.resolve_timeout_s * 1000), MAX_LIMIT_WAIT_MS)
    return HookSettings(limit_wait_ms=wait_ms, compute_policy=settings.compute_policy)
