"""The engine surface the scheduler core and the lifecycle use: what a step needs from an engine, and nothing else.

`engine.engine.Engine` is the one that serves requests; `benchmarks.sim.engine.SimEngine` satisfies the same
protocol at a modelled cost per step, so the simulator runs this package's scheduler and policies unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.outputs import StepOutput
from engine.sample.sampling_params import SamplingParams


class SchedulerEngine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def blocks(self) -> BlockManager: ...

    @property
    def block_size(self) -> int: ...

    @property
    def cache_usage(self) -> float: ...

    @property
    def num_free_seats(self) -> int: ...

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None: ...

    def has_sequence(self, seq_id: int) -> bool: ...

    def num_pending(self, seq_id: int) -> int: ...

    def num_computed(self, seq_id: int) -> int: ...

    def num_cached(
        self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None
    ) -> int: ...

    def can_admit(
        self,
        seq_id: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
        total_tokens: int,
    ) -> bool: ...

    def reserved_tokens(self, seq_id: int) -> int: ...

    def add(
        self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None: ...

    def reserve(self, seq_id: int, total_tokens: int) -> bool: ...

    def release_cache(self, seq_id: int) -> None: ...

    def remove(self, seq_id: int) -> None: ...

    def step(
        self, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None
    ) -> StepOutput: ...
