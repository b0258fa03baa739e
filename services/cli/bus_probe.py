"""Is the bus there? A NATS server greets every new connection with an INFO line.

`vgpu submit` and `vgpu inspect` ask this first, so that a bus outage is reported as one
("the bus (NATS at URL) is unreachable") rather than as node agents that do not answer.
"""

from __future__ import annotations

import socket
import urllib.parse

HINT = "`vgpu up` restarts its own NATS server by itself; see docs/operations.md"


def bus_problem(nats_url: str, timeout_s: float = 2.0) -> str | None:
    """None when a NATS server answers at `nats_url`; otherwise what is wrong, for people."""
    parsed = urllib.parse.urlsplit(nats_url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as connection:
            connection.settimeout(timeout_s)
            greeting = connection.recv(4)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        return f"the bus (NATS at {nats_url}) is unreachable: {reason}"
    if greeting != b"INFO":
        return f"the bus (NATS at {nats_url}) is unreachable: what answers there is not NATS"
    return None
