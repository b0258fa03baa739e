"""Reading the allocator's decisions back after a restart, from its JetStream KV bucket.

Events only tell what changes from now on; the decisions already made live in the
allocator's KV bucket. Its layout is the allocator's journal (services/allocator/journal.py):
key `node.<node token>` holds `{"node": ..., "pods": [PodAllocation, ...]}`, every pod on that
node, written compare-and-set. The reader mirrors that value shape here because no service
imports another. `DecisionSource` is the seam: the KV reader, or anything else that can list
PodAllocation records. A missing bucket or an unreachable JetStream is not an error: the
picture then fills from events alone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.js.errors import BucketNotFoundError
from nats.js.errors import Error as JetStreamError
from nats.js.kv import KeyValue

from services.common.kv_snapshot import SnapshotError, read_current
from services.common.schemas import PodAllocation

log = logging.getLogger("vgpu.metrics")

KEY_PREFIX = "node."  # one key per node; other keys in the bucket are not decisions


class NodeRecords(msgspec.Struct, kw_only=True):
    """The value of one node's key: every PodAllocation on that node."""

    node: str = ""
    pods: list[PodAllocation] = []


_decoder = msgspec.json.Decoder(NodeRecords)


@dataclass
class Decisions:
    allocations: list[PodAllocation] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # keys whose value did not decode
    found: bool = True  # False: there is no such state to read (yet)


class DecisionSource(Protocol):
    async def load(self) -> Decisions: ...


def decode_record(key: str, value: bytes, into: Decisions) -> None:
    try:
        record = _decoder.decode(value)
    except msgspec.DecodeError as exc:
        into.malformed.append(key)
        log.warning("undecodable decision record", extra={"key": key, "error": str(exc)})
        return
    into.allocations.extend(record.pods)


class KvDecisionSource:
    """Latest value of every key in the bucket (deleted keys are skipped)."""

    def __init__(self, client: NatsClient, bucket: str, timeout_s: float = 5.0) -> None:
        self._client = client
        self._bucket = bucket
        self._timeout_s = timeout_s

    async def load(self) -> Decisions:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._load()
        except BucketNotFoundError:
            log.info("no decisions bucket yet; the picture fills from events",
                     extra={"bucket": self._bucket})  # fmt: skip
        except (TimeoutError, JetStreamError, NatsError, SnapshotError) as exc:
            log.warning("cannot read the decisions bucket; the picture fills from events",
                        extra={"bucket": self._bucket, "error": repr(exc)})  # fmt: skip
        return Decisions(found=False)

    async def _load(self) -> Decisions:
        kv: KeyValue = await self._client.jetstream().key_value(self._bucket)
        decisions = Decisions()
        for key, value in (await read_current(kv, self._timeout_s)).items():
            if key.startswith(KEY_PREFIX) and value:
                decode_record(key, value, decisions)
        return decisions
