"""`python -m tests.paced_server serve ...`: the real `batchserve serve`, except that every engine step takes at least
`BATCHSERVE_TEST_STEP_S` seconds, so that a test can keep a tiny model's requests running across a SIGTERM."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from api.cli import main
from engine.model.model_runner import TransformersRunner

STEP_ENV = "BATCHSERVE_TEST_STEP_S"


def paced(forward: Callable[..., Any], step_s: float) -> Callable[..., Any]:
    @functools.wraps(forward)
    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(step_s)
        return forward(*args, **kwargs)

    return slow_forward


if __name__ == "__main__":
    TransformersRunner.forward = paced(TransformersRunner.forward, float(os.environ[STEP_ENV]))  # type: ignore[method-assign]
    main()
