from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class MetricsSettings(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    http_host: str = "127.0.0.1"
    http_port: int = 9400
    stale_after_s: float = 30.0  # a node silent for longer is shown as down, not as idle
    pending_ttl_s: float = 900.0  # kube-scheduler retries a pending pod at least every 5 min
    stream_interval_s: float = 0.25  # changes are sent to SSE clients at most this often
    stream_queue: int = 64  # change batches a slow SSE client may lag before it is dropped
    kv_bucket: str = "vgpu-allocations"  # JetStream KV bucket of the allocator's decisions
    kv_timeout_s: float = 5.0  # give up rebuilding from KV after this long (events still flow)
    # The dashboard's one unit for memory, chosen once for the whole page (the JSON API
    # stays in MiB): GiB reads best for today's cards, MiB as nvidia-smi prints it.
    memory_unit: Literal["GiB", "MiB"] = "GiB"
    # Pending pods listed by the dashboard, the picture, the live stream and
    # /api/v1/pending (longest waiting first); the count of all of them is in the totals.
    pending_shown: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 50
    hami_metrics: bool = True  # also serve HAMi's metric names (hami_*)
    hami_legacy_metrics: bool = True  # and HAMi's older names (HostGPUMemoryUsage, ...)
    # It takes no request bodies (every route is a GET): anything past this is refused 413.
    max_body_bytes: int = 64 * 1024
    # Who may read: "kubernetes" checks every caller's bearer token with the API server
    # (TokenReview, then SubjectAccessReview: list pods in a namespace or cluster-wide; get
    # /metrics) and shows only the namespaces it may list; "none" shows everything to anyone
    # who reaches the port (only behind another guard). docs/security.md.
    read_auth: Literal["none", "kubernetes"] = "none"
    auth_api_url: str = ""  # the API server asked; "" = auth_kubeconfig, else in-cluster
    auth_kubeconfig: str = ""
    auth_cache_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=300)] = 10.0
    auth_cache_size: Annotated[int, msgspec.Meta(ge=1)] = 4096
    otlp_endpoint: str = ""
    log_level: str = "info"
