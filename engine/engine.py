"""The token-level engine: sequences in, one forward per step over a ragged batch, sampled tokens out.

The engine knows nothing of text, requests or policies. A scheduler adds sequences, reserves cache for the
tokens it wants computed, and calls `step()` with (sequence id, number of pending tokens to compute) pairs.
Per-row state lives in preallocated tensors (engine/rows.py) so that building a step is a handful of tensor ops;
sampling and the stop checks are engine/sample/sampling_step.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.config import EngineConfig
from engine.errors import CacheCapacityError, ContextLengthError, EngineInputError, InputField
from engine.kv.block_manager import BlockManager, CacheQueries
from engine.kv.kv_cache import PagedKVCache
from engine.model.forward_batch import PromptScoring, build_forward_batch, move_batch
from engine.model.model_runner import ModelRunner
from engine.model.prompt_scoring import PromptScores
from engine.outputs import DraftStats, PromptLogprobs, StepOutput
from engine.rows import SequenceRows
from engine.sample.grammar import GrammarMatcher
from engine.sample.sampling_params import SamplingParams
from engine.sample.sampling_step import sample_and_record
from engine.spec.verify import verify_and_record


class Engine(CacheQueries):
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        eos_token_ids: Sequence[int] = (),
        model_max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.runner = runner
        self.config = config
        limits = [v for v in (config.max_model_len, model_max_len) if v is not None]
        self.max_model_len = min(limits) if limits else config.kv_cache_tokens
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        # The one owner of the cache's blocks; block_table below mirrors each row's list for the forward.
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, self.max_model_len
        )
        self.cache = PagedKVCache(runner.kv_cache_shape(config.num_blocks, config.block_size), dtype, self.device)
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.rows = SequenceRows(config, self.max_model_len, runner.vocab_size)
        self._salt_of: dict[int, str | None] = {}
        self._matcher_of: dict[int, GrammarMatcher] = {}  # the grammar state of each constrained sequence

    # ----- capacity -----
    @property
    def cache_usage(self) -> float:
        """Fraction of KV cache blocks in use, 0..1."""
        return self.blocks.usage

    @property
    def num_free_seats(self) -> int:
        return self.rows.num_free

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.rows

    def num_pending(self, seq_id: int) -> int:
        """Known tokens of the sequence not yet in the cache (the prompt before prefill, then 1 per step)."""
        return int(self.rows.seq_len[self.rows.row(seq_id)]) - self.num_computed(seq_id)

    def num_computed(self, seq_id: int) -> int:
        """Tokens of the sequence in the cache. One that holds no cache yet (fresh or preempted) will start from
        the cached prefix of its known tokens when `reserve` gives it cache: that is counted already."""
        if self.blocks.holds(seq_id):
            return int(self.rows.num_computed[self.rows.row(seq_id)])
        if not self.blocks.enabled:
            return 0
        known, salt, reads = self._known(seq_id)
        return len(self.blocks.lookup(seq_id, known, salt, reads).blocks) * self.block_size

    def _known(self, seq_id: int) -> tuple[list[int], str | None, bool]:
        """The sequence's known tokens, its salt, and whether it reads the cache (prompt logprobs need every
        position computed)."""
        row = self.rows.row(seq_id)
        reads = int(self.rows.prompt_top_k[row]) < 0
        return self.rows.token_buffer[row, : int(self.rows.seq_len[row])].tolist(), self._salt_of[seq_id], reads

    # ----- sequence lifecycle -----
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise EngineInputError if the sequence could never run; touches no state."""
        vocab = self.runner.vocab_size
        if len(prompt_token_ids) == 0:
            raise EngineInputError("the prompt is empty; give at least one token", InputField.PROMPT)
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise EngineInputError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", InputField.PROMPT
            )
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            message = f"stop token id {bad_stops[0]} is outside the vocabulary [0, {vocab})"
            raise EngineInputError(message, InputField.STOP_TOKEN_IDS)
        if len(params.stop_token_ids) > self.config.max_stop_token_ids:
            message = f"at most {self.config.max_stop_token_ids} stop token ids are allowed"
            raise EngineInputError(message, InputField.STOP_TOKEN_IDS)
        self._validate_sampling_extensions(params)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were requested "
                f"({len(prompt_token_ids)} in the prompt, {params.max_tokens} for the completion)",
                InputField.MAX_TOKENS if len(prompt_token_ids) < self.max_model_len else InputField.PROMPT,
            )
        if -(-total // self.block_size) > self.config.num_blocks:
            raise CacheCapacityError(
                f"the KV cache holds {self.config.num_blocks * self.block_size} tokens, fewer than the "
                f"{total} this sequence needs",
                InputField.MAX_TOKENS,
            )

    def _validate_sampling_extensions(self, params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
        for field, value in (
            (InputField.LOGPROBS, params.logprobs),
            (InputField.PROMPT_LOGPROBS, params.prompt_logprobs),
        ):
            if value is not None and value > vocab:  # more alternatives than tokens: a top-k the engine cannot take
                raise EngineInputError(f"at most {vocab} alternatives (the vocabulary) can be reported", field)
        bad_bias = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad_bias:
            message = f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {vocab})"
            raise EngineInputError(message, InputField.LOGIT_BIAS)
        if len(params.logit_bias) > self.config.max_logit_bias:
            limit = self.config.max_logit_bias
            raise EngineInputError(f"logit_bias may name at most {limit} tokens", InputField.LOGIT_BIAS)
        if params.allowed_token_ids is None:
            return
        bad_allowed = [t for t in params.allowed_token_ids if not 0 <= t < vocab]
        if bad_allowed:
            message = f"allowed token id {bad_allowed[0]} is outside the vocabulary [0, {vocab})"
            raise EngineInputError(message, InputField.ALLOWED_TOKEN_IDS)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids.tolist()))
        if params.min_tokens > 0 and set(params.allowed_token_ids) <= stops:
            # Until min_tokens such a row would have no token left to sample.
            raise EngineInputError(
                "min_tokens forbids stop and EOS tokens, and allowed_token_ids allows nothing else",
                InputField.MIN_TOKENS,
            )

    def add(
        self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Register a sequence in a free row. Its cache is reserved separately with `reserve`; only sequences with
        the same `cache_salt` share cached blocks."""
        self.validate(prompt_token_ids, params)
        matcher = params.grammar.matcher() if params.grammar is not None else None
        self.rows.seat(seq_id, prompt_token_ids, params)
        self._salt_of[seq_id] = cache_salt
        if matcher is not None:
            self._matcher_of[seq_id] = matcher

    def reserve(self, seq_id: int, total_tokens: int) -> bool:
        """Make the sequence's cache hold `total_tokens` positions; all or nothing. False if blocks ran out.
        A sequence that holds no cache first takes the cached blocks of its prefix (see `num_computed`)."""
        row = self.rows.row(seq_id)
        start = len(self.blocks.blocks(seq_id))
        if start == 0:
            known, salt, reads = self._known(seq_id) if self.blocks.enabled else ([], None, False)
            match = self.blocks.admit(seq_id, known, salt, reads, total_tokens)
            if match is None:
                return False
            self.rows.num_computed[row] = len(match.blocks) * self.block_size
            new = self.blocks.blocks(seq_id)
        else:
            grown = self.blocks.grow(seq_id, total_tokens)
            if grown is None:
                return False
            new = grown
        if new:
            self.rows.block_table[row, start : start + len(new)] = torch.tensor(new, dtype=torch.long)
        return True

    def reserved_tokens(self, seq_id: int) -> int:
        return self.blocks.num_blocks(seq_id) * self.block_size

    def release_cache(self, seq_id: int) -> None:
        """Free the sequence's cache and mark it for recomputation (preemption); its tokens are kept."""
        self.blocks.free(seq_id)
        self.rows.num_computed[self.rows.row(seq_id)] = 0

    def remove(self, seq_id: int) -> None:
        """Forget the sequence and free its row and cache. Unknown ids are ignored (idempotent)."""
        if self.rows.release(seq_id) is not None:
            self.blocks.free(seq_id)
            del self._salt_of[seq_id]
            self._matcher_of.pop(seq_id, None)

    # ----- the step -----
    def step(
        self, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None
    ) -> StepOutput:
        """Compute `count` pending tokens for each (seq_id, count); sample for sequences whose pending ran out.
        `drafts`: draft tokens to verify after a sampling sequence's last known token (greedy speculation,
        engine/spec/verify.py); its reserved cache must hold them too, and the sequence may emit several tokens."""
        if not schedule:
            return StepOutput((), 0, 0)
        state = self.rows
        seq_ids = [seq_id for seq_id, _ in schedule]
        rows = state.rows(seq_ids)
        counts = torch.tensor([count for _, count in schedule], dtype=torch.long)
        self._check_schedule(seq_ids, rows, counts)
        row_drafts = [list(drafts.get(s, ())) for s in seq_ids] if drafts else None
        num_drafts = self._place_drafts(seq_ids, rows, counts, row_drafts) if row_drafts else None
        computed = counts if num_drafts is None else counts + num_drafts

        batch, samples = build_forward_batch(
            rows,
            computed,
            state.num_computed,
            state.seq_len,
            state.token_buffer,
            state.block_table,
            self.block_size,
            prompt_len=state.prompt_len,
            prompt_top_k=state.prompt_top_k,
            prompt_scored=state.prompt_scored,
            num_drafts=num_drafts,
        )
        result = self.runner.forward(move_batch(batch, self.device), self.cache)
        prompt_logprobs = self._record_prompt_scores(seq_ids, rows, batch.scoring, result.prompt_scores)
        sampled_ids = [s for s, m in zip(seq_ids, samples.tolist(), strict=True) if m]
        state.num_computed[rows] += counts
        if row_drafts is None:
            outputs = sample_and_record(
                state, rows[samples], result.logits, sampled_ids, self.eos_token_ids, self._matcher_of
            )
            self._register_full_blocks(seq_ids, rows)
            return StepOutput(outputs, len(seq_ids), batch.num_tokens, prompt_logprobs)
        sampled_drafts = [d for d, m in zip(row_drafts, samples.tolist(), strict=True) if m]
        verified = verify_and_record(
            state, rows[samples], result.logits, sampled_ids, sampled_drafts, self.eos_token_ids, self._matcher_of
        )
        # Rollback: only accepted tokens count as computed; what rejected drafts wrote lies past num_computed.
        state.num_computed[rows[samples]] += verified.emitted - 1
        self._register_full_blocks(seq_ids, rows)
        stats = DraftStats.of(sampled_ids, sampled_drafts, verified.accepted)
        return StepOutput(verified.tokens, len(seq_ids), batch.num_tokens, prompt_logprobs, stats)

    def _place_drafts(
        self, seq_ids: list[int], rows: torch.Tensor, counts: torch.Tensor, row_drafts: list[list[int]]
    ) -> torch.Tensor:
        """Write each row's drafts past its known tokens; [rows] their number. Only a row whose step completes its
        known tokens may carry drafts, within its reserved cache and the context window."""
        state = self.rows
        num_drafts = torch.tensor([len(d) for d in row_drafts], dtype=torch.long)
        has = num_drafts > 0
        end = state.seq_len[rows] + num_drafts
        reserved = torch.tensor([self.blocks.num_blocks(s) for s in seq_ids]) * self.block_size
        if bool((has & (state.num_computed[rows] + counts != state.seq_len[rows])).any()):
            raise ValueError("drafts given for a sequence that does not sample this step")
        if bool((has & (end > torch.minimum(reserved, torch.tensor(self.max_model_len)))).any()):
            raise ValueError("drafts run past a sequence's reserved cache or the context window")
        if any(not 0 <= t < self.runner.vocab_size for tokens in row_drafts for t in tokens):
            raise ValueError("a draft token is outside the vocabulary")
        for row, length, tokens in zip(rows.tolist(), state.seq_len[rows].tolist(), row_drafts, strict=True):
            if tokens:
                state.token_buffer[row, length : length + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return num_drafts

    def _register_full_blocks(self, seq_ids: list[int], rows: torch.Tensor) -> None:
        """Put the blocks this step filled into the prefix cache. Only rows that crossed a block boundary are
        visited: after prefill, one in `block_size` decode steps."""
        if not self.blocks.enabled:
            return
        size, manager = self.block_size, self.blocks
        full = (self.rows.num_computed[rows] // size).tolist()
        for seq_id, row, num_full in zip(seq_ids, rows.tolist(), full, strict=True):
            first = manager.registered(seq_id)
            if num_full > first:
                manager.register(seq_id, self.rows.token_buffer[row, first * size : num_full * size].tolist(), num_full)

    def _record_prompt_scores(
        self, seq_ids: list[int], rows: torch.Tensor, scoring: PromptScoring | None, scores: PromptScores | None
    ) -> tuple[PromptLogprobs, ...]:
        """Mark the scored positions delivered and package them per sequence, each with its own top-k."""
        if scoring is None:
            return ()
        if scores is None:
            raise RuntimeError("the model runner returned no prompt scores for a batch that asked for them")
        scored = scoring.count > 0
        self.rows.prompt_scored[rows[scored]] = (scoring.first_position + scoring.count)[scored]
        targets, logprobs = scoring.target.tolist(), scores.logprobs.tolist()
        ranks, top_ids, top_logprobs = scores.ranks.tolist(), scores.top_ids.tolist(), scores.top_logprobs.tolist()
        wanted = self.rows.prompt_top_k[rows].tolist()
        parts, start = [], 0
        for seq_id, first, count, k in zip(
            seq_ids, scoring.first_position.tolist(), scoring.count.tolist(), wanted, strict=True
        ):
            if count == 0:
                continue
            end = start + count
            top = tuple(
                tuple(zip(ids[:k], values[:k], strict=True))
                for ids, values in zip(top_ids[start:end], top_logprobs[start:end], strict=True)
            )
            parts.append(
                PromptLogprobs(
                    seq_id,
                    first,
                    tuple(targets[start:end]),
                    tuple(logprobs[start:end]),
                    tuple(ranks[start:end]),
                    top,
                )
            )
            start = end
        return tuple(parts)

    def _check_schedule(self, seq_ids: list[int], rows: torch.Tensor, counts: torch.Tensor) -> None:
        computed = self.rows.num_computed[rows]
        pending = self.rows.seq_len[rows] - computed
        reserved = torch.tensor([self.blocks.num_blocks(s) for s in seq_ids], dtype=torch.long) * self.block_size
        if bool((counts < 1).any() or (counts > pending).any()):
            raise ValueError("schedule asks for more tokens than a sequence has pending, or for none")
        if bool((computed + counts > reserved).any()):
            raise ValueError("schedule computes tokens beyond a sequence's reserved cache")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence appears twice in one step")
