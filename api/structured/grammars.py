"""The server's grammars: each spec checked against its cost budget, compiled in a worker process under a deadline,
and kept in a cache bounded in bytes, so a schema a client sends again costs nothing.

Nothing here runs on the event loop's default executor (which tokenises every prompt) or can outlive its client:
a request that disconnects, or a server that shuts down, kills the compile it was waiting for.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from api.protocol.errors import APIError, bad_request
from api.structured.budget import budget_problem
from api.structured.compile_pool import (
    Job,
    JobFailedError,
    JobTimeoutError,
    PoolBusyError,
    PoolClosedError,
    WorkerPool,
    python_module_command,
)
from api.structured.limits import GrammarLimits, flag
from api.structured.spec import GrammarKind, GrammarSpec, compile_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from api.structured.xgrammar_backend import XGrammarCompiler, _Grammar
    from engine.sample.grammar import Grammar

_CACHE_BYTES = 256 * 2**20
INSTALL_HINT = "pip install --no-deps xgrammar apache-tvm-ffi"
logger = logging.getLogger("batchserve.grammar")


def _worker_pool(compiler: XGrammarCompiler, limits: GrammarLimits, setup: bytes) -> WorkerPool[_Grammar]:
    return WorkerPool(
        python_module_command("api.structured.compile_worker"),
        setup,
        compiler.load,
        limits.compile_workers,
        limits.compile_timeout_s,
        limits.max_pending,
    )


class CompileWorkers:
    """Compile workers shared by the servers of one process: `compare`'s panes, a test session's servers. A worker
    costs seconds of a core to start (it imports xgrammar and torch); servers with the same tokenizer and limits
    share one pool, started lazily as ever. The owner closes it; a server's shutdown only ends its own compiles."""

    def __init__(self) -> None:
        self._pools: dict[tuple[bytes, int, float, int], WorkerPool[_Grammar]] = {}
        self._lock = threading.Lock()

    def pool(self, compiler: XGrammarCompiler, limits: GrammarLimits, setup: bytes) -> WorkerPool[_Grammar]:
        key = (hashlib.sha256(setup).digest(), limits.compile_workers, limits.compile_timeout_s, limits.max_pending)
        with self._lock:
            if key not in self._pools:
                self._pools[key] = _worker_pool(compiler, limits, setup)
            return self._pools[key]

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()


class Grammars:
    """Compiles request grammars for one tokenizer; used from the event loop. `shared`: compile in its workers
    (else in a pool of this server's own)."""

    def __init__(self, compiler: XGrammarCompiler, limits: GrammarLimits, shared: CompileWorkers | None = None) -> None:
        self.limits = limits
        setup = compiler.setup()
        self._owns_pool = shared is None
        self._pool = _worker_pool(compiler, limits, setup) if shared is None else shared.pool(compiler, limits, setup)
        self._jobs: set[Job[_Grammar]] = set()  # this server's compiles not answered yet (the pool may be shared)
        self._closed = False
        self._cache: OrderedDict[tuple[GrammarKind, str], _Grammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # the cache and jobs: `compile` may be awaited from more than one event loop

    async def compile(self, spec: GrammarSpec) -> Grammar:
        """The spec's grammar, or an APIError: 400 (over budget, does not compile, past the deadline), 429 (too
        many compiles at once) or 503 (shutting down)."""
        key = (spec.kind, spec.text)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        problem = budget_problem(spec, self.limits)
        if problem is not None:
            raise bad_request(f"the {spec.noun} in {spec.param} {problem}", spec.param)
        grammar = await self._compiled(spec)
        self._remember(key, grammar)
        return grammar

    @property
    def pending(self) -> int:
        """Compiles running or waiting for a worker."""
        return self._pool.pending

    def worker_pids(self) -> list[int]:
        return self._pool.pids()

    def close(self) -> None:
        """Kill the workers (or, in a shared pool, this server's compiles); compiles still waiting get a 503. Never
        waits for a compile."""
        self._closed = True
        if self._owns_pool:
            self._pool.close()
            return
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.abandon()  # a running one has its worker killed, a waiting one is cancelled: both get a 503 below

    async def _compiled(self, spec: GrammarSpec) -> _Grammar:
        payload = json.dumps({"kind": spec.kind.value, "text": spec.text, "param": spec.param}).encode()
        if self._closed:
            raise _shutting_down()
        try:
            job = self._pool.submit(payload)
        except PoolBusyError as exc:
            raise APIError(
                429,
                f"the server is compiling too many grammars ({exc}; {flag('max_pending')} is "
                f"{self.limits.max_pending}); retry shortly, or reuse a schema: compiled ones are cached",
                headers={"Retry-After": "1"},
            ) from None
        except PoolClosedError:
            raise _shutting_down() from None
        with self._lock:
            self._jobs.add(job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.abandon()  # the client left: its compile stops now, whether it waits or runs
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():  # close() cancelled the job, not a client
                raise _shutting_down() from None
            raise
        except JobTimeoutError as exc:
            raise bad_request(
                f"the {spec.noun} in {spec.param} {exc} ({flag('compile_timeout_s')}); simplify it", spec.param
            ) from None
        except JobFailedError as exc:
            if self._closed:  # close() abandoned it
                raise _shutting_down() from None
            raise compile_error(spec, str(exc)) from None
        except PoolClosedError:
            raise _shutting_down() from None
        finally:
            with self._lock:
                self._jobs.discard(job)

    def _remember(self, key: tuple[GrammarKind, str], grammar: _Grammar) -> None:
        size = grammar.size_bytes
        if size > _CACHE_BYTES:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = grammar
            self._cache_bytes += size
            while self._cache_bytes > _CACHE_BYTES:
                _, evicted = self._cache.popitem(last=False)
                self._cache_bytes -= evicted.size_bytes


def build_grammars(
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    limits: GrammarLimits,
    shared: CompileWorkers | None = None,
) -> Grammars | None:
    """The server's grammars, or None where xgrammar is not installed (structured outputs are then a 400);
    `shared`: workers shared with other servers of this process (default: its own)."""
    try:
        from api.structured.xgrammar_backend import XGrammarCompiler
    except ImportError:
        logger.warning(
            "xgrammar is not installed: structured outputs and forced tool calls are refused (%s)", INSTALL_HINT
        )
        return None
    return Grammars(XGrammarCompiler.for_tokenizer(tokenizer, vocab_size, stop_token_ids), limits, shared)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry the request", headers={"Retry-After": "1"})
