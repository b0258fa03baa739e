"""The windows where the allocator's view and its JetStream KV store can part (issue 15: a
pod bound but not booked, found once by the soak). Each test opens the window on a real
nats-server at the exact moment, with two journals standing for two allocator replicas.

- A remote write lands while a local bind waits to write: the watch re-applies the pending
  pod, or drops it when the other replica took the room; a dropped pod must fail its bind
  (LostRace), never return as if it were stored.
- A write gets no answer (the bus broke, or the server stalled) although the server stored
  it: read back, it counts as made; when it cannot be read back the caller undoes its change
  and the journal rewrites the node once the bus is back, so the store drops it too.

- A bind is retried (its caller timed out) while the first one's write still waits on the
  store: the retry is refused and nothing is bound; before, it found the first bind's
  record and told the cluster at once, and when the first write then failed its rollback
  left a pod bound that nothing booked (what the soak found: the store's 5 s timeout
  against the scheduler's 5 s).

The replica under test reaches the real nats-server through a TCP relay that can drop the
bytes of one direction (the answers, or the requests) and reset its connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.allocator.cluster import ClusterState
from services.allocator.journal import (
    UNANSWERED_WRITES,
    Journal,
    JournalError,
    LostRace,
    node_key,
)
from services.allocator.ledger import Ledger
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import ContainerAllocation, GpuSlice, PodAllocation

from .helpers import (
    A100_MIB,
    admit_to_cluster,
    bind_args,
    container,
    eventually,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
    stored_pods,
)
from .relay import Relay

BUCKET = "windows"


class Replica:
    """One allocator replica's ledger and journal on the shared bucket."""

    def __init__(self) -> None:
        self.cluster = ClusterState(node_timeout_s=3600)
        self.cluster.update(node_inventory("n1", count=1))
        self.ledger = Ledger(self.cluster)
        self.journal = Journal(self.ledger)

    async def open(self, bus: Bus, timeout_s: float = 5.0) -> Replica:
        await self.journal.open(bus.client.jetstream(timeout=timeout_s), BUCKET)
        return self

    def book(self, uid: str, mib: int) -> PodAllocation:
        """What a bind does before its write: record in the ledger, mark the node changed."""
        piece = GpuSlice(uuid="GPU-n1-0", index=0, memory_mib=mib, cores=0)
        allocation = PodAllocation(
            namespace="ns", name=uid, uid=uid, node="n1",
            containers={"m": ContainerAllocation(container="m", slices=[piece])},
        )  # fmt: skip
        self.ledger.record(allocation)
        self.journal.added("n1", uid)
        return allocation


async def stored(bus: Bus) -> set[str]:
    """The pods the store holds on n1."""
    return {a.uid for a in await stored_pods(bus, "n1", BUCKET)}


@pytest.fixture
async def replicas(bus: Bus) -> AsyncIterator[list[Replica]]:
    one, two = await Replica().open(bus), await Replica().open(bus)
    yield [one, two]
    await one.journal.close()
    await two.journal.close()


async def test_a_pending_pod_pushed_out_by_the_watch_fails_its_bind(
    bus: Bus, replicas: list[Replica]
) -> None:
    one, two = replicas
    one.book("mine", A100_MIB - 1000)  # recorded, its write not made yet
    two.book("theirs", A100_MIB - 1000)
    await two.journal.save("n1", "theirs")
    # The other replica's write reaches this one's watch before its own write is made.
    await eventually(lambda: "theirs" in one.ledger, timeout_s=10)
    assert "mine" not in one.ledger  # no room left for it beside "theirs"
    with pytest.raises(LostRace):
        await one.journal.save("n1", "mine")
    assert await stored(bus) == {"theirs"}


async def test_a_pending_pod_that_still_fits_survives_the_watch(
    bus: Bus, replicas: list[Replica]
) -> None:
    one, two = replicas
    one.book("mine", 10000)
    two.book("theirs", 10000)
    await two.journal.save("n1", "theirs")
    await eventually(lambda: "theirs" in one.ledger, timeout_s=10)
    await one.journal.save("n1", "mine")
    assert await stored(bus) == {"mine", "theirs"}


async def revision(bus: Bus) -> int:
    kv = await bus.client.jetstream().key_value(BUCKET)
    return (await kv.get(node_key("n1"))).revision or 0


async def test_a_release_the_store_already_holds_is_not_written_again(
    bus: Bus, replicas: list[Replica]
) -> None:
    """A follower freeing a pod the leader freed meanwhile: its write would change nothing
    but the revision, and at 50 pods/s such writes made the leader's compare-and-set lose
    eight times running ("the store kept changing under us", 164 times in the hour soak)."""
    one, two = replicas
    one.book("gone", 10000)
    await one.journal.save("n1", "gone")
    await eventually(lambda: "gone" in two.ledger, timeout_s=10)
    await two.journal._stop_watch()  # two hears nothing more: its revision goes stale
    one.ledger.release("gone")
    one.journal.removed("n1", "gone")
    await one.journal.save("n1")
    freed_at = await revision(bus)
    two.ledger.release("gone")  # the follower's own release of the same pod
    two.journal.removed("n1", "gone")
    await two.journal.save("n1")  # its compare-and-set fails; the store already agrees
    assert await revision(bus) == freed_at and await stored(bus) == set()
    two.book("next", 10000)  # the merge left two at the store's revision: no conflict now
    await two.journal.save("n1", "next")
    assert await revision(bus) == freed_at + 1 and await stored(bus) == {"next"}


@pytest.fixture
async def relayed(nats_server: EmbeddedNats, bus: Bus) -> AsyncIterator[tuple[Relay, Replica]]:
    """A replica behind a relay, its store calls timing out after 1 s."""
    relay = await Relay(nats_server.port).start()
    link = await Bus.connect(f"nats://{relay.url}", "relayed-replica")
    replica = await Replica().open(link, timeout_s=1.0)
    yield relay, replica
    relay.drop_answers = relay.drop_requests = False
    await replica.journal.close()
    await link.close()
    await relay.stop()


def unanswered(outcome: str) -> float:
    return UNANSWERED_WRITES.labels(outcome=outcome)._value.get()


async def until_stored(bus: Bus, uid: str) -> None:
    for _ in range(500):
        with contextlib.suppress(Exception):
            if uid in await stored(bus):
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{uid} never reached the store")


async def test_a_write_stored_without_an_answer_counts_as_made(
    bus: Bus, relayed: tuple[Relay, Replica]
) -> None:
    relay, one = relayed
    landed = unanswered("landed")
    one.book("p", 10000)
    relay.drop_answers = True  # the server stores the write; its answer never comes
    saving = asyncio.create_task(one.journal.save("n1", "p"))
    await until_stored(bus, "p")
    relay.drop_answers = False
    relay.reset()  # the connection breaks, as when NATS is killed: the client reconnects
    await saving  # no JournalError: the read-back found the write
    assert unanswered("landed") == landed + 1
    one.book("q", 10000)  # the journal knows the revision it made: no conflict, no merge
    await one.journal.save("n1", "q")
    assert await stored(bus) == {"p", "q"} and {"p", "q"} <= set(one.ledger._pods)


async def test_a_write_never_stored_fails_and_nothing_lands_later(
    bus: Bus, relayed: tuple[Relay, Replica]
) -> None:
    relay, one = relayed
    failed = unanswered("failed")
    one.book("p", 10000)
    relay.drop_requests = True  # the write never reaches the server
    saving = asyncio.create_task(one.journal.save("n1", "p"))
    await asyncio.sleep(0.3)
    relay.drop_requests = False
    relay.reset()
    with pytest.raises(JournalError):
        await saving
    assert unanswered("failed") == failed + 1
    one.ledger.release("p")  # what the bind does on JournalError
    one.journal.removed("n1", "p")
    await asyncio.sleep(1.0)  # a write the client kept to send later would be in by now
    assert "p" not in await stored(bus)


async def test_an_unreadable_outcome_is_undone_in_the_store_once_the_bus_is_back(
    bus: Bus, relayed: tuple[Relay, Replica]
) -> None:
    relay, one = relayed
    one.book("p", 10000)
    relay.drop_answers = True  # stored, but neither its answer nor a read back comes
    saving = asyncio.create_task(one.journal.save("n1", "p"))
    await until_stored(bus, "p")
    with pytest.raises(JournalError):
        await saving
    one.ledger.release("p")  # what the bind does on JournalError: the pod is not bound
    one.journal.removed("n1", "p")
    assert "p" in await stored(bus)  # for now the store holds a booking nobody stands behind
    relay.drop_answers = False
    relay.reset()
    for _ in range(1000):  # the journal's background rewrite takes it out
        if "p" not in await stored(bus):
            break
        await asyncio.sleep(0.01)
    assert "p" not in await stored(bus)


async def test_a_retried_bind_waits_for_the_first_ones_write(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    relay = await Relay(nats_server.port).start()
    allocator = Allocator(
        AllocatorSettings(nats_url=f"nats://{relay.url}", http_port=0), LocalClusterBackend()
    )
    await allocator.start()
    try:
        await give_nodes(bus, allocator, node_inventory("n1", count=1))
        p = pod("retried", [container("m", mem=10000)], namespace="ml")
        admit_to_cluster(allocator, p)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            url = allocator.url
            _, passed = await post(http, f"{url}/scheduler/filter", filter_args(p, ["n1"]))
            assert passed["NodeNames"] == ["n1"], passed
            relay.drop_requests = True  # the store stops answering: the first write hangs
            first = asyncio.create_task(post(http, f"{url}/scheduler/bind", bind_args(p, "n1")))
            uid = p["metadata"]["uid"]
            await eventually(lambda: uid in allocator.ledger, timeout_s=10)
            _, second = await post(http, f"{url}/scheduler/bind", bind_args(p, "n1"))
            _, answer = await first
        assert answer["Error"] and second["Error"], (answer, second)
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        bound = (await backend.get_pod("ml", "retried") or {})["spec"].get("nodeName")
        assert bound is None and uid not in allocator.ledger  # neither bound nor booked
    finally:
        relay.drop_requests = False
        await allocator.stop()
        await relay.stop()


async def test_a_refused_write_whose_read_back_fails_is_a_store_error(
    bus: Bus, relayed: tuple[Relay, Replica]
) -> None:
    """Compare-and-set refuses the write (another replica wrote the node) and the read of the
    node that follows gets no answer: the bind hears a JournalError and undoes its record,
    not an unexpected exception that left the record pending (seen in the soak)."""
    relay, one = relayed
    two = await Replica().open(bus)
    try:
        two.book("a", 1000)
        await two.journal.save("n1", "a")
        await eventually(lambda: "a" in one.ledger, timeout_s=10)
        await one.journal._stop_watch()  # it no longer hears the other replica's writes
        two.book("b", 1000)
        await two.journal.save("n1", "b")
        one.book("c", 1000)
        relay.lose_answer_to = b"GET.KV_"  # the read of the node after the refusal
        with pytest.raises(JournalError):
            await one.journal.save("n1", "c")
        assert relay.answers_lost == 1
    finally:
        await two.journal.close()


async def test_close_ends_the_watch_even_when_an_update_lands_with_the_cancellation(
    bus: Bus,
) -> None:
    """Python 3.11's asyncio.wait_for returns a result that arrives just as its cancellation
    lands instead of raising it; the journal's watch loop once read updates that way, went
    on waiting, and close() hung (a CI run stuck in the allocator's stop). Here an update is
    queued on the watch (as nats-py does when one arrives) in the same turn as the close."""
    replica = await Replica().open(bus)
    watcher = replica.journal._watcher
    assert watcher is not None
    await asyncio.sleep(0.1)  # the watch loop waits on its queue
    watcher._updates.put_nowait(None)  # an update arrives ...
    await asyncio.sleep(0)  # ... the loop's read of it completes ...
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(replica.journal.close(), 5)  # ... and close lands: it must end
    # (A hung close is cut by the 5 s, whose cancellation close swallows: hence the clock.)
    assert asyncio.get_running_loop().time() - started < 2
