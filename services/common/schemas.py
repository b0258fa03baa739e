"""Messages on the wire: msgspec Structs encoded as JSON.

Every field of a reply has a default so that an error reply (``{"error": "..."}``) decodes
into any reply type. Sizes are MiB, compute shares are percent of a GPU's SMs (100 = all).
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec


class MigDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One MIG device (a compute instance inside a GPU instance) of a GPU in MIG mode."""

    uuid: str  # "MIG-<uuid>", what NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES take
    profile: str  # the device's profile: "1g.5gb", or "1c.3g.20gb" for a partial CI
    gi_profile: str  # its GPU instance's profile, e.g. "3g.20gb"
    gi_id: int
    ci_id: int
    start: int  # first memory slice of its GPU instance
    size: int  # memory slices of its GPU instance
    memory_mib: int
    sm_count: int = 0
    healthy: bool = True


class GpuDevice(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    index: int
    model: str
    memory_mib: int
    sm_count: int = 0
    numa_node: int = -1  # -1: the platform does not say
    healthy: bool = True
    pci_bus_id: str = ""  # as NVML reports it, e.g. "00000000:3B:00.0"
    compute_capability: str = ""  # e.g. "8.0"
    mig_mode: bool = False  # MIG enabled (current mode)
    nvlink_peers: list[str] = []  # UUIDs of GPUs of this node reached over an active NVLink
    # How the node shares this GPU, as its agent is configured (4paradigm's
    # --device-memory-scaling, --device-cores-scaling, --device-split-count); 0 = not stated,
    # the allocator's own settings apply (docs/allocator.md, "Capacity").
    memory_scaling: float = 0.0  # > 1: memory oversubscribed (slices may exceed the card)
    cores_scaling: float = 0.0  # compute shares on the GPU may sum to 100 x this
    split_count: int = 0  # tasks the GPU takes at most (device IDs advertised for it)
    # How the GPU is shared (docs/modes.md): vgpu (slices held by the hook), time-slicing
    # (replicas, no limits), mps (an MPS control daemon enforces each client's share) or
    # exclusive (whole GPU only). The agent fills these in from its settings.
    sharing_mode: str = "vgpu"
    replicas: int = 0  # device IDs advertised for it; 0 = the allocator's split count
    # NVIDIA's failRequestsGreaterThanOne: one replica per container (time-slicing / mps).
    one_replica_per_container: bool = False
    mig_devices: list[MigDevice] = []  # its MIG geometry (mig_mode only), GI then CI order
    # Dynamic MIG: the agent creates and destroys this GPU's MIG instances on demand, and the
    # allocator places memory requests on it by MIG geometry (docs/modes.md, section MIG).
    mig_dynamic: bool = False


class NodeInventory(msgspec.Struct, kw_only=True):
    node: str
    gpus: list[GpuDevice]
    agent_version: str = ""
    heartbeat_s: float = 5.0  # how often the agent promises to re-send this
    seq: int = 0  # increases with every publication from one agent process
    sent_at: float = msgspec.field(default_factory=time.time)
    driver_version: str = ""  # NVIDIA driver, e.g. "550.54.15"
    cuda_version: str = ""  # highest CUDA version the driver supports, e.g. "12.4"
    # Node-level capacity hints (0 = not reported): the node's allocatable CPU, memory and
    # pod count, as simulated nodes state them. In a cluster the allocator reads them from the
    # Node objects instead (what kube-scheduler checks); these fill in what those leave out.
    cpu_milli: int = 0
    host_memory_mib: int = 0
    max_pods: int = 0
    address: str = ""  # the node's IP, shown beside its name (gpushare's IPADDRESS)


class GpuUsage(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    memory_used_mib: int
    sm_util_percent: float
    memory_util_percent: float = 0.0


class NodeUsage(msgspec.Struct, kw_only=True):
    node: str
    gpus: list[GpuUsage]
    sent_at: float = msgspec.field(default_factory=time.time)


class ContainerDeviceUsage(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    index: int  # the GPU's host index
    memory_used_mib: int  # the container's total on this GPU, all its processes
    memory_limit_mib: int  # 0 = unlimited
    cores_limit: int  # percent of SMs; 0 = no compute limit
    sm_util_percent: float = -1.0  # the container's share of SM time; -1 = unknown
    # What NVML measures for the container's processes on this GPU (the agent's own figure,
    # whatever the hook says); -1 = no process of the container is on the GPU.
    measured_mib: int = -1
    # Standing findings of the agent's verification, comma-separated: "over_limit" (NVML
    # shows more than the slice plus tolerance), "tampering" (the hook's limits or figures
    # disagree with the agent's), "over_compute" (NVML shows more SM time than the cores
    # share while others want the GPU); "" = none.
    violation: str = ""
    # Of memory_used_mib: allocations the hook gave as managed memory because the card was
    # full (virtual device memory, memory scaling > 1); they page to host memory.
    spilled_mib: int = 0


class ContainerUsage(msgspec.Struct, kw_only=True):
    """What one container uses, relayed from its hook by the node agent."""

    node: str
    namespace: str
    pod: str
    container: str
    devices: list[ContainerDeviceUsage]
    processes: int = 0  # processes currently reporting
    launches: int = 0  # cumulative kernel launches of live processes
    throttled_ms: int = 0  # cumulative time held back by the compute limiter
    sent_at: float = msgspec.field(default_factory=time.time)


ViolationKind = Literal["over_limit", "tampering", "over_compute"]


class SliceViolation(msgspec.Struct, kw_only=True):
    """A container broke its slice on one GPU, as the node agent measured from outside it
    (NVML's per-process figures), or its hook's figures disagree with the agent's."""

    node: str
    namespace: str
    pod: str
    container: str
    gpu: str  # uuid
    kind: ViolationKind
    reason: str  # one sentence naming the figures
    limit_mib: int  # the slice (0 = unlimited)
    measured_mib: int  # NVML: the container's processes on this GPU
    tolerance_mib: int
    reported_mib: int = -1  # the hook's figure for the container; -1 = none
    pids: list[int] = []  # host PIDs of the container's processes on this GPU
    action: Literal["report", "kill"] = "report"
    killed_pids: list[int] = []  # SIGKILLed, newest first (action "kill")
    # over_compute: the cores share (percent of the GPU), NVML's SM share of the container's
    # processes and of everything else on the GPU (percent; -1 = not an over_compute finding)
    cores_limit: int = 0
    measured_sm_percent: float = -1.0
    others_sm_percent: float = -1.0
    sent_at: float = msgspec.field(default_factory=time.time)


class ContainerRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What one container asks for, already normalised from the pod's resources."""

    container: str
    gpus: int  # number of physical GPUs, each receiving one slice
    memory_mib: int = 0  # per GPU; 0 with memory_percent 0 means the whole GPU
    memory_percent: int = 0  # per GPU, used when memory_mib is 0
    cores: int = 0  # percent of each GPU's SMs; 0 = no compute limit
    init: bool = False
    priority: int = -1  # nvidia.com/priority as HAMi: 0 high, 1 low; -1 not given
    # A bare GPU count read with the equal-share option (4paradigm's behaviour): each GPU
    # gives S x M / K MiB (its memory scaling, memory, split count) and no compute limit.
    equal_share: bool = False
    # AWS's `k8s.amazonaws.com/vgpu: N`: N of the GPU's K vGPUs, K being that GPU's split
    # count as its node agent states it (AWS's --vgpu), so N x 100 / K percent of its memory
    # and compute, sized per GPU at placement; 0 = not an AWS request.
    vgpus: int = 0


class GpuSlice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # omit_defaults: a plain vgpu slice encodes as before (journal, annotations, events).
    uuid: str
    index: int
    memory_mib: int
    cores: int
    # Dynamic MIG: the slice is a MIG instance of this GI profile at this start memory slice,
    # which the node agent creates before Allocate answers; "" = a plain vgpu slice.
    mig_profile: str = ""
    mig_start: int = -1


class ContainerAllocation(msgspec.Struct, kw_only=True):
    container: str
    slices: list[GpuSlice]
    init: bool = False
    device_ids: list[str] = []  # the kubelet's device IDs, known once the agent claims
    claimed: bool = False


class PodAllocation(msgspec.Struct, kw_only=True):
    namespace: str
    name: str
    uid: str
    node: str
    containers: dict[str, ContainerAllocation]  # keyed by container name, never by position
    bound_at: float = msgspec.field(default_factory=time.time)
    traceparent: str = ""  # W3C trace context of the pod's scheduling trace
    # The node's memory scaling when placed: > 1 means memory is oversubscribed (HAMi's
    # deviceMemoryScaling), so the slices may together exceed the cards' physical memory.
    memory_scaling: float = 1.0
    policy: str = ""  # node/GPU policy that placed it, e.g. "fgd" or "binpack/spread"


class AllocationEvent(msgspec.Struct, kw_only=True):
    kind: Literal["bound", "claimed", "released"]
    allocation: PodAllocation
    at: float = msgspec.field(default_factory=time.time)


class ClaimRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Node agent -> allocator: this container now holds these device IDs."""

    node: str
    namespace: str
    pod: str
    container: str
    device_ids: list[str]
    gpu_uuids: list[str]  # the physical GPUs behind device_ids, in the order exposed
    # Set when only the kubelet checkpoint knew the owner (plain init containers): the pod is
    # then named by UID, and namespace/pod are empty.
    pod_uid: str = ""


class ClaimReply(msgspec.Struct, kw_only=True):
    error: str = ""
    pod_uid: str = ""
    allocation: ContainerAllocation | None = None
    traceparent: str = ""
    namespace: str = ""  # the claimed pod's, so a claim by UID learns its name
    pod: str = ""


class PreferredRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Node agent -> allocator: which GPUs should the kubelet pick for `size` devices?"""

    node: str
    available_gpus: list[str]  # uuids of GPUs that still have a free device ID
    size: int


class PreferredReply(msgspec.Struct, kw_only=True):
    error: str = ""
    gpu_uuids: list[str] = []
    # The hinted container's slices on those GPUs (same order): what an MPS client's share
    # is set from at Allocate, which names no pod.
    slices: list[GpuSlice] = []


class MigPrepareRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Node agent -> allocator, in Allocate: which MIG instance should the container of
    directory `key` get on dynamic-MIG GPU `gpu_uuid`?"""

    node: str
    gpu_uuid: str
    key: str  # the container directory key (hash of its device IDs): retries get one answer


class MigPrepareReply(msgspec.Struct, kw_only=True):
    error: str = ""
    profile: str = ""  # GI profile, e.g. "1g.5gb"
    start: int = -1  # start memory slice
    pod_uid: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""


class ErrorReply(msgspec.Struct, kw_only=True):
    error: str


class PendingReason(msgspec.Struct, frozen=True, kw_only=True):
    """One reason a pending pod was refused, and which nodes gave it."""

    message: str  # as the extender wrote it for kube-scheduler, without the node's name
    nodes: list[str] = []  # nodes that gave this reason (the publisher may cut the list)
    node_count: int = 0  # how many nodes gave it, also where `nodes` was cut


class PendingPod(msgspec.Struct, kw_only=True):
    """Allocator -> everyone: a pod that waits for GPUs, and why (docs/events.md)."""

    namespace: str
    name: str
    uid: str
    requests: list[ContainerRequest] = []  # the shapes it asks for, init containers first
    reasons: list[PendingReason] = []
    unresolvable: bool = False  # can never fit in this cluster as it is
    waiting: bool = True  # False: it no longer waits (bound, deleted): forget it
    since: float = msgspec.field(default_factory=time.time)  # first refused at
    sent_at: float = msgspec.field(default_factory=time.time)


class FilterPassQuery(msgspec.Struct, frozen=True, kw_only=True):
    """An allocator replica asks its peers whether their filter passed a pod for a node."""

    uid: str
    node: str


class FilterPassAnswer(msgspec.Struct, frozen=True, kw_only=True):
    age_s: float  # seconds since that filter pass, on the answering replica's clock
