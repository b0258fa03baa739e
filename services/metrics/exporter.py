"""Prometheus families computed from the picture at scrape time (no stale label sets)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.metrics.picture import ClusterPicture

MIB = 1024 * 1024
GPU_LABELS = ["node", "uuid", "index", "model"]
CONTAINER_LABELS = ["node", "namespace", "pod", "container", "uuid", "index"]


class PictureCollector(Collector):
    def __init__(self, picture: ClusterPicture) -> None:
        self.picture = picture

    def collect(self) -> Iterator[Metric]:
        picture = self.picture
        node_up = GaugeMetricFamily(
            "vgpu_node_up", "1 while the node agent reports", labels=["node"]
        )
        for node in picture.nodes:
            node_up.add_metric([node], 1.0 if picture.is_up(node) else 0.0)
        yield node_up

        total = GaugeMetricFamily(
            "vgpu_gpu_memory_total_bytes", "GPU memory capacity", labels=GPU_LABELS
        )
        used = GaugeMetricFamily(
            "vgpu_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=GPU_LABELS
        )
        sm_util = GaugeMetricFamily(
            "vgpu_gpu_sm_utilization_ratio", "SM utilisation 0-1 (NVML)", labels=GPU_LABELS
        )
        healthy = GaugeMetricFamily("vgpu_gpu_healthy", "1 when healthy", labels=GPU_LABELS)
        allocated_memory = GaugeMetricFamily(
            "vgpu_gpu_memory_allocated_bytes", "GPU memory handed out", labels=GPU_LABELS
        )
        allocated_cores = GaugeMetricFamily(
            "vgpu_gpu_core_allocated_ratio", "Compute share handed out, 0-1", labels=GPU_LABELS
        )
        slices = GaugeMetricFamily("vgpu_gpu_slices", "Slices placed on the GPU", labels=GPU_LABELS)
        allocations = picture.allocated()
        for node, gpu in picture.gpus():
            labels = [node, gpu.uuid, str(gpu.index), gpu.model]
            total.add_metric(labels, gpu.memory_mib * MIB)
            healthy.add_metric(labels, 1.0 if gpu.healthy else 0.0)
            usage = picture.nodes[node].usage.get(gpu.uuid)
            if usage is not None and picture.is_up(node):
                used.add_metric(labels, usage.memory_used_mib * MIB)
                sm_util.add_metric(labels, usage.sm_util_percent / 100.0)
            given = allocations.get(gpu.uuid)
            allocated_memory.add_metric(labels, (given.memory_mib if given else 0) * MIB)
            allocated_cores.add_metric(labels, (given.cores if given else 0) / 100.0)
            slices.add_metric(labels, given.slices if given else 0)
        yield from (total, used, sm_util, healthy, allocated_memory, allocated_cores, slices)

        limit = GaugeMetricFamily(
            "vgpu_container_memory_limit_bytes", "A container's GPU memory slice",
            labels=CONTAINER_LABELS,
        )  # fmt: skip
        cores = GaugeMetricFamily(
            "vgpu_container_core_limit_ratio", "A container's compute share, 0-1",
            labels=CONTAINER_LABELS,
        )  # fmt: skip
        for pod in picture.pods.values():
            for container in pod.containers.values():
                for piece in container.slices:
                    labels = [pod.node, pod.namespace, pod.name, container.container, piece.uuid,
                              str(piece.index)]  # fmt: skip
                    limit.add_metric(labels, piece.memory_mib * MIB)
                    cores.add_metric(labels, piece.cores / 100.0)
        yield from (limit, cores)
