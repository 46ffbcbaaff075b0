"""Loading the model behind an app: the runtime with the server's metrics and generation service, built on a
background thread so the app answers (503, loading) meanwhile. Shared by `serve`'s app and `compare`'s."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from api.config import ServerConfig
from api.endpoints.metrics import ServerMetrics
from api.endpoints.service import GenerationService
from api.endpoints.state import Phase, Runtime, ServerState
from api.runtime.build import ModelRuntime, build_model_runtime, load
from api.runtime.heap import frozen_after_loading
from api.structured.grammars import CompileWorkers
from engine.model.model_runner import ModelRunner
from engine.phases import phase
from engine.weights.loader import LoadedModel

logger = logging.getLogger("batchserve.api")

ModelLoader = Callable[[ServerConfig], LoadedModel]
# After loading: the weights packed for the kernels, the grammar compiler's vocabulary (seconds on a small CPU).
PREPARING = "preparing the engine"
_Built = TypeVar("_Built")


def default_loader(config: ServerConfig) -> LoadedModel:
    return load(config.runtime_options())


def metered_model(
    config: ServerConfig,
    loaded: LoadedModel,
    runner: ModelRunner | None = None,
    label: str | None = None,
    compile_workers: CompileWorkers | None = None,
) -> tuple[ModelRuntime, ServerMetrics]:
    """The model's runtime (see `api.runtime.build`) and the metrics its steps feed; `runner`: one shared with
    another mode's runtime (one copy of the weights); `label`: the metrics' `mode` label (default: the mode);
    `compile_workers`: grammar compile workers shared with other runtimes of this process (default: its own)."""
    options = config.runtime_options()
    metrics = ServerMetrics(
        label or config.mode,
        options.model_name(loaded.source),
        options.scheduler.by_priority,
        prefix_caching=config.enable_prefix_caching,
    )
    model = build_model_runtime(
        options,
        loaded,
        on_step=metrics.observe_step,
        runner=runner,
        on_policy_fallback=metrics.observe_policy_fallback,
        compile_workers=compile_workers,
    )
    metrics.expect_tool_parser(model.chat.parser.name)
    counts = model.scheduler.counts  # a snapshot published by the loop thread: safe to read from any thread
    metrics.bind_gauges(
        running=lambda: counts().running,
        waiting=lambda: counts().waiting,
        cache_usage=lambda: counts().cache_usage,
        cache_cached_free=lambda: counts().cache_cached_free,
    )
    return model, metrics


def serving_runtime(config: ServerConfig, model: ModelRuntime, metrics: ServerMetrics) -> Runtime:
    """`model` with the generation service over its loop, as the routes use it."""
    service = GenerationService(model.loop, model.tokenizer, metrics, config.request_timeout_s)
    return Runtime.serving(model, service, metrics)


def build_runtime(config: ServerConfig, loaded: LoadedModel, compile_workers: CompileWorkers | None = None) -> Runtime:
    """`serve`'s runtime: the model under its own scheduler loop, with the server's metrics and service."""
    with phase(logger, PREPARING, announce=False):
        return serving_runtime(config, *metered_model(config, loaded, compile_workers=compile_workers))


def load_in_background(
    states: Sequence[ServerState],
    freeze_heap: bool,
    build: Callable[[], _Built],
    start: Callable[[_Built], None],
    publish: Callable[[_Built], None],
) -> None:
    """On a thread of its own: `build` (the heap frozen after it when the app owns its process, see
    api.runtime.heap), `start` its loop, `publish` it to the states; then every state is READY, or FAILED if any
    step raised, and the first state's `ready` is set."""

    def run() -> None:
        try:
            with frozen_after_loading(freeze_heap):
                built = build()
            start(built)
        except Exception:
            logger.exception("failed to load the model")
            for state in states:
                state.phase = Phase.FAILED
            states[0].ready.set()
            return
        publish(built)
        for state in states:
            state.phase = Phase.READY
        states[0].ready.set()

    threading.Thread(target=run, name="batchserve-loader", daemon=True).start()
