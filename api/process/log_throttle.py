"""Rate-limit a log line that a fault can repeat thousands of times a second (accept errors, refused connections)."""

from __future__ import annotations

import time
from collections.abc import Callable


class LogThrottle:
    """Admits one event per `interval_s`; the admitted one reports how many were held back since the last."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def admit(self) -> int | None:
        """None: stay quiet. Otherwise log now, mentioning the returned number of suppressed events."""
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            self._suppressed += 1
            return None
        suppressed, self._suppressed, self._last = self._suppressed, 0, now
        return suppressed
