from __future__ import annotations

import msgspec


class MetricsSettings(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    http_host: str = "127.0.0.1"
    http_port: int = 9400
    stale_after_s: float = 30.0  # a node silent for longer is shown as down, not as idle
    otlp_endpoint: str = ""
    log_level: str = "info"
