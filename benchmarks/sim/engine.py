"""A simulated engine: the real engine's bookkeeping (rows, cache blocks, pending tokens, finishes) without a model.

`SimEngine` satisfies `scheduler.engine_port.SchedulerEngine`, so the real `Scheduler`, `Lifecycle` and policies
run on it unchanged (mypy checks the fit where `benchmarks.sim.run` builds a `Scheduler` over it). A step
computes nothing: it advances the sequences' counters exactly as `engine.engine.Engine.step` does, decides
finishes by the same rules (a natural stop at a replayed output length, else max_tokens or the context window),
and moves a `VirtualClock` forward by the cost model's time for the step.

Cache blocks are held by the engine's own `BlockManager`, and with prefix caching on
(`EngineConfig.enable_prefix_caching`) it registers every full block and hands a new (or resumed) sequence the cached
blocks its known tokens start with, by the engine's rules: admission, preemption and eviction see the same counts, and a
step computes (and is charged for) only the uncached tokens. The ids a sequence generates are synthetic, a function
of its prompt (`answer_ids`): equal prompts get equal answers, as with greedy decoding, so a conversation's next
turn, whose prompt holds the previous answer, finds it cached.

Speculation (`SchedulerConfig.speculative`): the real scheduler proposes drafts through a `SyntheticDrafter` (a row
that may draft has k with probability `draft_rate`, else none, as n-gram lookup finds a match or not; the draft-length
rule picks how many it verifies, from the step costs it measures on the virtual clock), and a row verifying k drafts
accepts each with probability `acceptance_rate`, independently, up to the first wrong one (vLLM's synthetic
acceptance), then emits the bonus token. The step is charged as one sequence whose k + 1 positions are computed,
sampled and attend to its context, read once (the engine runs them as k + 1 decode-kernel rows over one block table:
the later ones read it from cache), which is how the profile's verify steps are described (`Grid.draft_tokens`).
The cache rolls back by the accepted length: the row's computed tokens grow by what it emitted less one, and only
full blocks of accepted tokens are registered.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.sim.cost.model import CostModel, StepShape
from benchmarks.sim.cost.speculation import accepted_drafts
from benchmarks.sim.prompts import answer_base
from engine.config import EngineConfig
from engine.errors import CacheCapacityError, ContextLengthError, EngineInputError, InputField
from engine.kv.block_manager import BlockManager, CacheQueries
from engine.outputs import DraftStats, FinishReason, StepOutput, TokenOutput
from engine.sample.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from scheduler.request import SequenceRequest

SIM_TOKEN_ID = 0  # every simulated token; nothing downstream of the scheduler reads it
DEFAULT_ACCEPTANCE_RATE = 0.5  # a draft's chance to be right where no rate is given (docs/simulator.md)
DEFAULT_DRAFT_RATE = 1.0  # a row's chance to have drafts at a step where no rate is given: every row drafts


class VirtualClock:
    """The simulation's time in seconds: the scheduler reads it, the engine's steps and the driver move it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go backwards ({seconds} s)")
        self.now += seconds


@dataclass(slots=True)
class _Sequence:
    prompt_len: int
    seq_len: int  # prompt plus generated tokens
    max_tokens: int
    stop_after: int | None  # replayed natural stop: generated tokens at which the model said EOS
    computed: int = 0
    token: TokenOutput | None = None  # the one unfinished token this sequence ever reports, reused every step
    # The prefix cache's view (read only with caching on): the prompt's ids, the first id of its answer, the salt,
    # whether it may read the cache (not with prompt logprobs).
    prompt: Sequence[int] = ()
    answer_base: int = 0
    salt: str | None = None
    reads: bool = True


class SyntheticDrafter:
    """The simulator's drafter (`Scheduler(drafter=...)`): simulated tokens carry no text to look up, so a row that may
    draft gets k drafts with probability `draft_rate` (its own seeded draw; at 1.0 every row, with no draw) and none
    otherwise. Whether the drafts are right is `SimEngine`'s draw."""

    def __init__(self, draft_rate: float = 1.0, seed: int = 0) -> None:
        if not 0.0 <= draft_rate <= 1.0:
            raise ValueError(f"draft_rate must be in [0, 1], got {draft_rate}")
        self.draft_rate = draft_rate
        self._rng = random.Random(f"drafts {seed}")  # not SimEngine's stream for the same seed: independent draws

    def __call__(self, request: SequenceRequest, k: int, spec: SpeculativeConfig | None) -> list[int]:
        if self.draft_rate < 1.0 and self._rng.random() >= self.draft_rate:
            return []
        return [SIM_TOKEN_ID] * k


class SimEngine(CacheQueries):
    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        clock: VirtualClock,
        model_max_len: int | None = None,
        acceptance_rate: float = DEFAULT_ACCEPTANCE_RATE,
        seed: int = 0,
    ) -> None:
        """`acceptance_rate`, `seed`: speculation's synthetic acceptance (`_accepted`), the same draws for a seed."""
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        self.acceptance_rate = acceptance_rate
        self._rng = random.Random(seed)
        self.config = config
        self.cost = cost
        self.clock = clock
        limits = [v for v in (config.max_model_len, model_max_len) if v is not None]
        self.max_model_len = min(limits) if limits else config.kv_cache_tokens
        self.block_size = config.block_size
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, self.max_model_len
        )
        self._seqs: dict[int, _Sequence] = {}
        self._stop_after: dict[int, int] = {}  # seq_id -> replayed output length, until the sequence is added
        self._last_step_end = -math.inf  # the first step is cold, as a fresh server's is

    # ----- what the scheduler reads -----
    @property
    def cache_usage(self) -> float:
        return self.blocks.usage

    @property
    def num_free_rows(self) -> int:
        return self.config.max_rows - len(self._seqs)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_pending(self, seq_id: int) -> int:
        return self._seqs[seq_id].seq_len - self.num_computed(seq_id)

    def num_computed(self, seq_id: int) -> int:
        """As the engine's: a sequence that holds no cache counts the cached prefix it will start from."""
        seq = self._seqs[seq_id]
        if not self.blocks.enabled or self.blocks.holds(seq_id):
            return seq.computed
        return len(self.blocks.lookup(seq_id, self._known(seq, 0, seq.seq_len), seq.salt, seq.reads).blocks) * (
            self.block_size
        )

    def reserved_tokens(self, seq_id: int) -> int:
        return self.blocks.num_blocks(seq_id) * self.block_size

    # ----- sequence lifecycle -----
    def expect_output(self, seq_id: int, output_tokens: int) -> None:
        """Replay a natural stop: the sequence ends with STOP after `output_tokens` (if below its max_tokens)."""
        self._stop_after[seq_id] = output_tokens

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """The engine's length checks (a simulated prompt has no token ids to check)."""
        if len(prompt_token_ids) == 0:
            raise EngineInputError("the prompt is empty; give at least one token", InputField.PROMPT)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were requested",
                InputField.MAX_TOKENS,
            )
        if -(-total // self.block_size) > self.config.num_blocks:
            raise CacheCapacityError(
                f"the KV cache holds {self.config.num_blocks * self.block_size} tokens, fewer than {total}",
                InputField.MAX_TOKENS,
            )

    def _known(self, seq: _Sequence, start: int, stop: int) -> list[int]:
        """The ids of the sequence's tokens at positions start..stop: its prompt's, then its synthetic answer's."""
        prompt_len = seq.prompt_len
        ids = list(seq.prompt[start:stop]) if start < prompt_len else []
        if stop > prompt_len:
            first = max(start, prompt_len) - prompt_len
            ids.extend(range(seq.answer_base + first, seq.answer_base + stop - prompt_len))
        return ids

    def add(
        self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the engine")
        if len(self._seqs) >= self.config.max_rows:
            raise RuntimeError("no free engine row; the scheduler admitted more sequences than the engine has rows")
        n = len(prompt_token_ids)
        seq = _Sequence(n, n, params.max_tokens, self._stop_after.pop(seq_id, None))
        seq.token = TokenOutput(seq_id, SIM_TOKEN_ID, None, None, None)
        if self.blocks.enabled:
            seq.prompt, seq.answer_base = prompt_token_ids, answer_base(prompt_token_ids)
            seq.salt, seq.reads = cache_salt, params.prompt_logprobs is None
        self._seqs[seq_id] = seq

    def reserve(self, seq_id: int, total_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        if self.blocks.holds(seq_id):
            return self.blocks.grow(seq_id, total_tokens) is not None
        known = self._known(seq, 0, seq.seq_len) if self.blocks.enabled else []
        match = self.blocks.admit(seq_id, known, seq.salt, seq.reads, total_tokens)
        if match is None:
            return False
        seq.computed = len(match.blocks) * self.block_size
        return True

    def release_cache(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self._seqs[seq_id].computed = 0

    def remove(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.blocks.free(seq_id)
        self._stop_after.pop(seq_id, None)

    # ----- the step -----
    def step(
        self, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None
    ) -> StepOutput:
        if not schedule:
            return StepOutput((), 0, 0)
        # One pass of plain integer arithmetic per row: this loop is most of the simulator's own cost.
        tokens: list[TokenOutput] = []
        num_tokens = attention = kv_tokens = sampled = 0
        block_size, seqs = self.block_size, self._seqs
        manager = self.blocks
        caching = manager.enabled
        row_drafts = drafts or {}
        verified: list[tuple[int, int, int]] = []  # (seq_id, drafts, accepted) of each row that verified drafts
        filled: list[tuple[int, _Sequence]] = []  # sequences that filled a block this step, in schedule order
        for seq_id, count in schedule:
            seq = seqs[seq_id]
            computed = seq.computed
            end = computed + count
            reserved = manager.num_blocks(seq_id) * block_size
            if count < 1 or end > seq.seq_len or end > reserved:
                raise ValueError("schedule asks for no tokens, more than are pending, or more than are reserved")
            k = len(row_drafts.get(seq_id, ()))
            if k and (end != seq.seq_len or end + k > min(reserved, self.max_model_len)):
                raise ValueError("drafts for a sequence that does not sample this step, or past its reserved cache")
            width = count + k
            num_tokens += width
            pairs = width * computed + width * (width + 1) // 2  # chunk_attention_pairs, inlined
            attention += pairs
            kv_tokens += end + k  # its context, read once: a verify row's k + 1 positions share it
            seq.computed = end
            if end == seq.seq_len:  # its pending tokens ran out: the engine samples one (k + 1 with drafts)
                sampled += 1 + k
                if k:
                    accepted = self._accepted(k)
                    emitted = self._emit(seq_id, seq, accepted + 1, tokens)
                    seq.computed = end + emitted - 1  # rollback: rejected drafts' keys lie past what is computed
                    verified.append((seq_id, k, min(accepted, emitted)))
                else:
                    seq.seq_len = end + 1
                    tokens.append(self._sampled(seq_id, seq))
            if caching and seq.computed // block_size > manager.registered(seq_id):
                filled.append((seq_id, seq))
        if len({seq_id for seq_id, _ in schedule}) != len(schedule):
            raise ValueError("a sequence appears twice in one step")
        for seq_id, seq in filled:  # the engine's _register_full_blocks, after the step's tokens are computed
            full, first = seq.computed // block_size, manager.registered(seq_id)
            manager.register(seq_id, self._known(seq, first * block_size, full * block_size), full)
        shape = StepShape(len(schedule), num_tokens, sampled, attention, kv_tokens)
        self.clock.advance(self.cost.step_time(shape, idle_s=self.clock() - self._last_step_end))
        self._last_step_end = self.clock()
        if not verified:
            return StepOutput(tuple(tokens), len(schedule), num_tokens)
        stats = DraftStats.of([v[0] for v in verified], [range(v[1]) for v in verified], [v[2] for v in verified])
        return StepOutput(tuple(tokens), len(schedule), num_tokens, (), stats)

    def _accepted(self, k: int) -> int:
        return accepted_drafts(self._rng.random, self.acceptance_rate, k)

    def _emit(self, seq_id: int, seq: _Sequence, count: int, tokens: list[TokenOutput]) -> int:
        """Up to `count` tokens for a row that verified drafts, as the engine emits them: a finish stops the row."""
        for emitted in range(1, count + 1):
            seq.seq_len += 1
            token = self._sampled(seq_id, seq)
            tokens.append(token)
            if token.finish_reason is not None:
                return emitted
        return count

    def _sampled(self, seq_id: int, seq: _Sequence) -> TokenOutput:
        """The engine's finish rule: a stop beats the length limits when both hold."""
        generated = seq.seq_len - seq.prompt_len
        if seq.stop_after is not None and generated == seq.stop_after < seq.max_tokens:
            return TokenOutput(seq_id, SIM_TOKEN_ID, None, None, FinishReason.STOP)
        if generated >= seq.max_tokens or seq.seq_len >= self.max_model_len:
            return TokenOutput(seq_id, SIM_TOKEN_ID, None, None, FinishReason.LENGTH)
        assert seq.token is not None
        return seq.token
