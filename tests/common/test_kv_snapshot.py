"""Reading a KV bucket's current values on a real nats-server, including the race in which
nats-py's end-of-values marker arrives before the values themselves."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from services.common.bus import Bus
from services.common.kv_snapshot import SnapshotError, read_current, watch_current


async def bucket(bus: Bus, name: str = "snap") -> KeyValue:
    return await bus.client.jetstream().create_key_value(KeyValueConfig(bucket=name, history=1))


@pytest.fixture
def early_end_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the server does under load: it answers the watch's consumer-info request before
    the values it already pushed reach the client, so nats-py queues its end marker first."""
    watch = KeyValue.watch

    async def racing_watch(self: KeyValue, *args: object, **kwargs: object) -> KeyValue.KeyWatcher:
        watcher = await watch(self, *args, **kwargs)
        queued = []
        while not watcher._updates.empty():
            queued.append(watcher._updates.get_nowait())
        for item in [None, *queued]:
            watcher._updates.put_nowait(item)
        return watcher

    monkeypatch.setattr(KeyValue, "watch", racing_watch)


async def test_every_current_value_and_no_deleted_key(bus: Bus) -> None:
    kv = await bucket(bus)
    for i in range(200):
        await kv.put(f"node.n{i}", f"v{i}".encode())
    await kv.put("node.n7", b"again")
    await kv.delete("node.n8")
    await kv.purge("node.n9")
    current = await read_current(kv)
    assert len(current) == 198
    assert current["node.n7"] == b"again" and current["node.n199"] == b"v199"
    assert "node.n8" not in current and "node.n9" not in current


async def test_an_early_end_marker_does_not_end_the_read(bus: Bus, early_end_marker: None) -> None:
    kv = await bucket(bus)
    for i in range(50):
        await kv.put(f"node.n{i}", b"x")
    # nats-py's own reader stops at the marker and sees nothing: the failure this module fixes.
    raw = await kv.watchall()
    assert await raw.updates(timeout=5) is None
    await raw.stop()
    assert len(await read_current(kv)) == 50


async def test_an_empty_bucket_reads_empty_and_the_watch_goes_on(bus: Bus) -> None:
    kv = await bucket(bus)
    entries, watcher = await asyncio.wait_for(watch_current(kv), 5)
    try:
        assert entries == []
        await kv.put("node.late", b"news")
        update = await watcher.updates(timeout=5)
        while update is None:  # nats-py's marker for the empty start
            update = await watcher.updates(timeout=5)
        assert update.key == "node.late" and update.value == b"news"
    finally:
        await watcher.stop()


async def test_values_written_during_the_read_are_not_lost(bus: Bus) -> None:
    kv = await bucket(bus)
    for i in range(300):
        await kv.put(f"node.n{i}", b"old")

    async def writer() -> None:
        for i in range(300, 400):
            await kv.put(f"node.n{i}", b"new")

    writing = asyncio.create_task(writer())
    entries, watcher = await watch_current(kv)
    await writing
    seen = {e.key for e in entries}
    try:
        while len(seen) < 400:  # what the snapshot did not hold, the watch brings
            update = await watcher.updates(timeout=5)
            if update is not None:
                seen.add(update.key)
    finally:
        await watcher.stop()
    assert {f"node.n{i}" for i in range(300)} <= {e.key for e in entries}


async def test_a_store_that_never_delivers_is_an_error_that_says_so(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = await bucket(bus)
    await kv.put("node.a", b"x")
    watch = KeyValue.watch

    async def silent_watch(self: KeyValue, *args: object, **kwargs: object) -> KeyValue.KeyWatcher:
        # Watch a subject nothing is written to: the values never come.
        return await watch(self, "nothing.here", **kwargs)

    monkeypatch.setattr(KeyValue, "watch", silent_watch)
    with pytest.raises(SnapshotError, match=r"read 0 of the bucket's values .* in 1s"):
        await read_current(kv, timeout_s=1.0)
