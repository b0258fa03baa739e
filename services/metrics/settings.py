from __future__ import annotations

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
    hami_metrics: bool = True  # also serve HAMi's metric names (hami_*)
    hami_legacy_metrics: bool = True  # and HAMi's older names (HostGPUMemoryUsage, ...)
    # It takes no request bodies (every route is a GET): anything past this is refused 413.
    max_body_bytes: int = 64 * 1024
    otlp_endpoint: str = ""
    log_level: str = "info"
