"""What the routes need once the model is loaded; built by the app's startup in a background thread."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from api.endpoints.metrics import ServerMetrics
from api.endpoints.service import GenerationService
from api.runtime.build import ModelRuntime


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
