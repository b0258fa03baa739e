"""Restart what `vgpu up` started when it dies, with a bounded exponential backoff.

The policy is the one systemd (Restart=on-failure) and Kubernetes (CrashLoopBackOff) operators
know: wait `initial_s` before the first restart, double the wait after each death up to
`max_s`, and forget the count once the child has stayed up for `reset_after_s`. Every death is
logged with what died, how (a process's exit status, or which loop of an in-process service
ended and why) and when it comes back, and counted in ``vgpu_up_restarts_total``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter

log = logging.getLogger("vgpu.up")

RESTARTS = Counter(
    "vgpu_up_restarts_total",
    "Children of `vgpu up` that died and were restarted",
    ["child"],
)


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(
                f"backoff needs 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}"
            )

    def after(self, previous_s: float | None, up_for_s: float) -> float:
        """The wait before the next restart, given the last wait and how long the child lived."""
        if previous_s is None or up_for_s >= self.reset_after_s:
            return self.initial_s
        return min(previous_s * 2, self.max_s)


async def supervise(
    child: str,
    wait_exit: Callable[[], Awaitable[int | str | None]],
    restart: Callable[[], Awaitable[None]],
    backoff: Backoff,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Watch a running child forever (until cancelled): when `wait_exit` returns (a process's
    exit status, or a sentence saying how a service died), wait out the backoff and `restart`
    it; a restart that fails is retried the same way."""
    delay: float | None = None
    started_at = clock()
    while True:
        status = await wait_exit()
        delay = backoff.after(delay, clock() - started_at)
        how = status if isinstance(status, str) else f"exit status {status}"
        log.warning(
            "%s died (%s); restarting in %.1fs",
            child, how, delay,
            extra={"child": child, "exit_status": None if isinstance(status, str) else status,
                   "reason": how, "restart_in_s": delay},
        )  # fmt: skip
        while True:
            await asyncio.sleep(delay)
            try:
                await restart()
            except Exception as exc:  # a restart may fail (port taken, disk full): retry later
                delay = backoff.after(delay, 0.0)
                log.warning(
                    "%s did not restart: %s; retrying in %.1fs",
                    child, exc, delay,
                    extra={"child": child, "error": str(exc), "restart_in_s": delay},
                )  # fmt: skip
                continue
            break
        RESTARTS.labels(child=child).inc()
        started_at = clock()
        log.warning("%s restarted", child, extra={"child": child})
