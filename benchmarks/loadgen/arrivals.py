"""Open-loop arrival process: when each request is sent, independent of when earlier ones finish.

Inter-arrival gaps are gamma distributed with shape `burstiness` and mean 1/rate. Shape 1 is the exponential
(a Poisson process); a smaller shape clumps requests into bursts, a larger one spaces them more evenly,
while the mean rate stays the same. This matches `vllm bench serve --burstiness`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalConfig:
    request_rate: float = math.inf  # requests per second; inf sends everything at t=0
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive finite number, got {self.burstiness}")


def inter_arrival_gaps(config: ArrivalConfig, n: int) -> list[float]:
    """Seconds between consecutive requests; the first gap is before the first request."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if math.isinf(config.request_rate):
        return [0.0] * n
    rng = np.random.default_rng(config.seed)
    scale = 1.0 / (config.request_rate * config.burstiness)  # mean = shape * scale = 1/rate
    return [float(g) for g in rng.gamma(shape=config.burstiness, scale=scale, size=n)]


def arrival_offsets(config: ArrivalConfig, n: int) -> list[float]:
    """Send time of each request, in seconds after the benchmark starts."""
    offsets: list[float] = []
    t = 0.0
    for gap in inter_arrival_gaps(config, n):
        t += gap
        offsets.append(t)
    return offsets
