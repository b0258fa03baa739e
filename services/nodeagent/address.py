"""The node's IP address as the agent states it in its inventory (gpushare's inspect and
`vgpu inspect` show it beside the node's name).

The `node_ip` setting wins (the DaemonSet may set it from the downward API's status.hostIP);
otherwise the address this host uses to reach the NATS server, read from a connected UDP
socket (connect() on UDP sends nothing: it only chooses the route and source address).
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def address_towards(nats_url: str) -> str:
    """The local source address for the first server of `nats_url`; "" if it has no route."""
    first = nats_url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    if not parts.hostname:
        return ""
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 4222, type=socket.SOCK_DGRAM)
    except OSError:
        return ""
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(target)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return ""


def node_address(node_ip: str, nats_url: str) -> str:
    return node_ip or address_towards(nats_url)
