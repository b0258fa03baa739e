"""The allocator's settings (YAML section ``allocator``, env ``VGPU_<FIELD>``, flags)."""

from __future__ import annotations

from typing import Annotated

import msgspec

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0 = any free port (tests, `vgpu up`)
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class AllocatorSettings(msgspec.Struct, kw_only=True, frozen=True):
    nats_url: str = "nats://127.0.0.1:4222"
    http_host: str = "127.0.0.1"
    http_port: Port = 8080
    # A node whose last inventory is older than this is unavailable for new placements.
    node_timeout_s: Seconds = 15.0
    otlp_endpoint: str = ""
    log_level: str = "info"
