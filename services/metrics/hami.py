"""HAMi's metric names, labels and units, so dashboards built for HAMi keep working.

HAMi's scheduler exports allocation (`hami_gpu_*`, `hami_vgpu_*_allocated_*`) and its
vGPUmonitor exports usage (`hami_host_gpu_*`, `hami_vgpu_memory_used_bytes`, ...); vgpu has
both in one place. HAMi's units are kept as HAMi has them: its `*_ratio` compute families are
percentages 0-100, not 0-1. The older names (before HAMi's rename) come with their own label
names. `device_type` is HAMi's "NVIDIA-<model>"; `container_index` carries the container
name, as HAMi's does; `vdevice_index` is the device's position in the container's
NVIDIA_VISIBLE_DEVICES.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from services.metrics.views import ClusterView, GpuView, NodeView

MIB = 1024 * 1024
ZONE = "vGPU"  # HAMi's scheduler wraps every family in this constant label
DEVICE = ["node", "device_uuid", "device_index", "device_type", "zone"]
VGPU_ALLOCATED = ["namespace", "node", "pod", "container", "container_index", "device_uuid",
                  "zone"]  # fmt: skip
HOST = ["node", "device_index", "device_uuid", "device_type"]
VGPU_USED = ["namespace", "pod", "container", "vdevice_index", "device_uuid", "node"]
LEGACY_DEVICE = ["nodeid", "deviceuuid", "deviceidx", "zone"]
LEGACY_VGPU_ALLOCATED = ["podnamespace", "nodename", "podname", "containeridx", "deviceuuid",
                         "zone"]  # fmt: skip
LEGACY_HOST = ["nodeid", "deviceidx", "deviceuuid", "devicetype"]
LEGACY_VGPU_USED = ["podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid"]


def device_type(gpu: GpuView) -> str:
    return f"NVIDIA-{gpu.model}"


class _Families:
    def __init__(self) -> None:
        self.families: dict[str, GaugeMetricFamily] = {}

    def add(self, name: str, documentation: str, labels: list[str], values: list[str],
            value: float) -> None:  # fmt: skip
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = GaugeMetricFamily(name, documentation, labels=labels)
        family.add_metric(values, value)


def _devices(view: ClusterView) -> Iterator[tuple[NodeView, GpuView]]:
    for node in view.nodes:
        for gpu in node.gpus:
            yield node, gpu


def hami_families(view: ClusterView, legacy: bool = True) -> Iterator[Metric]:
    out = _Families()
    for node, gpu in _devices(view):
        device = [node.name, gpu.uuid, str(gpu.index), device_type(gpu), ZONE]
        host = [node.name, str(gpu.index), gpu.uuid, device_type(gpu)]
        # As HAMi registers a device: its memory and 100% times the node's scaling.
        memory_limit = round(gpu.memory_mib * gpu.memory_scaling) * MIB
        core_limit = round(100 * gpu.cores_scaling)
        out.add("hami_gpu_memory_limit_bytes", "Device memory limit for a certain GPU", DEVICE,
                device, memory_limit)  # fmt: skip
        out.add("hami_gpu_core_limit_ratio", "Device core limit for a certain GPU (percent)",
                DEVICE, device, core_limit)  # fmt: skip
        out.add("hami_gpu_memory_allocated_bytes", "Device memory allocated for a certain GPU",
                DEVICE, device, gpu.memory_allocated_mib * MIB)  # fmt: skip
        out.add("hami_gpu_core_allocated_ratio",
                "Device core allocated for a certain GPU (percent)", DEVICE, device,
                gpu.cores_allocated)  # fmt: skip
        out.add("hami_gpu_shared_count", "Number of containers sharing this GPU", DEVICE,
                device, len(gpu.slices))  # fmt: skip
        if gpu.memory_mib:
            out.add("hami_node_gpu_memory_allocated_ratio",
                    "GPU memory allocated versus total on a GPU (0-1)", DEVICE[:3],
                    device[:3], gpu.memory_allocated_mib / gpu.memory_mib)  # fmt: skip
        if gpu.memory_used_mib is not None:
            out.add("hami_host_gpu_memory_used_bytes", "GPU device memory usage in bytes", HOST,
                    host, gpu.memory_used_mib * MIB)  # fmt: skip
        if gpu.sm_util_percent is not None:
            out.add("hami_host_gpu_utilization_ratio", "GPU core utilization ratio (0-100)",
                    HOST, host, gpu.sm_util_percent)  # fmt: skip
        for piece in gpu.slices:
            allocated = [piece.namespace, node.name, piece.pod, piece.container,
                         piece.container, gpu.uuid, ZONE]  # fmt: skip
            out.add("hami_vgpu_memory_allocated_bytes", "vGPU memory allocated from a container",
                    VGPU_ALLOCATED, allocated, piece.memory_mib * MIB)  # fmt: skip
            out.add("hami_vgpu_core_allocated_ratio",
                    "vGPU core allocated from a container (percent)", VGPU_ALLOCATED, allocated,
                    piece.cores)  # fmt: skip
        if legacy:
            legacy_device = [node.name, gpu.uuid, str(gpu.index), ZONE]
            out.add("GPUDeviceMemoryLimit", "Device memory limit for a certain GPU",
                    LEGACY_DEVICE, legacy_device, memory_limit)  # fmt: skip
            out.add("GPUDeviceCoreLimit", "Device core limit for a certain GPU", LEGACY_DEVICE,
                    legacy_device, core_limit)  # fmt: skip
            out.add("GPUDeviceMemoryAllocated", "Device memory allocated for a certain GPU",
                    LEGACY_DEVICE, legacy_device, gpu.memory_allocated_mib * MIB)  # fmt: skip
            out.add("GPUDeviceCoreAllocated", "Device core allocated for a certain GPU",
                    LEGACY_DEVICE, legacy_device, gpu.cores_allocated)  # fmt: skip
            out.add("GPUDeviceSharedNum", "Number of containers sharing this GPU",
                    LEGACY_DEVICE, legacy_device, len(gpu.slices))  # fmt: skip
            legacy_host = [node.name, str(gpu.index), gpu.uuid, device_type(gpu)]
            if gpu.memory_used_mib is not None:
                out.add("HostGPUMemoryUsage", "GPU device memory usage", LEGACY_HOST,
                        legacy_host, gpu.memory_used_mib * MIB)  # fmt: skip
            if gpu.sm_util_percent is not None:
                out.add("HostCoreUtilization", "GPU core utilization", LEGACY_HOST, legacy_host,
                        gpu.sm_util_percent)  # fmt: skip
            for piece in gpu.slices:
                allocated = [piece.namespace, node.name, piece.pod, piece.container, gpu.uuid,
                             ZONE]  # fmt: skip
                out.add("vGPUMemoryAllocated", "vGPU memory allocated from a container",
                        LEGACY_VGPU_ALLOCATED, allocated, piece.memory_mib * MIB)  # fmt: skip
                out.add("vGPUCoreAllocated", "vGPU core allocated from a container",
                        LEGACY_VGPU_ALLOCATED, allocated, piece.cores)  # fmt: skip

    for pod in view.pods:
        for container in pod.containers:
            for position, device in enumerate(container.devices):
                used = [pod.namespace, pod.name, container.name, str(position), device.uuid,
                        pod.node]  # fmt: skip
                old = used[:5]
                out.add("hami_vgpu_memory_limit_bytes", "vGPU device memory limit in bytes",
                        VGPU_USED, used, device.memory_limit_mib * MIB)  # fmt: skip
                if legacy:
                    out.add("vGPU_device_memory_limit_in_bytes", "vGPU device limit",
                            LEGACY_VGPU_USED, old, device.memory_limit_mib * MIB)  # fmt: skip
                if device.memory_used_mib is not None:
                    out.add("hami_vgpu_memory_used_bytes", "vGPU device memory usage in bytes",
                            VGPU_USED, used, device.memory_used_mib * MIB)  # fmt: skip
                    if legacy:
                        out.add("vGPU_device_memory_usage_in_bytes", "vGPU device usage",
                                LEGACY_VGPU_USED, old, device.memory_used_mib * MIB)  # fmt: skip
                if device.sm_util_percent is not None:
                    out.add("hami_container_device_utilization_ratio",
                            "Container device SM utilization (0-100)", VGPU_USED, used,
                            device.sm_util_percent)  # fmt: skip
    yield from out.families.values()
