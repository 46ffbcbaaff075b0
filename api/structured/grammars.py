"""The server's grammars: each spec checked against its cost budget, compiled in a worker process under a deadline,
and kept in a cache bounded in bytes, so a schema a client sends again costs nothing.

Nothing here runs on the event loop's default executor (which tokenises every prompt) or can outlive its client:
a request that disconnects, or a server that shuts down, kills the compile it was waiting for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from api.protocol.errors import APIError, bad_request
from api.structured.budget import budget_problem
from api.structured.compile_pool import (
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


class Grammars:
    """Compiles request grammars for one tokenizer; used from the event loop."""

    def __init__(self, compiler: XGrammarCompiler, limits: GrammarLimits) -> None:
        self.limits = limits
        self._pool: WorkerPool[_Grammar] = WorkerPool(
            python_module_command("api.structured.compile_worker"),
            compiler.setup(),
            compiler.load,
            limits.compile_workers,
            limits.compile_timeout_s,
            limits.max_pending,
        )
        self._cache: OrderedDict[tuple[GrammarKind, str], _Grammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # the cache: `compile` may be awaited from more than one event loop (compare)

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
        """Kill the workers; compiles still waiting get a 503. Never waits for a compile."""
        self._pool.close()

    async def _compiled(self, spec: GrammarSpec) -> _Grammar:
        payload = json.dumps({"kind": spec.kind.value, "text": spec.text, "param": spec.param}).encode()
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
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.abandon()  # the client left: its compile stops now, whether it waits or runs
            raise
        except JobTimeoutError as exc:
            raise bad_request(
                f"the {spec.noun} in {spec.param} {exc} ({flag('compile_timeout_s')}); simplify it", spec.param
            ) from None
        except JobFailedError as exc:
            raise compile_error(spec, str(exc)) from None
        except PoolClosedError:
            raise _shutting_down() from None

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
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int], limits: GrammarLimits
) -> Grammars | None:
    """The server's grammars, or None where xgrammar is not installed (structured outputs are then a 400)."""
    try:
        from api.structured.xgrammar_backend import XGrammarCompiler
    except ImportError:
        logger.warning(
            "xgrammar is not installed: structured outputs and forced tool calls are refused (%s)", INSTALL_HINT
        )
        return None
    return Grammars(XGrammarCompiler.for_tokenizer(tokenizer, vocab_size, stop_token_ids), limits)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry the request", headers={"Retry-After": "1"})
