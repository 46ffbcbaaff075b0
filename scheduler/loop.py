"""The engine loop thread: runs the scheduler's steps, sleeps when there is nothing to do."""

from __future__ import annotations

import logging
import threading

from scheduler.core import Scheduler
from scheduler.request import SequenceRequest

logger = logging.getLogger("batchserve.loop")


class SchedulerLoop:
    """Runs `scheduler.step()` on one thread; blocks on an event when there is nothing to do."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="batchserve-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

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
        scheduler = self.scheduler
        while not self._stopping:
            self._wake.clear()
            try:
                ran = scheduler.step() is not None
            except Exception:  # a bug outside the engine step must not kill the server's only loop
                logger.exception("scheduler step failed")
                ran = False
            if ran:
                continue
            deadline = scheduler.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - scheduler.clock())
            # Idle: sleep until a submission, an abort, or the policy's next deadline (a batch timeout).
            self._wake.wait(timeout)
