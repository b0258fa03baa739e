"""Fan-out of change batches to server-sent-event clients.

Each client has a bounded queue of ready-made frames. A client that falls that far behind is
ended rather than allowed to grow memory: its browser's EventSource reconnects on its own and
starts again from a fresh snapshot, which is always correct because change batches carry
whole node and pod views.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Counter, Gauge

CLIENTS = Gauge("vgpu_metrics_stream_clients", "Live server-sent-event clients")
DROPPED = Counter(
    "vgpu_metrics_stream_dropped_clients_total",
    "Server-sent-event clients ended because they fell too far behind",
)


def frame(event: str, data: bytes, event_id: int | None = None) -> bytes:
    """One SSE frame; `data` is compact JSON, so it is a single line."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return head.encode() + b"data: " + data + b"\n\n"


class StreamClient:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(size)

    def end(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class ChangeStream:
    def __init__(self, queue_size: int) -> None:
        self._size = max(1, queue_size)
        self._clients: set[StreamClient] = set()
        self._closed = False

    @property
    def has_clients(self) -> bool:
        return bool(self._clients)

    def subscribe(self) -> StreamClient:
        client = StreamClient(self._size)
        if self._closed:
            client.end()
        else:
            self._clients.add(client)
            CLIENTS.inc()
        return client

    def unsubscribe(self, client: StreamClient) -> None:
        if client in self._clients:
            self._clients.discard(client)
            CLIENTS.dec()

    def publish(self, data: bytes) -> None:
        for client in list(self._clients):
            try:
                client.queue.put_nowait(data)
            except asyncio.QueueFull:
                DROPPED.inc()
                self.unsubscribe(client)
                client.end()

    def close(self) -> None:
        """End every stream (the service is stopping) and refuse new ones."""
        self._closed = True
        for client in list(self._clients):
            self.unsubscribe(client)
            client.end()
