"""`python -m tests.paced_server serve ...`: the real `batchserve serve`, except that every engine step takes at least
`BATCHSERVE_TEST_STEP_S` seconds, so that a test can keep a tiny model's requests running across a SIGTERM; and,
with `BATCHSERVE_TEST_LOAD_S`, building the runner first multiplies matrices in torch for that long, so that a
SIGTERM can come while the loader thread is inside torch, as during a real first start's format measurement."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from api.cli import main
from engine.model.model_runner import TransformersRunner

STEP_ENV = "BATCHSERVE_TEST_STEP_S"
LOAD_ENV = "BATCHSERVE_TEST_LOAD_S"


def paced(forward: Callable[..., Any], step_s: float) -> Callable[..., Any]:
    @functools.wraps(forward)
    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(step_s)
        return forward(*args, **kwargs)

    return slow_forward


def busy_in_torch(init: Callable[..., None], load_s: float) -> Callable[..., None]:
    @functools.wraps(init)
    def slow_init(*args: Any, **kwargs: Any) -> None:
        print("loading: busy in torch", flush=True)
        operand = torch.rand(512, 512)
        deadline = time.monotonic() + load_s
        while time.monotonic() < deadline:
            torch.mm(operand, operand)
        init(*args, **kwargs)

    return slow_init


if __name__ == "__main__":
    TransformersRunner.forward = paced(TransformersRunner.forward, float(os.environ[STEP_ENV]))  # type: ignore[method-assign]
    if LOAD_ENV in os.environ:
        TransformersRunner.__init__ = busy_in_torch(TransformersRunner.__init__, float(os.environ[LOAD_ENV]))  # type: ignore[method-assign]
    main()
