"""The allocator's settings (YAML section ``allocator``, env ``VGPU_<FIELD>``, flags)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.common.resources import (
    GPU,
    GPU_CORES,
    GPU_MEMORY,
    GPU_MEMORY_PERCENT,
    GPU_PRIORITY,
    RequestConfig,
    ResourceNames,
)

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0 = any free port (tests, `vgpu up`)
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Scaling = Annotated[float, msgspec.Meta(ge=1.0)]
PolicyName = Literal["binpack", "spread", "topology", "fgd", "hostpack"]


class AllocatorSettings(msgspec.Struct, kw_only=True, frozen=True):
    nats_url: str = "nats://127.0.0.1:4222"
    http_host: str = "127.0.0.1"
    http_port: Port = 8080
    # A node whose last inventory is older than this takes no new placements (it keeps
    # what it has).
    node_timeout_s: Seconds = 15.0
    otlp_endpoint: str = ""
    log_level: str = "info"
    # Request bodies past these sizes are answered 413 before anything is parsed. The
    # extender's default fits kube-scheduler's whole-Node bodies (nodeCacheCapable: false) of
    # ~5,000 nodes; with nodeCacheCapable: true a node costs ~20 bytes. The webhook's is the
    # API server's own request limit (3 MiB).
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024 * 1024
    webhook_max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 3 * 1024 * 1024

    # Placement. The default policy is the one that measured best on the openb trace.
    node_policy: PolicyName = "hostpack"
    gpu_policy: PolicyName = "hostpack"
    memory_reserve_mib: Annotated[int, msgspec.Meta(ge=0)] = 0  # per GPU: context + driver
    split_count: Annotated[int, msgspec.Meta(ge=1)] = 10  # task slots per GPU
    memory_scaling: Scaling = 1.0  # > 1 oversubscribes GPU memory (HAMi deviceMemoryScaling)
    node_memory_scaling: dict[str, Scaling] = {}  # per node, overriding memory_scaling
    # Compute shares on a GPU may sum to 100 x this (4paradigm's --device-cores-scaling).
    # memory_scaling, cores_scaling and split_count apply to GPUs whose node agent states no
    # figure of its own; node_memory_scaling overrides the agents' (docs/allocator.md).
    cores_scaling: Scaling = 1.0
    mix_window: Annotated[int, msgspec.Meta(ge=10)] = 2000  # recent pods FGD weighs
    # Python's cyclic GC: the first generation's threshold (0 = leave the default, 700). The
    # placement caches hold many small objects; frequent collections were the largest part of
    # the extender's p99 at 5,000 nodes (docs/benchmarks.md).
    gc_threshold: Annotated[int, msgspec.Meta(ge=0)] = 100_000

    # Requests: HAMi's names and defaults, renameable as in HAMi.
    resource_gpu: str = GPU
    resource_memory: str = GPU_MEMORY
    resource_memory_percent: str = GPU_MEMORY_PERCENT
    resource_cores: str = GPU_CORES
    resource_priority: str = GPU_PRIORITY
    default_memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0 = the whole card
    default_cores: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    translate_peers: bool = True  # Volcano, Aliyun, Tencent, AWS, KAI syntaxes
    # Aliyun gpushare's --memory-unit: what `aliyun.com/gpu-mem: N` counts (and the unit of
    # its ALIYUN_COM_GPU_MEM_* variables and annotations).
    memory_unit: Literal["GiB", "MiB"] = "GiB"
    # A bare `nvidia.com/gpu: N` gets, on each GPU, memory scaling x memory / split count and
    # no compute limit (4paradigm's plugin), instead of whole GPUs.
    count_only_equal_share: bool = False

    # State and replicas.
    state_bucket: str = "vgpu-allocations"  # JetStream KV bucket; "" = memory only
    state_replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    lease_bucket: str = "vgpu-allocator-lease"  # "" = always lead (one replica)
    lease_ttl_s: Seconds = 6.0
    replica_id: str = ""  # "" = host name and process id

    # Cluster: "local" is the in-memory API stand-in of `vgpu up`; "kubernetes" uses the
    # kubernetes client (in-cluster config, or `kubeconfig`).
    cluster: Literal["local", "kubernetes"] = "local"
    kubeconfig: str = ""
    kube_api_url: str = ""  # talk to this API server directly (tests, proxies)
    # At start, how long to wait for the first list of Nodes and bound pods before answering.
    cluster_sync_timeout_s: Seconds = 10.0
    # Reconciliation with the API server (the leader): a pod deleted or ended frees its
    # slices at once; a booking whose pod is still unbound (never bound, or its bind failed)
    # or that the API server does not have is freed once older than this; checked this often.
    release_unbound_after_s: Seconds = 60.0
    # A replica that does not lead frees a deleted pod's slices itself if the leader has not
    # within this time (no replica may lead: the leader died or lost its lease).
    follower_release_after_s: Seconds = 2.0
    reconcile_interval_s: Seconds = 5.0

    # Who may read /allocations and /metrics: "kubernetes" checks every caller's bearer token
    # with the API server (TokenReview, then SubjectAccessReview: list pods in a namespace or
    # cluster-wide; get /metrics) and shows only the namespaces it may list; "none" answers
    # anyone who reaches the port. docs/security.md.
    read_auth: Literal["none", "kubernetes"] = "none"
    auth_api_url: str = ""  # the API server asked; "" = kube_api_url, kubeconfig, in-cluster
    auth_cache_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=300)] = 10.0
    auth_cache_size: Annotated[int, msgspec.Meta(ge=1)] = 4096

    # Mutating admission webhook over HTTPS; -1 = off, 0 = any free port.
    webhook_port: Annotated[int, msgspec.Meta(ge=-1, le=65535)] = -1
    webhook_host: str = "0.0.0.0"
    tls_cert_file: str = ""
    tls_key_file: str = ""
    scheduler_name: str = "vgpu-scheduler"

    # The scheduler extender over HTTPS with client certificates (docs/security.md): its own
    # port, apart from http_port (health, metrics, allocations). -1 = no such port: the verbs
    # are served on http_port without authentication (tests and development only; logged).
    extender_port: Annotated[int, msgspec.Meta(ge=-1, le=65535)] = -1
    extender_host: str = "127.0.0.1"
    extender_cert_file: str = ""  # the extender's serving certificate and key
    extender_key_file: str = ""
    extender_client_ca_file: str = ""  # CA(s) whose client certificates are accepted
    # Identities accepted among those, comma-separated: "CN=name", "O=group", "DNS:name",
    # "URI:uri" or a bare name (CN or DNS SAN); empty = any certificate the client CA signed.
    extender_client_allowed: str = ""
    tls_reload_s: Seconds = 5.0  # how often the TLS files are checked for a rotation
    # A bind is accepted only for a node the filter passed for the pod this recently.
    bind_window_s: Seconds = 300.0
    # The webhook also gives pods that ask for no GPU `scheduler_name`, so the GPU-aware
    # host score places them too (docs/allocator.md, "Pods without GPUs").
    schedule_cpu_pods: bool = True
    # GPU pods naming one of these schedulers (a peer's that vgpu replaces) are given
    # `scheduler_name` too; others are left to the scheduler they name. HAMi's own is adopted
    # by default (nothing else serves it once vgpu replaces HAMi); add volcano or
    # kai-scheduler when vgpu replaces those (docs/migrating.md).
    adopt_schedulers: list[str] = msgspec.field(default_factory=lambda: ["hami-scheduler"])

    def request_config(self) -> RequestConfig:
        return RequestConfig(
            names=ResourceNames(
                gpu=self.resource_gpu,
                memory=self.resource_memory,
                memory_percent=self.resource_memory_percent,
                cores=self.resource_cores,
                priority=self.resource_priority,
            ),
            default_memory_mib=self.default_memory_mib,
            default_cores=self.default_cores,
            translate_peers=self.translate_peers,
            aliyun_unit_mib=1024 if self.memory_unit == "GiB" else 1,
            count_only_equal_share=self.count_only_equal_share,
        )
