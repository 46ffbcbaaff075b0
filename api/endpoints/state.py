"""What an app's modules read off it, typed: its phase, its config and, once loaded, its runtime (`ServerState`)."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.config import ServerConfig
from api.endpoints.metrics import ServerMetrics
from api.endpoints.service import GenerationService
from api.runtime.build import ModelRuntime

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from api.endpoints.event_hub import EventHub


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(frozen=True)
class Runtime(ModelRuntime):
    """The model's runtime plus what only the HTTP server has: the generation service and the metrics."""

    service: GenerationService
    metrics: ServerMetrics

    @classmethod
    def serving(cls, model: ModelRuntime, service: GenerationService, metrics: ServerMetrics) -> Runtime:
        shared = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelRuntime)}
        return cls(**shared, service=service, metrics=metrics)


@dataclass(eq=False)
class ServerState:
    """One app's state (`app.state.server`; read it with `ServerState.of(app)`). Written by the loader thread
    (runtime, then phase) and the drain (phase); read by the routes on the event loop."""

    config: ServerConfig
    event_modes: tuple[str, ...]  # the modes this app's /v1/events streams
    mode_entries: tuple[dict[str, Any], ...]  # /v1/compare/modes: each mode's prefix and settings
    phase: Phase = Phase.LOADING
    ready: threading.Event = field(default_factory=threading.Event)  # set once loading succeeded or failed
    runtime: Runtime | None = None  # set before the phase turns READY
    events: EventHub | None = None  # the event stream's hub, made when the app starts
    replica: str | None = None  # set by api.scale_out.ray_serve: the replica's name in every response's timings
    modes: dict[str, ServerState] = field(default_factory=dict)  # `batchserve compare`'s root: each mode's app
    workloads: int = 0  # `POST /v1/compare/workload` streams open now, on the event loop (api/live/workload.py)
    cut_short: bool = False  # a second SIGTERM or Ctrl-C: the drain ends what still runs now (api/process/drain.py)
    started: int = field(default_factory=lambda: int(time.time()))  # Unix seconds: the model card's `created`

    @staticmethod
    def of(app: Starlette) -> ServerState:
        state: ServerState = app.state.server
        return state

    def attach(self, app: Starlette) -> Starlette:
        app.state.server = self
        return app

    def loaded(self) -> Runtime:
        """The runtime; only once the model has loaded (phase READY or later)."""
        if self.runtime is None:
            raise RuntimeError(f"the model is not loaded ({self.phase.value})")
        return self.runtime

    def hub(self) -> EventHub:
        """The event stream's hub; only once the app has started."""
        if self.events is None:
            raise RuntimeError("the app has not started")
        return self.events

    @property
    def serving(self) -> bool:
        """READY, with its engine loop still running."""
        return self.phase is Phase.READY and self.loaded().loop.alive

    @property
    def loop_stopped(self) -> str | None:
        """Why the server cannot serve although it loaded: its engine loop died (scheduler/loop.py)."""
        if self.phase is not Phase.READY or self.runtime is None or self.runtime.loop.alive:
            return None
        return self.runtime.loop.stopped_reason or "the engine loop stopped"
