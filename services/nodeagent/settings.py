"""Settings of one node agent (YAML section `nodeagent`, env `VGPU_<FIELD>`, flags)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from services.common.config import ConfigError, load_settings
from services.nodeagent.container_files import (
    COMPUTE_POLICIES,
    MAX_LIMIT_WAIT_MS,
    HookSettings,
)
from services.nodeagent.context_overhead import parse_overheads
from services.nodeagent.grant import ID_STRATEGIES, parse_strategies
from services.nodeagent.health import DEFAULT_IGNORED_XIDS, parse_xids
from services.nodeagent.mig_resources import parse_dynamic
from services.nodeagent.modes import (
    EXCLUSIVE,
    MAX_MPS_CLIENTS,
    MPS,
    TIME_SLICING,
    VGPU,
    ModePlan,
    check_mode,
    parse_gpu_modes,
)
from services.nodeagent.nvidia_config import (
    NvidiaConfigError,
    load_nvidia_config,
    settings_values,
)
from services.nodeagent.resource_config import ResourceRule, gpu_rule, parse_resource_config

MIG_STRATEGIES = ("none", "single", "mixed")


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
    # With `simulate`: the MIG geometry the simulated GPUs start with, e.g.
    # "0:3g.20gb,2x2g.10gb;1+2:7x1g.5gb" or "all:" (MIG on, no instance); gpus/sim_mig.py.
    simulate_mig: str = ""
    # Dynamic MIG: GPUs ("all", or indices joined by ",") whose MIG instances the agent creates
    # on demand for memory requests, placed by the allocator; "" = none.
    mig_dynamic: str = ""
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
    # With memory_scaling > 1 (virtual device memory): host memory each container's spilled
    # allocations may take in all, MiB (written into its limit file; 0 = none may spill).
    spill_limit_mib: int = 16384
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
    # How GPUs reach the runtime, one or several comma-separated (NVIDIA's
    # deviceListStrategy): envvar (NVIDIA_VISIBLE_DEVICES), volume-mounts, cdi-cri,
    # cdi-annotations.
    device_list_strategy: str = "envvar"
    # What names the GPUs in the Allocate response: uuid or index (NVIDIA's deviceIDStrategy).
    device_id_strategy: str = "uuid"
    # Also return the /dev nodes as DeviceSpecs (NVIDIA's passDeviceSpecs; CPUManager).
    pass_device_specs: bool = False
    nvidia_driver_root: str = "/"  # host root of the driver and its /dev nodes
    # NVIDIA's migStrategy: how MIG devices are advertised: none (whole GPUs only), single
    # (every MIG device as resource_name; one profile per node) or mixed
    # (nvidia.com/mig-<profile> per profile). docs/modes.md, section MIG.
    mig_strategy: str = "none"
    # How GPUs are shared (docs/modes.md): vgpu | time-slicing | mps | exclusive, for the
    # node, and per GPU "0=mps,GPU-...=exclusive" (GPU index or UUID) over it.
    sharing_mode: str = "vgpu"
    gpu_sharing_modes: str = ""
    # Read the Node's labels vgpu.io/mode (the node) and vgpu.io/mode.<gpu index> at start,
    # over the two settings above (mode_labels.py); the labels come from node_labeler's API.
    mode_labels: bool = True
    sharing_replicas: int = 0  # device IDs per time-slicing / mps GPU; 0 = split_count
    # Advertise the shared GPUs under this name instead of resource_name (NVIDIA's rename,
    # e.g. nvidia.com/gpu.shared); "" = resource_name.
    shared_resource_name: str = ""
    # Refuse Allocate of more than one replica per container (time-slicing / mps).
    fail_requests_greater_than_one: bool = False
    # The GPU-sharing fork's FROM:TO:REPLICAS[,...] (resource_config.py).
    resource_config: str = ""
    # MPS: per GPU <mps_root>/<gpu-uuid>/{pipe,log}; the control program is started as
    # `<mps_control> -d` (on machines without GPUs: services/simulators/mps_control.py).
    mps_root: str = "/run/nvidia/mps"
    mps_control: str = "nvidia-cuda-mps-control"
    mps_watch_interval_s: float = 1.0
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
    # Relay connections one container may hold (one per CUDA process); more are refused and
    # counted (vgpu_nodeagent_relay_rejected_total{reason="too_many_connections"}).
    relay_max_connections: int = 16
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
    # Compute from outside: a container whose processes take more SM time than its cores share
    # plus this many points of the GPU, for violation_compute_confirm_s, while something else
    # wants the GPU (always, with compute_policy hard), is reported as over_compute.
    violation_compute_tolerance_percent: float = 10.0
    # Longer than the memory check's: SM samples are averages over a window, and the hook's
    # work conservation takes up to ~3 s to hand the share back when another tenant starts.
    violation_compute_confirm_s: float = 6.0
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
    parse_strategies(settings.device_list_strategy)
    if settings.device_id_strategy not in ID_STRATEGIES:
        raise ValueError(
            f"device_id_strategy must be one of {', '.join(ID_STRATEGIES)}, "
            f"got {settings.device_id_strategy!r}"
        )
    if settings.mig_strategy not in MIG_STRATEGIES:
        raise ValueError(
            f"mig_strategy must be one of {', '.join(MIG_STRATEGIES)}, "
            f"got {settings.mig_strategy!r}"
        )
    check_sharing(settings)
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
    if not 0 <= settings.violation_compute_tolerance_percent <= 100:
        raise ValueError(
            "violation_compute_tolerance_percent must be within 0..100 (points of the GPU), "
            f"got {settings.violation_compute_tolerance_percent}"
        )
    if settings.violation_compute_confirm_s < 0:
        raise ValueError(
            "violation_compute_confirm_s must not be negative, got "
            f"{settings.violation_compute_confirm_s}"
        )
    if settings.violation_confirm_s < 0:
        raise ValueError(
            f"violation_confirm_s must not be negative, got {settings.violation_confirm_s}"
        )
    if settings.spill_limit_mib < 0:
        raise ValueError(f"spill_limit_mib must not be negative, got {settings.spill_limit_mib}")
    for field in ("cpu_milli", "host_memory_mib", "max_pods"):
        if getattr(settings, field) < -1:
            raise ValueError(
                f"{field} must be -1 (the default), 0 (not stated) or more, "
                f"got {getattr(settings, field)}"
            )
    parse_dynamic(settings.mig_dynamic)
    if settings.mig_dynamic and settings.mig_strategy == "single":
        raise ValueError(
            "mig_dynamic cannot be used with mig_strategy single: single advertises only MIG "
            "devices of one uniform profile under resource_name; use none or mixed"
        )
    if settings.simulate_mig and not settings.simulate:
        raise ValueError("simulate_mig needs simulate (it describes simulated GPUs)")
    parse_xids(settings.ignored_xids)
    parse_overheads(settings.context_overhead)
    for field in (
        "mps_watch_interval_s",
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


def check_sharing(settings: NodeAgentSettings) -> None:
    """The sharing settings (docs/modes.md), each bad value named."""
    check_mode(settings.sharing_mode, "sharing_mode")
    per_gpu = parse_gpu_modes(settings.gpu_sharing_modes)
    rules = parse_resource_config(settings.resource_config) if settings.resource_config else []
    if settings.sharing_replicas < 0 or settings.sharing_replicas == 1:
        raise ValueError(
            f"sharing_replicas must be 0 (the split count) or at least 2, "
            f"got {settings.sharing_replicas}"
        )
    name = settings.shared_resource_name
    if name and "/" not in name:
        raise ValueError(
            f"shared_resource_name must be an extended resource like nvidia.com/gpu.shared, "
            f"got {name!r}"
        )
    modes = {settings.sharing_mode, *per_gpu.values()}
    if MPS in modes:
        replicas = mode_plan(settings).replicas_for(MPS)
        if replicas > MAX_MPS_CLIENTS:
            raise ValueError(
                f"an MPS control daemon serves at most {MAX_MPS_CLIENTS} clients per GPU; "
                f"{replicas} replicas asked (sharing_replicas, or split_count)"
            )
        if settings.mig_strategy == "mixed":
            raise ValueError("sharing_mode mps cannot be used with mig_strategy mixed")
        if any(rule.is_mig for rule in rules):  # they imply mixed (with_mig_rules)
            raise ValueError(
                "sharing_mode mps cannot be used with resource_config's MIG rules (they "
                "advertise MIG devices per profile, as mig_strategy mixed)"
            )
        if not settings.mps_root.startswith("/"):
            raise ValueError(f"mps_root must be an absolute path, got {settings.mps_root!r}")
    if any(rule.is_mig for rule in rules) and settings.mig_strategy == "single":
        raise ValueError(
            "resource_config's MIG rules rename the per-profile resources of mig_strategy "
            "mixed; mig_strategy single advertises every MIG device as resource_name: use "
            "mixed (or none, which MIG rules turn into mixed)"
        )
    if gpu_rule(rules) is not None and (name or settings.sharing_replicas):
        raise ValueError(
            "resource_config's gpu rule names the resource and replicas: leave "
            "shared_resource_name and sharing_replicas unset beside it"
        )


def with_mig_rules(settings: NodeAgentSettings) -> NodeAgentSettings:
    """resource_config's MIG rules act on the per-profile resources of mig_strategy mixed, as
    in the GPU-sharing fork where they need no strategy flag: none becomes mixed."""
    if settings.mig_strategy != "none" or not settings.resource_config:
        return settings
    if not any(rule.is_mig for rule in parse_resource_config(settings.resource_config)):
        return settings
    return msgspec.structs.replace(settings, mig_strategy="mixed")


def _gpu_rule(settings: NodeAgentSettings) -> ResourceRule | None:
    if not settings.resource_config:
        return None
    return gpu_rule(parse_resource_config(settings.resource_config))


def node_mode(settings: NodeAgentSettings) -> str:
    """The node's mode: resource_config's gpu rule turns vgpu into replicas (time-slicing),
    or into whole GPUs under a new name with REPLICAS 1."""
    rule = _gpu_rule(settings)
    if rule is not None and settings.sharing_mode == VGPU:
        return TIME_SLICING if rule.replicas > 1 else EXCLUSIVE
    return settings.sharing_mode


def mode_plan(settings: NodeAgentSettings) -> ModePlan:
    rule = _gpu_rule(settings)
    replicas = (
        rule.replicas if rule is not None and rule.replicas > 1 else settings.sharing_replicas
    )
    return ModePlan(
        default=node_mode(settings),
        per_gpu=parse_gpu_modes(settings.gpu_sharing_modes),
        split_count=settings.split_count,
        replicas=replicas,
        one_replica_per_container=settings.fail_requests_greater_than_one,
    )


def advertised_resource(settings: NodeAgentSettings) -> str:
    """The resource the kubelet sees: resource_config's TO, else the rename, else
    resource_name."""
    rule = _gpu_rule(settings)
    if rule is not None:
        return rule.resource
    return settings.shared_resource_name or settings.resource_name


NVIDIA_CONFIG_ENV = "CONFIG_FILE"  # NVIDIA's plugin reads its config file's path from here


def load_node_agent_settings(
    *,
    config_file: str | None = None,
    nvidia_config_file: str | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeAgentSettings:
    """NVIDIA's device-plugin config file (`--config-file` / CONFIG_FILE), then vgpu's YAML,
    then VGPU_* variables, then flags, each over the one before; then checked. ConfigError
    naming the file, key and reason."""
    env = os.environ if environ is None else environ
    path = nvidia_config_file or env.get(NVIDIA_CONFIG_ENV) or ""
    defaults: dict[str, Any] = {}
    if path:
        try:
            defaults = settings_values(load_nvidia_config(path))
        except NvidiaConfigError as exc:
            raise ConfigError(f"NVIDIA device-plugin config refused: {exc}") from exc
    settings = load_settings(
        NodeAgentSettings,
        section="nodeagent",
        file=config_file,
        overrides=flags,
        environ=env,
        defaults=defaults,
    )
    try:
        check_settings(settings)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return settings
