"""One loop thread for several schedulers (`batchserve compare`): each gets an equal share of the machine.

The thread steps one scheduler at a time, always the one with the least accumulated busy time among those with
work, so two busy modes get about half the time each, and a mode alone gets all of it (no time is reserved for an
idle mode). A mode that was idle starts again at the others' level rather than at its old, lower total, so it
cannot claim back the time it did not use. One thread (rather than one per mode) also means one step at a time:
the modes share one model runner, and never compete for the cores inside a step. See docs/design.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from scheduler.core import Scheduler
from scheduler.loop import SchedulerLoop, StepFailed, describe, died, run_steps

logger = logging.getLogger("batchserve.loop")


class FairShareLoop:
    """Runs the steps of several schedulers on one thread, least busy first."""

    def __init__(self, schedulers: list[Scheduler], clock: Callable[[], float] = time.perf_counter) -> None:
        self.wake = threading.Event()
        self._clock = clock
        self._schedulers = list(schedulers)
        self._busy = {id(s): 0.0 for s in schedulers}  # seconds spent stepping each scheduler
        self._idle = {id(s) for s in schedulers}  # had no work, or ran nothing at its last turn (a batch timeout)
        self._stopped: set[int] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._started = False
        self.stopped_reason: str | None = None  # why the thread died, if it did
        self._thread = threading.Thread(target=self._run, name="batchserve-engine-loop", daemon=True)

    def handle(self, scheduler: Scheduler) -> SharedSchedulerLoop:
        """The loop as one mode's service sees it: the interface of `SchedulerLoop`."""
        return SharedSchedulerLoop(scheduler, self)

    def busy_seconds(self, scheduler: Scheduler) -> float:
        return self._busy[id(scheduler)]

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.stopped_reason is None

    def stop_scheduler(self, scheduler: Scheduler, timeout: float) -> None:
        """Stop stepping `scheduler`; the thread ends when every scheduler is stopped."""
        with self._lock:
            self._stopped.add(id(scheduler))
            last = len(self._stopped) == len(self._schedulers)
            if last:
                self._stopping = True
        self.wake.set()
        if last and self._started:
            self._thread.join(timeout)

    def is_stopped(self, scheduler: Scheduler) -> bool:
        return id(scheduler) in self._stopped

    def _pick_order(self) -> list[Scheduler]:
        """Schedulers with work, least busy first. One that did not run at its last turn (idle, or a dynamic batch
        waiting for its timeout) joins at the running ones' level: time it did not use is not owed to it. At that
        level it goes first: were ties left to list order, a mode listed after a busy one would be raised to the
        busy one's level and passed over at every turn, and never run until the other ran out of work."""
        with_work = [s for s in self._schedulers if id(s) not in self._stopped and s.has_pending_work()]
        self._idle.update(id(s) for s in self._schedulers if s not in with_work)
        busy = self._busy
        floor = min((busy[id(s)] for s in with_work if id(s) not in self._idle), default=None)
        if floor is not None:
            for s in with_work:
                if id(s) in self._idle and busy[id(s)] < floor:
                    busy[id(s)] = floor
        return sorted(with_work, key=lambda s: (busy[id(s)], id(s) not in self._idle))

    def _step_one(self) -> bool:
        """Step the least busy scheduler that has something to run; False if none ran. StepFailed if none ran and
        one failed: the loop retries after a delay (scheduler/loop.py)."""
        failed = False
        for scheduler in self._pick_order():
            start = self._clock()
            try:
                ran = scheduler.step() is not None
            except Exception:  # one mode's failure must not stop the others: try the next
                logger.exception("scheduler step failed (%s)", scheduler.mode)
                ran, failed = False, True
            self._busy[id(scheduler)] += self._clock() - start
            if ran:
                self._idle.discard(id(scheduler))
                return True
            self._idle.add(id(scheduler))
        if failed:
            raise StepFailed
        return False

    def _live(self) -> list[Scheduler]:
        return [s for s in self._schedulers if id(s) not in self._stopped]

    def _run(self) -> None:
        try:
            run_steps(lambda: self._stopping, self.wake, self._step_one, self._live)
        except BaseException as exc:  # the thread ends here: every mode's requests must hear of it
            self.stopped_reason = describe(exc)
            died(self.stopped_reason, exc, self._schedulers)


class SharedSchedulerLoop(SchedulerLoop):
    """One scheduler's view of a `FairShareLoop`: submissions and commands wake the shared thread."""

    def __init__(self, scheduler: Scheduler, owner: FairShareLoop) -> None:
        super().__init__(scheduler)
        self._owner = owner
        self._wake = owner.wake

    def start(self) -> None:
        self._owner.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._owner.stop_scheduler(self.scheduler, timeout)

    @property
    def alive(self) -> bool:
        return self._owner.alive and not self._owner.is_stopped(self.scheduler)

    @property
    def stopped_reason(self) -> str | None:
        return self._owner.stopped_reason
