"""Per-row sequence state: preallocated tensors indexed by engine row, and which sequence holds which row.

A sequence holds one row from `place` to `release` (the scheduler's seats take rows). Keeping every per-sequence
value in a [rows, ...] tensor makes building a step, sampling and the stop checks a handful of tensor ops over the rows
scheduled, whatever their number.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.sample.sampling_params import SamplingParams


class SequenceRows:
    """The state of the sequences in the engine, one row each; the engine reads and writes the tensors directly."""

    def __init__(self, config: EngineConfig, max_model_len: int, vocab_size: int) -> None:
        rows, max_blocks = config.max_rows, -(-max_model_len // config.block_size)
        self.max_model_len = max_model_len
        # [rows] unless noted.
        self.token_buffer = torch.zeros(rows, max_model_len, dtype=torch.long)  # [rows, max_model_len]
        # [rows, max blocks per sequence]: a mirror of engine.kv.block_manager's lists, the forward's block tables
        self.block_table = torch.zeros(rows, max_blocks, dtype=torch.long)
        self.num_computed = torch.zeros(rows, dtype=torch.long)
        self.seq_len = torch.zeros(rows, dtype=torch.long)
        self.prompt_len = torch.zeros(rows, dtype=torch.long)
        self.max_tokens = torch.zeros(rows, dtype=torch.long)
        self.temperature = torch.zeros(rows)
        self.top_p = torch.ones(rows)
        self.top_k = torch.zeros(rows, dtype=torch.long)
        self.seed = torch.zeros(rows, dtype=torch.long)
        self.presence = torch.zeros(rows)
        self.frequency = torch.zeros(rows)
        self.ignore_eos = torch.zeros(rows, dtype=torch.bool)
        self.logprobs = torch.full((rows,), -1, dtype=torch.long)
        self.stop_ids = torch.full((rows, config.max_stop_token_ids), -1, dtype=torch.long)  # [rows, max stops]
        # vLLM's sampling extensions. Each feature's rows are found with one comparison per step (sampling_step).
        self.min_tokens = torch.zeros(rows, dtype=torch.long)
        self.repetition = torch.ones(rows)
        self.min_p = torch.zeros(rows)
        self.num_bias = torch.zeros(rows, dtype=torch.long)
        self.bias_ids = torch.zeros(rows, config.max_logit_bias, dtype=torch.long)  # [rows, max bias], pad id 0
        self.bias_values = torch.zeros(rows, config.max_logit_bias)  # [rows, max bias], pad 0.0
        self.restricted = torch.zeros(rows, dtype=torch.bool)  # the row has allowed_token_ids
        self.allowed = torch.zeros(rows, vocab_size, dtype=torch.bool)  # [rows, vocab], read if restricted
        self.constrained = torch.zeros(rows, dtype=torch.bool)  # a grammar constrains it (engine/sample/grammar.py)
        # Prompt scoring: alternatives wanted (-1: off) and the first prompt position not delivered yet, which
        # survives preemption so that a recomputed prompt is not scored twice.
        self.prompt_top_k = torch.full((rows,), -1, dtype=torch.long)
        self.prompt_scored = torch.ones(rows, dtype=torch.long)

        self._free = list(range(rows - 1, -1, -1))  # popped from the end: low rows first
        self._row_of: dict[int, int] = {}
        self._featured: set[int] = set()  # sequences that are not plain greedy (SamplingParams.plain_greedy)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def all_plain_greedy(self) -> bool:
        """Every sequence held is plain greedy: a step's sampling is the argmax of its logits."""
        return not self._featured

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def row(self, seq_id: int) -> int:
        return self._row_of[seq_id]

    def rows(self, seq_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self._row_of[s] for s in seq_ids], dtype=torch.long)

    def place(self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Give the sequence a free row holding its prompt and sampling parameters; returns the row."""
        if seq_id in self._row_of:
            raise ValueError(f"sequence {seq_id} is already in the engine")
        if not self._free:
            raise RuntimeError("no free engine row; the scheduler admitted more sequences than the engine has rows")
        # Convert everything before taking a row, so a failure here leaves no half-registered sequence.
        prompt = torch.tensor(prompt_token_ids, dtype=torch.long)
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long)
        bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        bias_values = torch.tensor([v for _, v in params.logit_bias], dtype=torch.float32)
        allowed = None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids, dtype=torch.long)
        row = self._free.pop()
        self._row_of[seq_id] = row
        if not params.plain_greedy:
            self._featured.add(seq_id)
        n = len(prompt_token_ids)
        self.token_buffer[row, :n] = prompt
        self.num_computed[row] = 0
        self.seq_len[row] = n
        self.prompt_len[row] = n
        self.max_tokens[row] = params.max_tokens
        # Greedy rows store 0 so the sampler, comparing in float32, agrees with params.greedy at the boundary.
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.seed[row] = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.ignore_eos[row] = params.ignore_eos
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.stop_ids[row] = -1
        self.stop_ids[row, : len(stops)] = stops
        self._set_sampling_extensions(row, params, bias_ids, bias_values, allowed)
        self.prompt_top_k[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.prompt_scored[row] = 1
        return row

    def _set_sampling_extensions(
        self,
        row: int,
        params: SamplingParams,
        bias_ids: torch.Tensor,
        bias_values: torch.Tensor,
        allowed: torch.Tensor | None,
    ) -> None:
        self.min_tokens[row] = params.min_tokens
        self.repetition[row] = params.repetition_penalty
        self.min_p[row] = params.min_p
        self.num_bias[row] = len(bias_ids)
        self.bias_ids[row] = 0
        self.bias_values[row] = 0.0
        self.bias_ids[row, : len(bias_ids)] = bias_ids
        self.bias_values[row, : len(bias_values)] = bias_values
        self.restricted[row] = allowed is not None
        self.constrained[row] = params.grammar is not None
        if allowed is not None:
            self.allowed[row] = False
            self.allowed[row, allowed] = True

    def release(self, seq_id: int) -> int | None:
        """Free the sequence's row; returns it, or None for an unknown id."""
        row = self._row_of.pop(seq_id, None)
        self._featured.discard(seq_id)
        if row is not None:
            self._free.append(row)
        return row
