"""What counts as a service's death: a watched loop ending while nobody stops the service."""

from __future__ import annotations

import asyncio

from services.common.vitals import Vitals


async def crash_after(delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    raise RuntimeError("the NVML handle went away")


async def forever() -> None:
    await asyncio.Event().wait()


async def test_a_loop_that_raises_is_a_death_named_with_its_exception() -> None:
    vitals = Vitals("node agent n1")
    vitals.watch("the heartbeat loop", asyncio.create_task(crash_after(0.01)))
    vitals.watch("the janitor", asyncio.create_task(forever()))
    reason = await asyncio.wait_for(vitals.died(), 5)
    assert reason == "the heartbeat loop raised RuntimeError: the NVML handle went away"
    assert not vitals.alive and vitals.reason == reason
    vitals.tasks()["the janitor"].cancel()


async def test_loops_ending_at_a_stop_or_replaced_on_purpose_are_no_death() -> None:
    vitals = Vitals("allocator")
    first = vitals.watch("the lease", asyncio.create_task(forever()))
    vitals.watch("the lease", asyncio.create_task(forever()))  # renewed: the first is retired
    first.cancel()
    await asyncio.sleep(0.01)
    assert vitals.alive
    vitals.stop()
    vitals.tasks()["the lease"].cancel()
    await asyncio.sleep(0.01)
    assert vitals.reason == ""
    waiting = asyncio.create_task(vitals.died())
    await asyncio.sleep(0.01)
    assert not waiting.done(), "a service stopped on purpose never reports a death"
    waiting.cancel()


async def test_a_loop_that_returns_or_is_cancelled_is_a_death_and_the_first_reason_wins() -> None:
    vitals = Vitals("metrics")

    async def returns() -> None:
        return None

    vitals.watch("the flusher", asyncio.create_task(returns()))
    await asyncio.sleep(0.01)
    other = vitals.watch("the other", asyncio.create_task(forever()))
    other.cancel()
    await asyncio.sleep(0.01)
    assert await vitals.died() == "the flusher ended"


async def test_an_awaitable_is_watched_until_it_ends() -> None:
    vitals = Vitals("kubelet simulator n1")
    ended = asyncio.Event()
    vitals.watch_awaitable("the gRPC server on kubelet.sock", ended.wait())
    ended.set()
    assert await asyncio.wait_for(vitals.died(), 5) == "the gRPC server on kubelet.sock ended"
