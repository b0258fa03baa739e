"""Stopping a task whose cancellation gets lost: stop_task cancels again and always returns."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.common.tasks import stop_task

SERVICES = Path(__file__).resolve().parents[2] / "services"


def lost(task: str) -> float:
    value = REGISTRY.get_sample_value("vgpu_task_lost_cancellations_total", {"task": task})
    return value or 0.0


async def swallows_cancellations(count: int, rounds: list[int]) -> None:
    """A loop that catches its first `count` cancellations and carries on, as a library that
    catches CancelledError (nats-py's flush) or Python 3.11's wait_for makes a loop do."""
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if count == 0:
                raise
            count -= 1
        rounds.append(1)


async def test_a_task_that_ran_on_after_its_cancellation_is_cancelled_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds: list[int] = []
    task = asyncio.create_task(swallows_cancellations(1, rounds))
    await asyncio.sleep(0.02)
    before = lost("the janitor")
    async with asyncio.timeout(10):
        assert await stop_task(task, "the janitor", retry_s=0.1, fields={"node": "n1"})
    assert task.cancelled()
    assert rounds  # it did carry on after the first cancellation
    assert lost("the janitor") == before + 1
    (warning,) = [r for r in caplog.records if "cancelling it again" in r.getMessage()]
    assert (warning.task, warning.node, warning.attempt) == ("the janitor", "n1", 1)  # type: ignore[attr-defined]
    assert "test_tasks.py" in warning.where and "swallows_cancellations" in warning.where  # type: ignore[attr-defined]


async def test_a_task_that_never_ends_is_left_running_instead_of_hanging_the_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = asyncio.create_task(swallows_cancellations(5, []))
    await asyncio.sleep(0.02)
    async with asyncio.timeout(10):
        assert not await stop_task(task, "a stubborn loop", retry_s=0.01, attempts=3)
    assert not task.done()
    assert "still running after repeated cancellations" in caplog.text
    assert await stop_task(task, "a stubborn loop", retry_s=0.05, attempts=5)
    assert task.done()


async def test_a_plain_task_stops_at_once_and_its_error_is_raised() -> None:
    quiet = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    assert await stop_task(quiet, "a sleeper", retry_s=5)
    assert quiet.cancelled()

    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    failing = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await stop_task(failing, "a failing loop")
    finished = asyncio.create_task(asyncio.sleep(0))
    await finished
    assert await stop_task(finished, "done already")


def test_services_use_asyncio_timeout_not_wait_for() -> None:
    """On Python 3.11 wait_for loses a cancellation that lands as its awaitable finishes
    (the node agent's janitor then ran on and agent.stop() hung); asyncio.timeout does not."""
    users = {
        str(path.relative_to(SERVICES))
        for path in SERVICES.rglob("*.py")
        if re.search(r"\basyncio\.wait_for\(", path.read_text())
    }
    assert sorted(users) == []
