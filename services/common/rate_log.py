"""Repeated warnings, rate-limited: one line per key per interval, saying how many it held back.

A misbehaving client (a container opening 1000 relay connections, a flood of bad requests)
must not turn into as many log lines: the counter metric counts every occurrence, the log
says it once per interval per key with ``suppressed`` = the occurrences since the last line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

MAX_KEYS = 4096  # keys remembered; beyond, the oldest are forgotten (they log again)


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (logged at, held back)

    def warning(self, key: Hashable, message: str, extra: dict[str, Any]) -> bool:
        """Log unless `key` logged within the interval; True when it logged."""
        now = self._clock()
        logged_at, held = self._last.get(key, (None, 0))
        if logged_at is not None and now - logged_at < self._interval:
            self._last[key] = (logged_at, held + 1)
            return False
        self._last.pop(key, None)  # re-inserted last: the dict stays in age order
        self._last[key] = (now, 0)
        while len(self._last) > MAX_KEYS:
            del self._last[next(iter(self._last))]
        self._log.warning(message, extra={**extra, "suppressed": held})
        return True
