"""What the routes need once the model is loaded; built by the app's startup in a background thread."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from api.metrics import ServerMetrics
from api.service import GenerationService
from api.token_bytes import TokenBytes
from engine.engine import Engine
from scheduler.core import Scheduler
from scheduler.loop import EngineLoop


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(frozen=True)
class Runtime:
    engine: Engine
    scheduler: Scheduler
    loop: EngineLoop
    tokenizer: PreTrainedTokenizerBase
    service: GenerationService
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    token_bytes: TokenBytes
