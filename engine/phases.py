"""The slow steps of a first start (the GGUF conversion, the kernel build, the weight-format measurement), each
logged as a phase: a line when it starts, a progress line every few seconds while it runs (so a first start is never
quiet for long, and a phase of steps says which step it is on), and a line when it ends with its time and where its
result is kept, so that a reader knows the next start skips it and what to delete to redo it."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

PROGRESS_EVERY_S = 5.0  # under load a beat comes late: at 5 s the log still never goes 10 s without a line


class Phase:
    """A running phase: the code doing the work advances its steps and says where the result is kept; the progress
    thread reads them (hence the lock)."""

    def __init__(self, logger: logging.Logger, title: str, steps: int) -> None:
        self.logger = logger
        self.title = title
        self.steps = steps
        self.started = time.monotonic()
        self.result = ""  # what the end line adds: where the result is cached and how to redo it
        self._lock = threading.Lock()
        self._step = 0
        self._step_name = ""
        self._unit = ""

    def step(self, name: str = "", steps: int | None = None) -> None:
        """The next of the phase's steps begins: one line at once ("TITLE: 2 of 4 (NAME)"); `steps`: a new total,
        where the work found it has more to do."""
        with self._lock:
            self._step += 1
            self._step_name = name
            self.steps = self.steps if steps is None else steps
        self.logger.info("%s: %s", self.title, self._progress())

    def stage(self, unit: str, steps: int, done: int = 0) -> None:
        """Count steps afresh, `steps` of them (`done` of which are behind), each named by `unit` ("TITLE: round 2
        of 5"); no line until the next step."""
        with self._lock:
            self._unit, self._step, self.steps, self._step_name = unit, done, steps, ""

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _progress(self) -> str:
        with self._lock:
            if not self._step:
                return ""
            unit = f"{self._unit} " if self._unit else ""
            name = f" ({self._step_name})" if self._step_name else ""
            return f"{unit}{self._step} of {self.steps}{name}"

    def _beat(self, stop: threading.Event, every_s: float) -> None:
        while not stop.wait(every_s):
            progress = self._progress()
            self.logger.info("%s: %s%.0f s so far", self.title, f"{progress}, " if progress else "", self.elapsed_s())


@contextlib.contextmanager
def phase(
    logger: logging.Logger,
    title: str,
    detail: str = "",
    steps: int = 0,
    announce: bool = True,
    every_s: float = PROGRESS_EVERY_S,
) -> Iterator[Phase]:
    """Log `title` as it starts (with `detail` after a comma, on that line only), a progress line every `every_s`
    while it runs, and its time when it ends, with `Phase.result` (set by the caller: where the result is kept).
    `steps`: how many steps the caller will announce with `Phase.step`. `announce=False`: no start line, for a phase
    that is usually quick (a cached result), which then speaks only if it runs long, and when it ends."""
    running = Phase(logger, title, steps)
    if announce:
        logger.info("%s%s", title, f", {detail}" if detail else "")
    stop = threading.Event()
    beat = threading.Thread(target=running._beat, args=(stop, every_s), name="batchserve-progress", daemon=True)
    beat.start()
    try:
        yield running
    except BaseException:
        stop.set()
        logger.info("%s: stopped after %.1f s", title, running.elapsed_s())
        raise
    finally:
        stop.set()
        beat.join()
    logger.info("%s: done in %.1f s%s", title, running.elapsed_s(), f"; {running.result}" if running.result else "")
