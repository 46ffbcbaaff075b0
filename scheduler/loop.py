"""The engine loop thread: runs the scheduler's steps, sleeps when there is nothing to do.

It cannot wedge: a step that raises is logged and retried after `retry_delay` (10 ms, doubling to 1 s while it
keeps failing) when work is pending, rather than put to sleep with no wake-up; a sleep never exceeds `MAX_WAIT_S`,
whatever deadline the policy gave. If the thread dies all the same (a BaseException), `died` ends every request the
scheduler holds at once and refuses new ones (`Scheduler.abandon`), and `stopped_reason` says why, for /health.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from scheduler.core import Scheduler
from scheduler.request import SequenceRequest

logger = logging.getLogger("batchserve.loop")

# The longest one wait: far below threading's limit (a wait beyond it raised and killed the thread), and a loop that
# wakes to find nothing due costs nothing.
MAX_WAIT_S = 3600.0
_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 1.0


def retry_delay(failures: int) -> float:
    """How long to wait before retrying after `failures` consecutive failed steps: promptly, but never a spin."""
    return min(_RETRY_MAX_S, _RETRY_FIRST_S * 2 ** min(failures - 1, 16))


def wait_seconds(schedulers: Iterable[Scheduler], failures: int) -> float | None:
    """How long an idle loop sleeps: until the earliest deadline of `schedulers` (None: until woken), capped at
    MAX_WAIT_S, and after failed steps no longer than `retry_delay` if any of them has work pending."""
    waits: list[float] = []
    for scheduler in schedulers:
        try:
            deadline = scheduler.next_deadline()
            if deadline is not None:
                waits.append(deadline - scheduler.clock())
            if failures and scheduler.has_pending_work():
                waits.append(retry_delay(failures))
        except Exception:  # the policy's own errors are handled in the scheduler: this is a bug outside it
            logger.exception("computing the loop's next deadline failed; retrying shortly")
            waits.append(retry_delay(max(failures, 1)))
    return None if not waits else min(MAX_WAIT_S, max(0.0, min(waits)))


def describe(exc: BaseException) -> str:
    return f"the engine loop stopped ({type(exc).__name__}: {str(exc)[:200]})"


def died(reason: str, exc: BaseException, schedulers: Iterable[Scheduler]) -> None:
    """The loop thread is dying of `exc`: log it and end every request of `schedulers` (503), refusing new ones."""
    logger.critical("%s; every request it held ends with 503 and new ones are refused", reason, exc_info=exc)
    for scheduler in schedulers:
        try:
            scheduler.abandon(reason)
        except BaseException:
            logger.exception("ending the requests of the %s scheduler failed", scheduler.mode)


class SchedulerLoop:
    """Runs `scheduler.step()` on one thread; blocks on an event when there is nothing to do."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._wake = threading.Event()
        self._stopping = False
        self._stopped_reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="batchserve-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._stopped_reason is None

    @property
    def stopped_reason(self) -> str | None:
        """Why the loop thread died, if it did (not set by `stop`)."""
        return self._stopped_reason

    def submit(self, request: SequenceRequest, arrival: float | None = None) -> None:
        self.scheduler.submit(request, arrival)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._wake.set()

    def stop_request(self, request_id: str) -> None:
        self.scheduler.stop_request(request_id)
        self._wake.set()

    def request_snapshot(self) -> None:
        self.scheduler.request_snapshot()
        self._wake.set()

    def begin_drain(self) -> None:
        self.scheduler.begin_drain()
        self._wake.set()

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self._wake.set()

    def _run(self) -> None:
        try:
            run_steps(
                lambda: self._stopping, self._wake, lambda: self.scheduler.step() is not None, lambda: [self.scheduler]
            )
        except BaseException as exc:  # the thread ends here: whatever it was, its requests must hear of it
            self._stopped_reason = describe(exc)  # first: /health and new requests see it at once
            died(self._stopped_reason, exc, [self.scheduler])


class StepFailed(Exception):
    """A step (or every step tried) failed, and the failure was logged already."""


def run_steps(
    stopping: Callable[[], bool],
    wake: threading.Event,
    step: Callable[[], bool],
    live: Callable[[], Iterable[Scheduler]],
) -> None:
    """The loop: `step` (True: something ran) until nothing runs, then sleep until woken, a deadline of one of the
    `live` schedulers, or a retry. An Exception from a step is logged and retried; a BaseException ends the loop (the
    caller then calls `died`)."""
    failures = 0
    while not stopping():
        wake.clear()
        try:
            ran = step()
            failures = 0
        except Exception as exc:  # a bug outside the engine step must not stop the server's only loop
            failures += 1
            if not isinstance(exc, StepFailed):
                logger.exception("scheduler step failed (%d in a row)", failures)
            ran = False
        if not ran:
            wake.wait(wait_seconds(live(), failures))
