"""Every current value of a JetStream KV bucket, read without trusting nats-py's end marker.

nats-py ends a watch's initial values with a `None` that it decides from the consumer's info:
no messages pending on the server and none received yet. Under load the server answers that
info request before the messages it has already pushed reach the client, so the `None` can
come first and a reader that stops there sees an empty bucket (an audit once read "no keys"
from a bucket holding 15 bookings). Here the end is decided from the messages themselves: the
stream's last sequence is read before the watch starts, and the initial values are complete
once a delivered entry reaches it, or one arrives with nothing pending behind it.
"""

from __future__ import annotations

import asyncio

from nats.js.kv import KeyValue

DEFAULT_TIMEOUT_S = 30.0


class SnapshotError(RuntimeError):
    """The bucket's current values did not all arrive in time (the store is slow or away)."""


async def watch_current(
    kv: KeyValue, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[list[KeyValue.Entry], KeyValue.KeyWatcher]:
    """Each key's current entry, deletes and purges included (their `operation` says), and
    the watcher that goes on with every later change; the caller stops the watcher."""
    state = (await kv.status()).stream_info.state
    watcher = await kv.watchall()
    entries: list[KeyValue.Entry] = []
    if not state.messages:
        return entries, watcher  # empty before the watch: whatever comes later is news
    try:
        # asyncio.timeout, not nats-py's `updates(timeout)` (asyncio.wait_for): on Python 3.11
        # that can swallow a cancellation of the reader.
        async with asyncio.timeout(timeout_s):
            async for entry in watcher:
                if entry is None:
                    continue  # nats-py's end marker: sometimes early, so not the end here
                entries.append(entry)
                if (entry.revision or 0) >= state.last_seq or entry.delta == 0:
                    return entries, watcher
        raise SnapshotError("the watch was stopped before the bucket's values were read")
    except TimeoutError as exc:
        await watcher.stop()
        seen = max((e.revision or 0 for e in entries), default=0)
        raise SnapshotError(
            f"read {len(entries)} of the bucket's values up to sequence {seen} of "
            f"{state.last_seq} in {timeout_s:.0f}s"
        ) from exc
    except BaseException:
        await watcher.stop()
        raise


async def read_current(kv: KeyValue, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, bytes]:
    """key -> current value of every key that has one (deleted and purged keys left out)."""
    entries, watcher = await watch_current(kv, timeout_s)
    await watcher.stop()
    current: dict[str, bytes] = {}
    for entry in entries:
        if entry.operation in (None, "PUT") and entry.value is not None:
            current[entry.key] = entry.value
        else:
            current.pop(entry.key, None)
    return current
