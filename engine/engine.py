"""The token-level engine: sequences in, one forward per step over a ragged batch, sampled tokens out.

The engine knows nothing of text, requests or policies. A scheduler adds sequences, reserves cache for the
tokens it wants computed, and calls `step()` with (sequence id, number of pending tokens to compute) pairs.
Per-row state lives in preallocated tensors so that building a step is a handful of tensor ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.errors import CacheCapacityError, EngineInputError
from engine.forward_batch import PromptScoring, build_forward_batch, move_batch
from engine.kv_cache import BlockAllocator, PagedKVCache
from engine.logits_processors import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    LogitsEdits,
    OutputPenalties,
    RepetitionPenalty,
    token_mask,
)
from engine.model_runner import ModelRunner
from engine.outputs import FinishReason, PromptLogprobs, StepOutput, TokenOutput
from engine.prompt_scoring import PromptScores
from engine.sampler import RowSampling, SampleResult, sample
from engine.sampling_params import SamplingParams

_NOT_FINISHED, _STOPPED, _LENGTH = 0, 1, 2


class Engine:
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
        self.allocator = BlockAllocator(config.num_blocks)
        self.cache = PagedKVCache(runner.kv_cache_shape(config.num_blocks, config.block_size), dtype, self.device)
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)

        rows, max_blocks = config.max_num_seqs, -(-self.max_model_len // self.block_size)
        # Per-row state, indexed by engine row. [rows] unless noted.
        self._token_buffer = torch.zeros(rows, self.max_model_len, dtype=torch.long)  # [rows, max_model_len]
        self._block_table = torch.zeros(rows, max_blocks, dtype=torch.long)  # [rows, max blocks per sequence]
        self._num_blocks = torch.zeros(rows, dtype=torch.long)  # blocks reserved, the valid prefix of the table
        self._num_computed = torch.zeros(rows, dtype=torch.long)
        self._seq_len = torch.zeros(rows, dtype=torch.long)
        self._prompt_len = torch.zeros(rows, dtype=torch.long)
        self._max_tokens = torch.zeros(rows, dtype=torch.long)
        self._temperature = torch.zeros(rows)
        self._top_p = torch.ones(rows)
        self._top_k = torch.zeros(rows, dtype=torch.long)
        self._seed = torch.zeros(rows, dtype=torch.long)
        self._presence = torch.zeros(rows)
        self._frequency = torch.zeros(rows)
        self._ignore_eos = torch.zeros(rows, dtype=torch.bool)
        self._logprobs = torch.full((rows,), -1, dtype=torch.long)
        self._stop_ids = torch.full((rows, config.max_stop_token_ids), -1, dtype=torch.long)  # [rows, max stops]
        # vLLM's sampling extensions. Each feature's rows are found with one comparison per step (see _edits).
        self._min_tokens = torch.zeros(rows, dtype=torch.long)
        self._repetition = torch.ones(rows)
        self._min_p = torch.zeros(rows)
        self._num_bias = torch.zeros(rows, dtype=torch.long)
        self._bias_ids = torch.zeros(rows, config.max_logit_bias, dtype=torch.long)  # [rows, max bias], pad id 0
        self._bias_values = torch.zeros(rows, config.max_logit_bias)  # [rows, max bias], pad 0.0
        self._restricted = torch.zeros(rows, dtype=torch.bool)  # the row has allowed_token_ids
        self._allowed = torch.zeros(rows, runner.vocab_size, dtype=torch.bool)  # [rows, vocab], read if restricted
        # Prompt scoring: alternatives wanted (-1: off) and the first prompt position not delivered yet, which
        # survives preemption so that a recomputed prompt is not scored twice.
        self._prompt_top_k = torch.full((rows,), -1, dtype=torch.long)
        self._prompt_scored = torch.ones(rows, dtype=torch.long)

        self._free_rows = list(range(rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}
        self._blocks_of: dict[int, list[int]] = {}

    # ----- capacity -----
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def cache_usage(self) -> float:
        """Fraction of KV cache blocks in use, 0..1."""
        return self.allocator.num_used / self.allocator.num_blocks

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def num_pending(self, seq_id: int) -> int:
        """Known tokens of the sequence not yet in the cache (the prompt before prefill, then 1 per step)."""
        row = self._row_of[seq_id]
        return int(self._seq_len[row] - self._num_computed[row])

    def num_computed(self, seq_id: int) -> int:
        return int(self._num_computed[self._row_of[seq_id]])

    def num_tokens(self, seq_id: int) -> int:
        return int(self._seq_len[self._row_of[seq_id]])

    def output_token_ids(self, seq_id: int) -> list[int]:
        row = self._row_of[seq_id]
        return self._token_buffer[row, int(self._prompt_len[row]) : int(self._seq_len[row])].tolist()

    # ----- sequence lifecycle -----
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise EngineInputError if the sequence could never run; touches no state."""
        vocab = self.runner.vocab_size
        if len(prompt_token_ids) == 0:
            raise EngineInputError("the prompt is empty; give at least one token", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise EngineInputError(
                f"stop token id {bad_stops[0]} is outside the vocabulary [0, {vocab})", param="stop_token_ids"
            )
        if len(params.stop_token_ids) > self.config.max_stop_token_ids:
            raise EngineInputError(
                f"at most {self.config.max_stop_token_ids} stop token ids are allowed", param="stop_token_ids"
            )
        self._validate_sampling_extensions(params)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise EngineInputError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were requested "
                f"({len(prompt_token_ids)} in the prompt, {params.max_tokens} for the completion); "
                "shorten the prompt or lower max_tokens",
                param="max_tokens" if len(prompt_token_ids) < self.max_model_len else "prompt",
            )
        if self.blocks_for(total) > self.allocator.num_blocks:
            raise CacheCapacityError(
                f"the KV cache holds {self.allocator.num_blocks * self.block_size} tokens, fewer than the "
                f"{total} this sequence needs; raise kv_cache_tokens or lower max_tokens",
                param="max_tokens",
            )

    def _validate_sampling_extensions(self, params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
        bad_bias = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad_bias:
            raise EngineInputError(
                f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {vocab})", param="logit_bias"
            )
        if len(params.logit_bias) > self.config.max_logit_bias:
            limit = self.config.max_logit_bias
            raise EngineInputError(f"logit_bias may name at most {limit} tokens", param="logit_bias")
        if params.allowed_token_ids is None:
            return
        bad_allowed = [t for t in params.allowed_token_ids if not 0 <= t < vocab]
        if bad_allowed:
            raise EngineInputError(
                f"allowed token id {bad_allowed[0]} is outside the vocabulary [0, {vocab})", param="allowed_token_ids"
            )
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids.tolist()))
        if params.min_tokens > 0 and set(params.allowed_token_ids) <= stops:
            # Until min_tokens such a row would have no token left to sample.
            raise EngineInputError(
                "min_tokens forbids stop and EOS tokens, and allowed_token_ids allows nothing else", param="min_tokens"
            )

    def add(self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Register a sequence in a free row. Its cache is reserved separately with `reserve`."""
        self.validate(prompt_token_ids, params)
        if seq_id in self._row_of:
            raise ValueError(f"sequence {seq_id} is already in the engine")
        if not self._free_rows:
            raise RuntimeError("no free engine row; the scheduler admitted more than max_num_seqs sequences")
        # Convert everything before taking a row, so a failure here leaves no half-registered sequence.
        prompt = torch.tensor(prompt_token_ids, dtype=torch.long)
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long)
        bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        bias_values = torch.tensor([v for _, v in params.logit_bias], dtype=torch.float32)
        allowed = None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids, dtype=torch.long)
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self._blocks_of[seq_id] = []
        n = len(prompt_token_ids)
        self._token_buffer[row, :n] = prompt
        self._num_computed[row] = 0
        self._seq_len[row] = n
        self._prompt_len[row] = n
        self._max_tokens[row] = params.max_tokens
        # Greedy rows store 0 so the sampler, comparing in float32, agrees with params.greedy at the boundary.
        self._temperature[row] = 0.0 if params.greedy else params.temperature
        self._top_p[row] = params.top_p
        self._top_k[row] = params.top_k
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self._seed[row] = seed
        self._presence[row] = params.presence_penalty
        self._frequency[row] = params.frequency_penalty
        self._ignore_eos[row] = params.ignore_eos
        self._logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._stop_ids[row] = -1
        self._stop_ids[row, : len(stops)] = stops
        self._set_sampling_extensions(row, params, bias_ids, bias_values, allowed)
        self._prompt_top_k[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self._prompt_scored[row] = 1

    def _set_sampling_extensions(
        self,
        row: int,
        params: SamplingParams,
        bias_ids: torch.Tensor,
        bias_values: torch.Tensor,
        allowed: torch.Tensor | None,
    ) -> None:
        self._min_tokens[row] = params.min_tokens
        self._repetition[row] = params.repetition_penalty
        self._min_p[row] = params.min_p
        self._num_bias[row] = len(bias_ids)
        self._bias_ids[row] = 0
        self._bias_values[row] = 0.0
        self._bias_ids[row, : len(bias_ids)] = bias_ids
        self._bias_values[row, : len(bias_values)] = bias_values
        self._restricted[row] = allowed is not None
        if allowed is not None:
            self._allowed[row] = False
            self._allowed[row, allowed] = True

    def reserve(self, seq_id: int, total_tokens: int) -> bool:
        """Make the sequence's cache hold `total_tokens` positions; all or nothing. False if blocks ran out."""
        blocks = self._blocks_of[seq_id]
        missing = self.blocks_for(min(total_tokens, self.max_model_len)) - len(blocks)
        if missing <= 0:
            return True
        new = self.allocator.allocate(missing)
        if new is None:
            return False
        row = self._row_of[seq_id]
        self._block_table[row, len(blocks) : len(blocks) + missing] = torch.tensor(new, dtype=torch.long)
        blocks.extend(new)
        self._num_blocks[row] = len(blocks)
        return True

    def reserved_tokens(self, seq_id: int) -> int:
        return len(self._blocks_of[seq_id]) * self.block_size

    def release_cache(self, seq_id: int) -> None:
        """Free the sequence's cache and mark it for recomputation (preemption); its tokens are kept."""
        self.allocator.free(self._blocks_of[seq_id])
        self._blocks_of[seq_id] = []
        row = self._row_of[seq_id]
        self._num_computed[row] = 0
        self._num_blocks[row] = 0

    def remove(self, seq_id: int) -> None:
        """Forget the sequence and free its row and cache. Unknown ids are ignored (idempotent)."""
        row = self._row_of.pop(seq_id, None)
        if row is None:
            return
        self.allocator.free(self._blocks_of.pop(seq_id))
        self._num_blocks[row] = 0
        self._free_rows.append(row)

    # ----- the step -----
    def step(self, schedule: Sequence[tuple[int, int]]) -> StepOutput:
        """Compute `count` pending tokens for each (seq_id, count); sample for sequences whose pending ran out."""
        if not schedule:
            return StepOutput((), 0, 0)
        seq_ids = [seq_id for seq_id, _ in schedule]
        rows = torch.tensor([self._row_of[s] for s in seq_ids], dtype=torch.long)
        counts = torch.tensor([count for _, count in schedule], dtype=torch.long)
        self._check_schedule(seq_ids, rows, counts)

        batch, samples = build_forward_batch(
            rows,
            counts,
            self._num_computed,
            self._seq_len,
            self._token_buffer,
            self._block_table,
            self.block_size,
            prompt_len=self._prompt_len,
            prompt_top_k=self._prompt_top_k,
            prompt_scored=self._prompt_scored,
        )
        result = self.runner.forward(move_batch(batch, self.device), self.cache)
        self._num_computed[rows] += counts
        prompt_logprobs = self._record_prompt_scores(seq_ids, rows, batch.scoring, result.prompt_scores)
        outputs = self._sample_and_record(
            rows[samples], result.logits, [s for s, m in zip(seq_ids, samples.tolist(), strict=True) if m]
        )
        return StepOutput(outputs, len(seq_ids), batch.num_tokens, prompt_logprobs)

    def _record_prompt_scores(
        self, seq_ids: list[int], rows: torch.Tensor, scoring: PromptScoring | None, scores: PromptScores | None
    ) -> tuple[PromptLogprobs, ...]:
        """Mark the scored positions delivered and package them per sequence, each with its own top-k."""
        if scoring is None:
            return ()
        if scores is None:
            raise RuntimeError("the model runner returned no prompt scores for a batch that asked for them")
        scored = scoring.count > 0
        self._prompt_scored[rows[scored]] = (scoring.first_position + scoring.count)[scored]
        targets, logprobs = scoring.target.tolist(), scores.logprobs.tolist()
        ranks, top_ids, top_logprobs = scores.ranks.tolist(), scores.top_ids.tolist(), scores.top_logprobs.tolist()
        wanted = self._prompt_top_k[rows].tolist()
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
        pending = self._seq_len[rows] - self._num_computed[rows]
        reserved = self._num_blocks[rows] * self.block_size
        if bool((counts < 1).any() or (counts > pending).any()):
            raise ValueError("schedule asks for more tokens than a sequence has pending, or for none")
        if bool((self._num_computed[rows] + counts > reserved).any()):
            raise ValueError("schedule computes tokens beyond a sequence's reserved cache")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence appears twice in one step")

    def _sample_and_record(
        self, rows: torch.Tensor, logits: torch.Tensor, seq_ids: list[int]
    ) -> tuple[TokenOutput, ...]:
        if not seq_ids:
            return ()
        logits = logits.to("cpu") if logits.device.type != "cpu" else logits
        counter = self._seq_len[rows] - self._prompt_len[rows]  # index of the output token being sampled
        num_logprobs = int(self._logprobs[rows].max())
        min_p = self._min_p[rows]
        params = RowSampling(
            temperature=self._temperature[rows],
            top_p=self._top_p[rows],
            top_k=self._top_k[rows],
            seed=self._seed[rows],
            counter=counter,
            num_logprobs=max(num_logprobs, 0),
            want_logprobs=num_logprobs >= 0,
            min_p=min_p if bool((min_p > 0).any()) else None,
        )
        result = sample(logits, params, self._edits(rows, counter, logits.shape[-1]))
        tokens = result.tokens
        positions = self._seq_len[rows]
        self._token_buffer[rows, positions] = tokens
        self._seq_len[rows] += 1
        finish = self._finish_codes(rows, tokens)
        return self._package(seq_ids, self._logprobs[rows].tolist(), tokens, finish, result)

    def _edits(self, rows: torch.Tensor, counter: torch.Tensor, vocab: int) -> LogitsEdits:
        """The logits edits of this step's sampling rows; a feature no row uses is None (one comparison)."""
        biased = (self._num_bias[rows] > 0).nonzero()[:, 0]
        restricted = self._restricted[rows].nonzero()[:, 0]
        too_early = (counter < self._min_tokens[rows]).nonzero()[:, 0]  # min_tokens not reached yet
        repeating = (self._repetition[rows] != 1.0).nonzero()[:, 0]
        penalised = ((self._presence[rows] != 0) | (self._frequency[rows] != 0)).nonzero()[:, 0]
        bias = allowed = banned = repetition = penalties = None
        if len(biased):
            r = rows[biased]
            width = int(self._num_bias[r].max())
            bias = LogitBias(biased, self._bias_ids[r, :width], self._bias_values[r, :width])
        if len(restricted):
            allowed = AllowedTokens(restricted, self._allowed[rows[restricted]])
        if len(too_early):
            r = rows[too_early]
            eos = self.eos_token_ids[None, :].expand(len(r), -1).masked_fill(self._ignore_eos[r][:, None], -1)
            banned = BannedTokens(too_early, torch.cat([self._stop_ids[r], eos], dim=1))
        if len(repeating):
            r = rows[repeating]
            repetition = RepetitionPenalty(repeating, self._seen_tokens(r, vocab), self._repetition[r])
        if len(penalised):
            r = rows[penalised]
            penalties = OutputPenalties(penalised, self._output_counts(r, vocab), self._presence[r], self._frequency[r])
        return LogitsEdits(bias, allowed, banned, repetition, penalties)

    def _seen_tokens(self, rows: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab] bool: the token occurs in the row's prompt or output so far."""
        end = self._seq_len[rows]
        width = int(end.max())
        ids = self._token_buffer[rows, :width].masked_fill(torch.arange(width)[None, :] >= end[:, None], -1)
        return token_mask(ids, vocab)

    def _output_counts(self, rows: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab] how often each token appears in each row's output so far."""
        start, end = self._prompt_len[rows], self._seq_len[rows]
        width = int((end - start).max())
        counts = torch.zeros(len(rows), vocab)
        if width == 0:
            return counts
        pos = start[:, None] + torch.arange(width)[None, :]
        valid = pos < end[:, None]
        ids = self._token_buffer[rows[:, None], pos.clamp(max=self.max_model_len - 1)]
        return counts.scatter_add_(1, ids, valid.float())

    def _finish_codes(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        is_eos = torch.isin(tokens, self.eos_token_ids) & ~self._ignore_eos[rows]
        is_stop_id = (self._stop_ids[rows] == tokens[:, None]).any(dim=-1)
        generated = self._seq_len[rows] - self._prompt_len[rows]
        at_length = (generated >= self._max_tokens[rows]) | (self._seq_len[rows] >= self.max_model_len)
        codes = torch.full_like(tokens, _NOT_FINISHED)
        codes[at_length] = _LENGTH
        codes[is_eos | is_stop_id] = _STOPPED
        return codes

    @staticmethod
    def _package(
        seq_ids: list[int],
        wanted: list[int],
        tokens: torch.Tensor,
        finish: torch.Tensor,
        result: SampleResult,
    ) -> tuple[TokenOutput, ...]:
        """One TokenOutput per row, with only the logprobs that row asked for (-1: none)."""
        reasons = {_NOT_FINISHED: None, _STOPPED: FinishReason.STOP, _LENGTH: FinishReason.LENGTH}
        token_list, finish_list = tokens.tolist(), finish.tolist()
        chosen = result.logprobs.tolist() if result.logprobs is not None else [None] * len(seq_ids)
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(seq_ids)
        if result.top_ids is not None and result.top_logprobs is not None:
            tops = [
                tuple(zip(i, lp, strict=True))
                for i, lp in zip(result.top_ids.tolist(), result.top_logprobs.tolist(), strict=True)
            ]
        return tuple(
            TokenOutput(
                seq_id,
                token,
                logprob if want >= 0 else None,
                top[:want] if want >= 0 else None,
                reasons[code],
            )
            for seq_id, want, token, logprob, top, code in zip(
                seq_ids, wanted, token_list, chosen, tops, finish_list, strict=True
            )
        )
