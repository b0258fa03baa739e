"""Settings of one node agent (YAML section `nodeagent`, env `VGPU_<FIELD>`, flags)."""

from __future__ import annotations

import msgspec


class NodeAgentSettings(msgspec.Struct, kw_only=True, frozen=True):
    node_name: str
    nats_url: str = "nats://127.0.0.1:4222"
    # Simulated GPUs, e.g. "4xA100-40GB" or "2xA100-40GB,1xT4"; empty means real GPUs (NVML).
    simulate: str = ""
    plugin_dir: str = "/var/lib/kubelet/device-plugins"
    socket_name: str = "vgpu.sock"
    resource_name: str = "nvidia.com/gpu"
    split_count: int = 10  # device IDs advertised per physical GPU (max sharers)
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    container_root: str = "/var/run/vgpu/containers"
    hook_library: str = "/usr/local/vgpu/libvgpu.so"
    heartbeat_s: float = 5.0
    usage_interval_s: float = 2.0
    resolve_timeout_s: float = 30.0
    otlp_endpoint: str = ""
    log_level: str = "info"


def check_settings(settings: NodeAgentSettings) -> None:
    """Reject settings that would only fail later, naming the field."""
    if not settings.node_name:
        raise ValueError("node_name must be set (the Kubernetes node this agent serves)")
    if settings.split_count < 1:
        raise ValueError(f"split_count must be at least 1, got {settings.split_count}")
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
    for field in ("heartbeat_s", "usage_interval_s", "resolve_timeout_s"):
        if getattr(settings, field) <= 0:
            raise ValueError(f"{field} must be positive, got {getattr(settings, field)}")
