"""Stopping a background task even when a cancellation gets lost.

A cancellation can be swallowed on its way into a task: on Python 3.11 `asyncio.wait_for`
returns its awaitable's result instead of raising when the cancellation lands just as that
awaitable finishes (3.12 fixed it; services use `asyncio.timeout` instead), and libraries
catch `CancelledError` themselves (nats-py's flush does). A loop task whose cancellation was
lost goes on to its next round, and a stop that awaits it waits forever: the node agent's
janitor hung `agent.stop()` that way. `stop_task` cancels again while the task runs on, so a
stop always finishes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("vgpu.tasks")

LOST_CANCELLATIONS = Counter(
    "vgpu_task_lost_cancellations_total",
    "Background tasks that ran on after being cancelled and had to be cancelled again",
    ["task"],
)

RETRY_S = 1.0  # a loop task ends within milliseconds of a cancellation it received
ATTEMPTS = 10


async def stop_task(
    task: asyncio.Task[Any],
    what: str,
    *,
    retry_s: float = RETRY_S,
    attempts: int = ATTEMPTS,
    fields: dict[str, Any] | None = None,
) -> bool:
    """Cancel `task` and wait until it ends, cancelling it again every `retry_s` while it runs
    on; True once it has ended. After `attempts` cancellations it is left running (an error
    log says so) rather than hanging the caller. An exception the task ended with, other than
    its cancellation, is raised, as awaiting the task would."""
    extra = {**(fields or {}), "task": what}
    for attempt in range(1, attempts + 1):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=retry_s)
        if done:
            break
        LOST_CANCELLATIONS.labels(task=what).inc()
        log.warning(
            "task ran on after its cancellation; cancelling it again",
            extra={**extra, "attempt": attempt, "where": _where(task)},
        )
    else:
        log.error(
            "task still running after repeated cancellations; left running",
            extra={**extra, "attempts": attempts, "where": _where(task)},
        )
        return False
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
    return True


def _where(task: asyncio.Task[Any]) -> str:
    """The line the task waits at, for the log: what swallowed its cancellation."""
    frames = task.get_stack()
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
