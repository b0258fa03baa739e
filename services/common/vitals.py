"""The background work a service cannot do without, and the first of it to end unasked.

A service run inside another process (`vgpu up` runs the allocator, the metrics service, the
node agents and the kubelet simulators in one) has no exit status to wait for: it is dead
when a loop it lives by (the agent's heartbeats, the allocator's lease, a gRPC server) has
ended while nobody was stopping it. The service hands those tasks to its `Vitals`; whoever
supervises it awaits `died()` and gets a sentence saying what ended and how.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

log = logging.getLogger("vgpu.vitals")


class Vitals:
    def __init__(self, service: str) -> None:
        self.service = service
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._stopping = False
        self._death: asyncio.Future[str] | None = None
        self.reason = ""  # why it died; "" while alive

    def watch(self, what: str, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """`task` ending (returning, raising or being cancelled) before `stop()` is a death.
        A later task under the same name replaces this one (a loop restarted on purpose)."""
        self._tasks[what] = task
        task.add_done_callback(lambda ended: self._ended(what, ended))
        return task

    def watch_all(self, what: str, tasks: Iterable[asyncio.Task[Any]]) -> None:
        for index, task in enumerate(tasks):
            self.watch(f"{what}[{index}]", task)

    def watch_awaitable(self, what: str, awaitable: Awaitable[Any]) -> asyncio.Task[Any]:
        """For what only offers "wait until you end" (a gRPC server's wait_for_termination).
        Never cancelled here: cancelling grpc's wait cancels the server's own shutdown future
        (its stop then fails); stopping the server ends the wait."""

        async def wait() -> Any:
            return await awaitable

        return self.watch(what, asyncio.ensure_future(wait()))

    def _ended(self, what: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            how = f"{what} was cancelled"
        elif (error := task.exception()) is not None:  # retrieved here: no "never retrieved"
            how = f"{what} raised {type(error).__name__}: {error}"
        else:
            how = f"{what} ended"
        if self._stopping or self._tasks.get(what) is not task:
            return  # stopped on purpose, or replaced by a newer one
        self.fail(how)

    def fail(self, reason: str) -> None:
        """Declare the service dead (the first reason wins)."""
        if self._stopping or self.reason:
            return
        self.reason = reason
        log.error(
            "%s died: %s", self.service, reason,
            extra={"service": self.service, "reason": reason},
        )  # fmt: skip
        if self._death is not None and not self._death.done():
            self._death.set_result(reason)

    def stop(self) -> None:
        """From now on every watched task ends on purpose (their owners stop them)."""
        self._stopping = True

    @property
    def alive(self) -> bool:
        return not self.reason and not self._stopping

    def tasks(self) -> dict[str, asyncio.Task[Any]]:
        """What is watched now, by name (for health pages and fault-injection tests)."""
        return dict(self._tasks)

    async def died(self) -> str:
        """Until the service dies; why. Never returns once it is stopped on purpose."""
        if self.reason:
            return self.reason
        if self._death is None:
            self._death = asyncio.get_running_loop().create_future()
        return await asyncio.shield(self._death)
