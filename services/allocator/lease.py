"""Which allocator replica leads: a key in a JetStream KV bucket whose entries expire.

The leader creates the key and renews it (compare-and-set on its revision) every third of
the TTL; if it dies, the key expires and a follower's create succeeds. A leader that cannot
renew steps down at once. Leadership only decides who runs the singleton duties (the pod
watch that releases slices, Kubernetes Events) and who reports ready; every replica answers
the extender safely because every decision is written compare-and-set (journal.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.js.api import KeyValueConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from services.common.tasks import stop_task

log = logging.getLogger("vgpu.allocator")

LEADER_KEY = "leader"


class Lease:
    def __init__(
        self,
        holder: str,
        ttl_s: float,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.holder = holder
        self.ttl_s = ttl_s
        self._on_change = on_change or (lambda leading: None)
        self._kv: KeyValue | None = None
        self._revision = 0
        self._task: asyncio.Task[None] | None = None
        self.leading = False

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The renewal loop (None before start and after stop)."""
        return self._task

    async def start(self, js: JetStreamContext, bucket: str) -> None:
        try:
            self._kv = await js.key_value(bucket)
        except BucketNotFoundError:
            self._kv = await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, ttl=self.ttl_s)
            )
        await self._round()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self._round()

    async def _round(self) -> None:
        assert self._kv is not None
        value = self.holder.encode()
        try:
            if self.leading:
                self._revision = await self._kv.update(LEADER_KEY, value, last=self._revision)
            else:
                self._revision = await self._kv.create(LEADER_KEY, value)
                self._set(True)
        except Exception as exc:  # someone else holds it, or NATS is away
            if self.leading:
                log.warning("lost the allocator lease", extra={"error": str(exc)})
            self._set(False)

    def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info("allocator role", extra={"holder": self.holder, "leader": leading})
            self._on_change(leading)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # nats-py's request is an asyncio.wait_for: on Python 3.11 it can swallow the
            # cancellation (the reply came at that moment) and the loop renews on.
            await stop_task(task, "allocator lease renewal", fields={"holder": self.holder})
        if self.leading and self._kv is not None:
            with contextlib.suppress(Exception):  # hand over at once instead of after the TTL
                await self._kv.delete(LEADER_KEY, last=self._revision)
        self._set(False)
        self._kv = None
