"""Durable decisions: each node's records in one JetStream KV key, written compare-and-set.

Key ``node.<node token>`` holds every PodAllocation on that node. A write names the revision
it last saw; if another allocator replica wrote the node since, the write is refused, the
journal reads the node back, takes the other replica's records, re-applies its own pending
changes on top (dropping an added pod that no longer fits: that bind lost the race and is
retried or refused) and writes again. So two replicas can never promise the same memory.

Writes to one node are serialised in this process and coalesced: a write carries every change
made to the node so far, so binds queued behind it return as soon as it lands. Other
replicas' writes arrive through a watch on the bucket and replace the local view of the node.

A write that fails without an answer (a timeout: the bus went away or the server stalled) may
still have been stored. The journal reads the key back: holding exactly the bytes sent, the
write counts as made; otherwise it failed, the caller undoes its change, and the journal
keeps writing the node's current records in the background until the store has them, so a
write that landed after all is overwritten by the undone state, never left behind
(docs/allocator.md, "Writes with an unknown outcome").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from services.common.kv_snapshot import watch_current
from services.common.schemas import PodAllocation
from services.common.subjects import node_token
from services.common.tasks import stop_task

from .ledger import Ledger
from .placement import overbooked, pod_charges

log = logging.getLogger("vgpu.allocator")

KEY_PREFIX = "node."
READ_BACK_ATTEMPTS = 3  # reads of a key after a write with no answer, before calling it failed
READ_BACK_TIMEOUT_S = 1.0  # each: the bind waits on them, and its caller has its own timeout
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0  # background rewrites of nodes whose write failed

UNANSWERED_WRITES = Counter(
    "vgpu_allocator_store_unanswered_writes_total",
    "Writes to the decision store that got no answer, by what reading the key back showed "
    "(landed: stored after all; failed: not stored, or could not be read)",
    ["outcome"],
)


class NodeRecords(msgspec.Struct, kw_only=True):
    """The value of one node's key in the bucket."""

    node: str
    pods: list[PodAllocation]


class JournalError(RuntimeError):
    """The store could not be written; the decision was not made durable."""


class LostRace(JournalError):
    """Another replica took the room first: these pods' records were dropped."""

    def __init__(self, uids: set[str]) -> None:
        self.uids = uids
        super().__init__(f"another allocator replica took the room first for {sorted(uids)}")


def node_key(node: str) -> str:
    return KEY_PREFIX + node_token(node)


_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder(NodeRecords)


@dataclass
class _NodeJournal:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    revision: int = 0
    added: set[str] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)
    changed: set[str] = field(default_factory=set)
    generation: int = 0  # local changes made
    written: int = 0  # local changes durable
    lost: set[str] = field(default_factory=set)  # added pods another replica pushed out


class Journal:
    """Keeps the ledger and the KV bucket in step. With no bucket it only tracks changes."""

    def __init__(
        self,
        ledger: Ledger,
        on_remote: Callable[[str], None] | None = None,
        connected: Callable[[], bool] = lambda: True,
    ) -> None:
        """`connected` says whether the bus to the store is up right now."""
        self._ledger = ledger
        self._kv: KeyValue | None = None
        self._nodes: dict[str, _NodeJournal] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._rewatches: set[asyncio.Task[None]] = set()
        self._watch_lock = asyncio.Lock()  # one (re)watch at a time: never two followers
        self._retry_task: asyncio.Task[None] | None = None  # rewrites nodes left unwritten
        self._on_remote = on_remote or (lambda node: None)
        self._connected = connected
        self.loaded = asyncio.Event()

    @property
    def durable(self) -> bool:
        return self._kv is not None

    def _node(self, node: str) -> _NodeJournal:
        found = self._nodes.get(node)
        if found is None:
            found = self._nodes[node] = _NodeJournal()
        return found

    # -- start / stop ---------------------------------------------------------------------

    async def open(self, js: JetStreamContext, bucket: str, replicas: int = 1) -> None:
        """Open (or create) the bucket, load every node's records, then follow changes."""
        try:
            self._kv = await js.key_value(bucket)
        except BucketNotFoundError:
            self._kv = await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, replicas=replicas)
            )
        await self._watch()
        self.loaded.set()

    async def _watch(self) -> None:
        """Apply the stored values, then follow changes (replacing an earlier watch)."""
        async with self._watch_lock:
            await self._watch_unlocked()

    async def _watch_unlocked(self) -> None:
        assert self._kv is not None
        entries, watcher = await watch_current(self._kv)
        for entry in entries:
            await self._apply_entry(entry)
        await self._stop_watch()
        self._watcher = watcher
        self._watch_task = asyncio.create_task(self._follow(watcher))

    async def resync(self) -> None:
        """After the bus came back: read every node's records again (a write by another
        replica meanwhile may never have reached the old watch) and watch anew."""
        if self._kv is not None:
            await self._watch()
            self._retry_unwritten()

    async def _stop_watch(self) -> None:
        task, self._watch_task = self._watch_task, None
        if task is not None:
            with contextlib.suppress(Exception):
                await stop_task(task, "store watch")
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _rewatch(self) -> None:
        if self._kv is not None:
            task = asyncio.create_task(self.resync())
            self._rewatches.add(task)
            task.add_done_callback(self._rewatch_done)

    def _rewatch_done(self, task: asyncio.Task[None]) -> None:
        self._rewatches.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("cannot watch the store again", extra={"error": str(task.exception())})

    async def close(self) -> None:
        for task in [*self._rewatches, self._retry_task]:
            if task is not None:
                task.cancel()
        await self._stop_watch()
        self._kv = None

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        # The watcher's queue is read directly, not through nats-py's `updates(timeout)`: that
        # is asyncio.wait_for, which on Python 3.11 returns an entry arriving just as the
        # cancellation lands instead of raising it, and close() then waited on this loop for
        # an hour (a CI run hung in the allocator's stop).
        async for entry in watcher:
            if entry is None:
                continue  # the end of the initial values
            await self._apply_entry(entry)
        # The watcher was stopped. An old one: end quietly. The current one: watch anew, or
        # other replicas' writes stop coming.
        if watcher is self._watcher:
            log.warning("the store's watch ended; watching it again")
            asyncio.get_running_loop().call_soon(self._rewatch)

    async def _apply_entry(self, entry: KeyValue.Entry) -> None:
        if not entry.key.startswith(KEY_PREFIX):
            return
        try:
            records = (
                NodeRecords(node="", pods=[])
                if entry.operation in ("DEL", "PURGE") or not entry.value
                else _decoder.decode(entry.value)
            )
        except msgspec.DecodeError as exc:
            log.error(
                "undecodable node records in the store", extra={"key": entry.key, "error": str(exc)}
            )
            return
        node = records.node or entry.key[len(KEY_PREFIX) :]
        journal = self._node(node)
        async with journal.lock:
            if entry.revision <= journal.revision:
                return  # our own write coming back, or older
            # A pending pod the other replica's write left no room for is dropped here: its
            # bind must hear so (save raises LostRace), or it binds a pod nothing books.
            journal.lost |= self._take(node, records.pods, journal)
            journal.revision = entry.revision
        self._on_remote(node)

    # -- local changes --------------------------------------------------------------------

    def added(self, node: str, uid: str) -> None:
        journal = self._node(node)
        journal.added.add(uid)
        journal.removed.discard(uid)
        journal.generation += 1

    def removed(self, node: str, uid: str) -> None:
        journal = self._node(node)
        journal.removed.add(uid)
        journal.added.discard(uid)
        journal.changed.discard(uid)
        journal.generation += 1

    def changed(self, node: str, uid: str) -> None:
        journal = self._node(node)
        journal.changed.add(uid)
        journal.generation += 1

    def check_reachable(self) -> None:
        """JournalError while the bus to the store is known to be down: a decision made now
        would wait out the write's timeout (its caller's, often) and could still land after
        the caller gave up, so none is made."""
        if self._kv is not None and not self._connected():
            raise JournalError("the store is unreachable: the bus to NATS is down")

    async def save(self, node: str, uid: str = "") -> None:
        """Make every local change to `node` so far durable. LostRace when the pod `uid`
        was pushed out by another replica's writes; JournalError when the store fails."""
        journal = self._node(node)
        wanted = journal.generation
        async with journal.lock:
            if journal.written < wanted:
                await self._write(node, journal)
        if uid and uid in journal.lost:
            journal.lost.discard(uid)
            raise LostRace({uid})
        placed = self._ledger.get(uid) if uid else None
        if uid and (placed is None or placed.node != node):
            raise LostRace({uid})  # whatever dropped it: never report a pod stored that is not

    async def _write(self, node: str, journal: _NodeJournal) -> None:
        for _ in range(8):
            if self._kv is None:
                journal.written = journal.generation
                break
            generation = journal.generation
            value = _encode(NodeRecords(node=node, pods=self._ledger.on_node(node)))
            try:
                journal.revision = await self._kv.update(
                    node_key(node), value, last=journal.revision
                )
            except KeyWrongLastSequenceError:
                try:
                    lost, stored = await self._reconcile(node, journal)
                except Exception as exc:  # the read after the refusal failed (bus away)
                    self._retry_unwritten()
                    raise JournalError(f"cannot read node {node!r} back: {exc}") from exc
                journal.lost |= lost
                if stored == {a.uid: a for a in self._ledger.on_node(node)}:
                    # Another replica already made our changes (a follower freeing a pod
                    # the leader freed): writing them again only bumps the revision and
                    # makes every other writer of this node lose its compare-and-set.
                    journal.written = journal.generation
                    break
                continue
            except Exception as exc:
                revision = await self._read_back(node, value, journal.revision)
                if revision is None:
                    UNANSWERED_WRITES.labels(outcome="failed").inc()
                    self._retry_unwritten()  # the undone state must replace what may land
                    raise JournalError(f"cannot write node {node!r} to the store: {exc}") from exc
                UNANSWERED_WRITES.labels(outcome="landed").inc()
                log.warning(
                    "a write to the store got no answer but was stored",
                    extra={"node": node, "revision": revision, "error": str(exc)},
                )
                journal.revision = revision
            journal.written = generation
            break
        else:
            self._retry_unwritten()  # the change stays ours: it lands once writers calm down
            raise JournalError(f"node {node!r}: the store kept changing under us")
        if journal.written >= journal.generation:
            journal.added.clear()
            journal.removed.clear()
            journal.changed.clear()
        if len(journal.lost) > 10_000:
            journal.lost.clear()

    async def _read_back(self, node: str, value: bytes, after: int) -> int | None:
        """The revision at which `value` was stored after revision `after`, read from the
        store; None when the key holds something else or cannot be read."""
        assert self._kv is not None
        for attempt in range(READ_BACK_ATTEMPTS):
            try:
                async with asyncio.timeout(READ_BACK_TIMEOUT_S):
                    entry = await self._kv.get(node_key(node))
            except KeyNotFoundError:
                return None
            except Exception as exc:  # the bus is still away: try again, a few times
                log.debug("cannot read a key back", extra={"node": node, "error": str(exc)})
                await asyncio.sleep(RETRY_MIN_S * (attempt + 1))
                continue
            revision = entry.revision or 0
            return revision if revision > after and entry.value == value else None
        return None

    def _retry_unwritten(self) -> None:
        """Write, in the background and until they land, the nodes whose last write failed."""
        if self._kv is None or (self._retry_task is not None and not self._retry_task.done()):
            return
        self._retry_task = asyncio.get_running_loop().create_task(self._rewrite_unwritten())

    async def _rewrite_unwritten(self) -> None:
        pause = RETRY_MIN_S
        while self._kv is not None:
            unwritten = [n for n, j in self._nodes.items() if j.written < j.generation]
            if not unwritten:
                return
            for node in unwritten:
                try:
                    await self.save(node)
                except JournalError as exc:
                    log.info("node still unwritten", extra={"node": node, "error": str(exc)})
                    break
            else:
                pause = RETRY_MIN_S
                continue
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    async def _reconcile(
        self, node: str, journal: _NodeJournal
    ) -> tuple[set[str], dict[str, PodAllocation]]:
        """Take the store's records for `node`, then re-apply our pending changes. Returns
        the added pods that no longer fit, and the store's records by pod UID."""
        assert self._kv is not None
        try:
            entry = await self._kv.get(node_key(node))
            records = (
                _decoder.decode(entry.value) if entry.value else NodeRecords(node=node, pods=[])
            )
            revision = entry.revision or 0
        except KeyNotFoundError as exc:
            records, revision = NodeRecords(node=node, pods=[]), getattr(exc, "entry", None)
            revision = revision.revision if revision is not None and revision.revision else 0
        mine = {a.uid: a for a in self._ledger.on_node(node)}
        lost = self._take(node, records.pods, journal, mine)
        journal.revision = revision
        self._on_remote(node)
        return lost, {a.uid: a for a in records.pods}

    def _take(
        self,
        node: str,
        pods: list[PodAllocation],
        journal: _NodeJournal,
        mine: dict[str, PodAllocation] | None = None,
    ) -> set[str]:
        """Replace the ledger's view of `node` with `pods`, keeping our pending changes."""
        ledger = self._ledger
        mine = mine if mine is not None else {a.uid: a for a in ledger.on_node(node)}
        theirs = {a.uid: a for a in pods}
        for uid in list(mine):
            if uid not in theirs:
                ledger.release(uid)
        for uid, allocation in theirs.items():
            if uid in journal.removed:
                ledger.release(uid)  # we released it: our change wins
            elif uid in journal.changed and uid in mine:
                ledger.replace(mine[uid])
            else:
                ledger.replace(allocation)
        lost: set[str] = set()
        state = ledger.cluster.node(node)
        for uid in list(journal.added):
            allocation = mine.get(uid)
            if allocation is None or uid in theirs:
                continue
            charges = pod_charges(allocation.containers)
            if state is not None and overbooked(state, {}, charges):
                lost.add(uid)
                journal.added.discard(uid)
                continue
            ledger.record(allocation)
        return lost
