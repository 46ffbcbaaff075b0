"""The scheduler's half of speculative decoding: which rows of a planned step get drafts, how many, and the cache for
them. The engine verifies them (engine/speculative.py); docs/speculative.md has the design.

Now: every row whose step samples (greedy or sampled; the engine's acceptance keeps the distribution) gets the
configured number of n-gram drafts, in every mode, capped so that they never run past
`max_tokens` (so a sequence never reserves beyond its whole length, which the continuous policy's thrash guard
relies on) and within what the step's token budget leaves. A row whose cache cannot grow for its drafts gets none:
drafts never preempt anyone. Dynamic and static reserve a batch's whole length up front, so there the drafts
always fit.

A request with a prediction (Predicted Outputs) drafts from it instead of from its own tokens, with speculation
configured or not: then PREDICTION_DRAFT_TOKENS at a time (the configured count where there is one).
"""

from __future__ import annotations

import torch

from engine.ngram_drafter import propose_ngram
from engine.prediction_drafter import propose_from_prediction
from engine.speculative_config import SpeculativeConfig
from scheduler.config import SchedulerConfig
from scheduler.policy import PolicyContext, StepPlan
from scheduler.request import SequenceRequest

PREDICTION_DRAFT_TOKENS = 8  # drafts per step from a prediction where no --speculative-config sets the count


def propose_drafts(config: SchedulerConfig, ctx: PolicyContext, plan: StepPlan) -> dict[int, list[int]]:
    """Draft tokens by sequence id for this step's plan, their cache reserved; {} with nothing to draft from."""
    spec = config.speculative
    if spec is None and not any(request.prediction for request, _ in plan):
        return {}
    budget = config.max_num_batched_tokens - sum(count for _, count in plan)
    drafts: dict[int, list[int]] = {}
    for request, count in plan:
        if budget <= 0:
            break
        if count != ctx.pending_tokens(request) or not (spec or request.prediction):
            continue  # a prompt chunk that does not end the prompt samples nothing
        room = request.params.max_tokens - len(request.output_token_ids) - 1  # the last token needs no draft after it
        wanted = spec.num_speculative_tokens if spec is not None else PREDICTION_DRAFT_TOKENS
        k = min(wanted, room, budget)
        if k <= 0:
            continue
        proposal = _proposal(request, k, spec)
        if proposal and ctx.reserve(request, ctx.computed_tokens(request) + count + len(proposal)):
            drafts[request.seq_id] = proposal
            budget -= len(proposal)
    return drafts


def _proposal(request: SequenceRequest, k: int, spec: SpeculativeConfig | None) -> list[int]:
    if request.prediction:
        output = torch.tensor(request.output_token_ids, dtype=torch.long)
        prediction = torch.tensor(request.prediction, dtype=torch.long)
        proposal, request.prediction_offset = propose_from_prediction(prediction, output, k, request.prediction_offset)
        return proposal
    assert spec is not None
    n_min, n_max = spec.lookup
    tokens = torch.tensor([*request.prompt_token_ids, *request.output_token_ids], dtype=torch.long)
    return propose_ngram(tokens, k, n_min, n_max)
