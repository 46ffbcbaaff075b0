"""Worker processes that run jobs with a deadline, and are killed when a job overruns it or nobody wants it any more.

Grammar compiles run here (api/structured/grammars.py), not on a thread: a thread cannot be stopped, so a hostile
schema compiling on one kept a core busy long after its client left, and shutdown waited for it. A process can be
killed. Each worker is started lazily (a server that never compiles never starts one), runs at the lowest CPU
priority so the engine's threads win the cores whenever they want them, and is restarted after a kill.

Each worker slot has one thread here that feeds its process one job at a time over a pipe (8-byte length, then
the bytes) and waits for the answer in short polls, so a cancelled job or a closed pool is noticed within a poll.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger("batchserve.grammar")

_T = TypeVar("_T")
_HEADER = struct.Struct("<Q")
_POLL_S = 0.05
OK, FAILED = b"\x00", b"\x01"  # the first byte of an answer: the rest is the result, or an error message


class PoolBusyError(RuntimeError):
    """Every worker is busy and the waiting line is full."""


class JobTimeoutError(RuntimeError):
    """The job ran past its deadline; its worker was killed."""


class JobFailedError(RuntimeError):
    """The worker answered with an error (its message), or died."""


class PoolClosedError(RuntimeError):
    """The pool was closed (the server is shutting down)."""


@dataclass(eq=False)
class Job(Generic[_T]):
    payload: bytes
    future: Future[_T] = field(default_factory=Future)
    abandoned: threading.Event = field(default_factory=threading.Event)  # nobody waits for the answer any more

    def abandon(self) -> None:
        """Stop caring: a waiting job is skipped, a running one has its worker killed."""
        self.abandoned.set()
        self.future.cancel()


def write_frame(stream: object, data: bytes) -> None:
    write = stream.write  # type: ignore[attr-defined]
    write(_HEADER.pack(len(data)))
    write(data)
    stream.flush()  # type: ignore[attr-defined]


def read_frame(stream: object) -> bytes | None:
    """A whole frame from a blocking stream, or None at its end (the worker's side)."""
    read = stream.read  # type: ignore[attr-defined]
    header = read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data: bytes = read(size)
    return data if len(data) == size else None


class WorkerPool(Generic[_T]):
    """`workers` processes running `command`, each sent `setup` once when it starts, then one job at a time. An
    answer's bytes become the job's result through `decode` (on the slot's thread, off the caller's)."""

    def __init__(
        self,
        command: Sequence[str],
        setup: bytes,
        decode: Callable[[bytes], _T],
        workers: int,
        timeout_s: float,
        max_pending: int,
    ) -> None:
        self._command = list(command)
        self._setup = setup
        self._decode = decode
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._jobs: queue.Queue[Job[_T] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not answered yet
        self._closed = False
        self._slots = [_Slot(self, i) for i in range(workers)]
        self._started = False

    def submit(self, payload: bytes) -> Job[_T]:
        with self._lock:
            if self._closed:
                raise PoolClosedError("the server is shutting down")
            if self._pending >= self._max_pending:
                raise PoolBusyError(f"{self._pending} compiles are running or waiting")
            self._pending += 1
            if not self._started:  # the first job starts the slots' threads (and they their processes)
                self._started = True
                for slot in self._slots:
                    slot.thread.start()
        job: Job[_T] = Job(payload)
        job.future.add_done_callback(lambda _: self._done())
        self._jobs.put(job)
        return job

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Kill every worker now and fail every job not answered; never waits for a compile."""
        with self._lock:
            self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(PoolClosedError("the server is shutting down"))
        for slot in self._slots:
            self._jobs.put(None)  # wakes each slot's thread, which exits
            slot.kill()

    @property
    def closed(self) -> bool:
        return self._closed

    def pids(self) -> list[int]:
        """The running workers' process ids."""
        return [pid for slot in self._slots if (pid := slot.pid) is not None]

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1


class _Slot(Generic[_T]):
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: WorkerPool[_T], index: int) -> None:
        self._pool = pool
        self._process: subprocess.Popen[bytes] | None = None
        self._process_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"batchserve-grammar-{index}", daemon=True)

    @property
    def pid(self) -> int | None:
        with self._process_lock:
            process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def kill(self) -> None:
        with self._process_lock:
            process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def _run(self) -> None:
        pool = self._pool
        while not pool.closed:
            job = pool._jobs.get()
            if job is None or pool.closed:
                break
            if job.abandoned.is_set() or not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(pool._decode(self._answer(job)))
            except BaseException as exc:  # every failure is the job's: the thread goes on serving the next
                job.future.set_exception(exc)
            self._restart_if_killed()
        self.kill()

    def _restart_if_killed(self) -> None:
        """A worker killed for its job is replaced now, so the next job does not wait for a start."""
        with self._process_lock:
            running = self._process is not None
        if running or self._pool.closed:
            return
        with contextlib.suppress(JobFailedError, PoolClosedError):  # if this start fails, the next job's retries
            self._ready_process(Job(b""))

    def _answer(self, job: Job[_T]) -> bytes:
        process = self._ready_process(job)
        assert process.stdin is not None and process.stdout is not None
        try:
            write_frame(process.stdin, job.payload)
        except OSError:
            self.kill()
            raise JobFailedError("the compile worker exited") from None
        answer = self._wait(process, job, time.monotonic() + self._pool._timeout_s)
        if answer[:1] == OK:
            return answer[1:]
        raise JobFailedError(answer[1:].decode(errors="replace"))

    def _ready_process(self, job: Job[_T]) -> subprocess.Popen[bytes]:
        """The slot's worker, started (and sent its setup) if it is not running. A start is not the job's time:
        the worker says when it is ready, and only then does the job's deadline begin."""
        with self._process_lock:
            if self._process is not None and self._process.poll() is None:
                return self._process
            process = subprocess.Popen(
                self._pool._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_env()
            )
            self._process = process
        assert process.stdin is not None
        try:
            write_frame(process.stdin, self._pool._setup)
        except OSError:
            self.kill()
            raise JobFailedError("the compile worker exited while starting") from None
        self._wait(process, job, None)
        logger.info("started a grammar compile worker (pid %d)", process.pid)
        return process

    def _wait(self, process: subprocess.Popen[bytes], job: Job[_T], deadline: float | None) -> bytes:
        """The worker's next frame; kills it if the job is abandoned, the pool closes or the deadline passes."""
        assert process.stdout is not None
        reader = _FrameReader(process.stdout.fileno())
        while True:
            if self._pool.closed:
                self.kill()
                raise PoolClosedError("the server is shutting down")
            if job.abandoned.is_set():
                self.kill()  # its client is gone: the compile stops costing CPU now
                raise JobFailedError("abandoned")
            left = _POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise JobTimeoutError(f"did not finish within {self._pool._timeout_s:g} s")
            frame = reader.poll(min(_POLL_S, left))
            if frame is reader.ENDED:
                self.kill()
                if self._pool.closed:  # close() killed it
                    raise PoolClosedError("the server is shutting down")
                raise JobFailedError("the compile worker exited")
            if frame is not None:
                assert isinstance(frame, bytes)
                return frame


class _FrameReader:
    """Reads one frame from a pipe without ever blocking longer than a poll."""

    ENDED = object()

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()

    def poll(self, timeout: float) -> bytes | object | None:
        """The frame once whole; ENDED if the pipe closed first; None if not yet."""
        readable, _, _ = select.select([self._fd], [], [], timeout)
        if not readable:
            return None
        chunk = os.read(self._fd, 1 << 20)
        if not chunk:
            return self.ENDED
        self._buffer += chunk
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        if len(self._buffer) < _HEADER.size + size:
            return None
        return bytes(self._buffer[_HEADER.size : _HEADER.size + size])


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # The worker imports this project's modules from where this process did, whatever its working directory.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # One thread each: a worker is one compile at a time, and torch (which xgrammar imports) would start a pool.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def python_module_command(module: str) -> list[str]:
    return [sys.executable, "-m", module]
