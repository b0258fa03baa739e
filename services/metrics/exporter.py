"""Prometheus families computed from the cluster view at scrape time (no stale label sets).

Our own families use ratios 0-1 and bytes; `hami.py` adds HAMi's names with HAMi's units.
A figure that is not known (silent node, no fresh report) is left out, never exported as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.metrics.views import ClusterView

MIB = 1024 * 1024
NODE_LABELS = ["node"]
GPU_LABELS = ["node", "uuid", "index", "model"]
CONTAINER_GPU_LABELS = ["node", "namespace", "pod", "container", "uuid", "index", "model"]
CONTAINER_LABELS = ["node", "namespace", "pod", "container"]

ViewSource = Callable[[], ClusterView]


def _gauge(name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


def vgpu_families(view: ClusterView) -> Iterator[Metric]:
    node_up = _gauge("vgpu_node_up", "1 while the node agent reports, 0 once silent",
                     NODE_LABELS)  # fmt: skip
    silent = _gauge("vgpu_node_silent_seconds", "Seconds since the node's last inventory",
                    NODE_LABELS)  # fmt: skip
    for node in view.nodes:
        node_up.add_metric([node.name], 1.0 if node.state == "up" else 0.0)
        silent.add_metric([node.name], node.silent_s)
    yield from (node_up, silent)

    gpu = {
        "total": _gauge("vgpu_gpu_memory_total_bytes", "GPU memory capacity", GPU_LABELS),
        "allocated": _gauge("vgpu_gpu_memory_allocated_bytes", "GPU memory handed out",
                            GPU_LABELS),
        "used": _gauge("vgpu_gpu_memory_used_bytes", "GPU memory in use (NVML)", GPU_LABELS),
        "cores": _gauge("vgpu_gpu_core_allocated_ratio", "Compute share handed out, 0-1",
                        GPU_LABELS),
        "util": _gauge("vgpu_gpu_sm_utilization_ratio", "SM utilisation 0-1 (NVML)",
                       GPU_LABELS),
        "slices": _gauge("vgpu_gpu_slices", "Slices placed on the GPU", GPU_LABELS),
        "healthy": _gauge("vgpu_gpu_healthy", "1 when healthy", GPU_LABELS),
        "stranded": _gauge("vgpu_gpu_stranded_memory_bytes",
                           "Free memory on the GPU that no pending pod's shape fits",
                           GPU_LABELS),
        "memory_scaling": _gauge("vgpu_gpu_memory_scaling",
                                 "Memory slices may sum to this x the card (> 1 oversubscribed)",
                                 GPU_LABELS),
        "oversubscribed": _gauge("vgpu_gpu_memory_oversubscribed",
                                 "1 when the GPU's memory scaling is above 1", GPU_LABELS),
        "cores_scaling": _gauge("vgpu_gpu_cores_scaling",
                                "Compute shares may sum to 100% x this", GPU_LABELS),
    }  # fmt: skip
    per_device = {
        "asked": _gauge("vgpu_container_memory_requested_bytes",
                        "GPU memory the container asked for (the allocator's decision)",
                        CONTAINER_GPU_LABELS),
        "limit": _gauge("vgpu_container_memory_limit_bytes",
                        "GPU memory limit the hook enforces", CONTAINER_GPU_LABELS),
        "used": _gauge("vgpu_container_memory_used_bytes",
                       "GPU memory the container's processes hold (hook report)",
                       CONTAINER_GPU_LABELS),
        "spilled": _gauge("vgpu_container_memory_spilled_bytes",
                          "Of the memory used, what spilled to host-pageable managed memory "
                          "because the card was full (virtual device memory)",
                          CONTAINER_GPU_LABELS),
        "cores_asked": _gauge("vgpu_container_core_requested_ratio",
                              "Compute share the container asked for, 0-1",
                              CONTAINER_GPU_LABELS),
        "cores_limit": _gauge("vgpu_container_core_limit_ratio",
                              "Compute share the container is held to, 0-1 (0 = no limit)",
                              CONTAINER_GPU_LABELS),
        "cores_used": _gauge("vgpu_container_core_used_ratio",
                             "Share of the GPU's SM time the container uses, 0-1",
                             CONTAINER_GPU_LABELS),
    }  # fmt: skip
    for node in view.nodes:
        for card in node.gpus:
            labels = [node.name, card.uuid, str(card.index), card.model]
            gpu["total"].add_metric(labels, card.memory_mib * MIB)
            gpu["allocated"].add_metric(labels, card.memory_allocated_mib * MIB)
            gpu["cores"].add_metric(labels, card.cores_allocated / 100.0)
            gpu["slices"].add_metric(labels, len(card.slices))
            gpu["healthy"].add_metric(labels, 1.0 if card.healthy else 0.0)
            gpu["stranded"].add_metric(labels, card.stranded_memory_mib * MIB)
            gpu["memory_scaling"].add_metric(labels, card.memory_scaling)
            gpu["oversubscribed"].add_metric(labels, 1.0 if card.oversubscribed else 0.0)
            gpu["cores_scaling"].add_metric(labels, card.cores_scaling)
            if card.memory_used_mib is not None:
                gpu["used"].add_metric(labels, card.memory_used_mib * MIB)
            if card.sm_util_percent is not None:
                gpu["util"].add_metric(labels, card.sm_util_percent / 100.0)
            for piece in card.slices:
                labels = [node.name, piece.namespace, piece.pod, piece.container, card.uuid,
                          str(card.index), card.model]  # fmt: skip
                per_device["asked"].add_metric(labels, piece.memory_mib * MIB)
                per_device["limit"].add_metric(labels, piece.memory_limit_mib * MIB)
                per_device["cores_asked"].add_metric(labels, piece.cores / 100.0)
                per_device["cores_limit"].add_metric(labels, piece.cores_limit / 100.0)
                if piece.memory_used_mib is not None:
                    per_device["used"].add_metric(labels, piece.memory_used_mib * MIB)
                if piece.spilled_mib is not None:
                    per_device["spilled"].add_metric(labels, piece.spilled_mib * MIB)
                if piece.sm_util_percent is not None:
                    per_device["cores_used"].add_metric(labels, piece.sm_util_percent / 100.0)
    yield from gpu.values()
    yield from per_device.values()

    throttled = CounterMetricFamily(
        "vgpu_container_throttled_seconds",
        "Time the compute limiter held the container's live processes back",
        labels=CONTAINER_LABELS,
    )
    processes = _gauge("vgpu_container_processes", "Processes reporting from the container",
                       CONTAINER_LABELS)  # fmt: skip
    for pod in view.pods:
        for container in pod.containers:
            if not container.reporting:
                continue
            labels = [pod.node, pod.namespace, pod.name, container.name]
            throttled.add_metric(labels, (container.throttled_ms or 0) / 1000.0)
            processes.add_metric(labels, container.processes or 0)
    yield from (throttled, processes)

    totals = view.totals
    cluster = [
        ("vgpu_cluster_memory_total_bytes", "GPU memory in the cluster", totals.memory_mib),
        ("vgpu_cluster_memory_allocated_bytes", "GPU memory handed out in the cluster",
         totals.memory_allocated_mib),
        ("vgpu_cluster_free_memory_bytes",
         "Memory not handed out on healthy GPUs of nodes that report", totals.free_memory_mib),
        ("vgpu_cluster_stranded_memory_bytes",
         "Free GPU memory that no pending pod's shape fits", totals.stranded_memory_mib),
    ]  # fmt: skip
    for name, documentation, mib in cluster:
        family = _gauge(name, documentation, [])
        family.add_metric([], mib * MIB)
        yield family
    pending = _gauge("vgpu_pending_pods", "Pods waiting for GPUs", ["unresolvable"])
    waiting = {"true": 0, "false": 0}
    for entry in view.pending:
        waiting["true" if entry.unresolvable else "false"] += 1
    for flag, count in waiting.items():
        pending.add_metric([flag], count)
    yield pending


class ViewCollector(Collector):
    """Runs the given family functions over one fresh view per scrape."""

    def __init__(self, source: ViewSource,
                 *families: Callable[[ClusterView], Iterator[Metric]]) -> None:  # fmt: skip
        self._source = source
        self._families = families or (vgpu_families,)

    def collect(self) -> Iterator[Metric]:
        view = self._source()
        for families in self._families:
            yield from families(view)
