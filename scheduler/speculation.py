"""The scheduler's half of speculative decoding: which rows of a planned step get drafts, how many, and the cache for
them. The engine verifies them (engine/spec/verify.py); docs/speculative.md has the design.

Every row whose step samples (greedy or sampled; the engine's acceptance keeps the distribution) may get drafts, in
every mode: up to the configured k, capped so that they never run past `max_tokens` (so a sequence never reserves
beyond its whole length, which the continuous policy's thrash guard relies on) and within what the step's token
budget leaves; how many of them each row verifies is the draft-length rule's choice (scheduler/draft_length.py),
or all of them with `draft_length: fixed`. A row whose cache cannot grow for its drafts gets none: drafts never
preempt anyone. Dynamic and static reserve a batch's whole length up front, so there the drafts always fit.

A request with a prediction (Predicted Outputs) drafts from it instead of from its own tokens, with speculation
configured or not: then up to PREDICTION_DRAFT_TOKENS at a time (the configured count where there is one).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.spec.config import SpeculativeConfig
from engine.spec.ngram_drafter import NgramIndex
from engine.spec.prediction_drafter import propose_from_prediction
from scheduler.config import SchedulerConfig
from scheduler.draft_length import DraftLengthRule, acceptance_rates
from scheduler.policy import PolicyContext, StepPlan
from scheduler.request import SequenceRequest

PREDICTION_DRAFT_TOKENS = 8  # drafts per step from a prediction where no --speculative-config sets the count

# Up to k draft tokens for a request (its prediction, else n-gram lookup per the config); [] when it has none. The
# simulator passes its own (benchmarks/sim/engine.py): its tokens carry no text to look up.
Drafter = Callable[[SequenceRequest, int, SpeculativeConfig | None], list[int]]


def propose_drafts(
    config: SchedulerConfig,
    ctx: PolicyContext,
    plan: StepPlan,
    rule: DraftLengthRule | None = None,
    drafter: Drafter | None = None,
) -> dict[int, list[int]]:
    """Draft tokens by sequence id for this step's plan, their cache reserved; {} with nothing to draft from.
    `rule`: each row's length from the live batch (scheduler/draft_length.py); None, or `draft_length: fixed`,
    drafts the configured count. `drafter`: where drafts come from (default `draft_from_tokens`)."""
    spec = config.speculative
    if spec is None and not any(request.prediction for request, _ in plan):
        return {}
    step_tokens = sum(count for _, count in plan)
    budget = config.max_num_batched_tokens - step_tokens
    wanted = spec.num_speculative_tokens if spec is not None else PREDICTION_DRAFT_TOKENS
    sampling = [request for request, count in plan if count == ctx.pending_tokens(request)]
    rows: list[tuple[SequenceRequest, list[int]]] = []
    for request in sampling:  # a prompt chunk that does not end the prompt samples nothing: no drafts
        room = request.params.max_tokens - len(request.output_token_ids) - 1  # the last token needs no draft after it
        k = min(wanted, room, budget)
        if k > 0 and (spec is not None or request.prediction):
            proposal = (drafter or draft_from_tokens)(request, k, spec)
            if proposal:
                rows.append((request, proposal))
    if rule is not None and rows and (spec is None or spec.draft_length == "auto"):
        first, later = acceptance_rates([request.acceptance for request, _ in rows], rule.pooled.prior())
        caps = np.array([len(proposal) for _, proposal in rows])
        lengths = rule.choose(first, later, caps, len(plan), step_tokens, len(sampling)).tolist()
        rows = [(request, proposal[:length]) for (request, proposal), length in zip(rows, lengths, strict=True)]
    drafts: dict[int, list[int]] = {}
    for request, proposal in rows:
        proposal = proposal[: max(budget, 0)]
        if proposal and ctx.reserve(
            request, ctx.computed_tokens(request) + ctx.pending_tokens(request) + len(proposal)
        ):
            drafts[request.seq_id] = proposal
            budget -= len(proposal)
    return drafts


def draft_from_tokens(request: SequenceRequest, k: int, spec: SpeculativeConfig | None) -> list[int]:
    """The request's prediction read forward, else n-gram lookup over its prompt and output so far."""
    if request.prediction:
        output = torch.tensor(request.output_token_ids, dtype=torch.long)
        prediction = torch.tensor(request.prediction, dtype=torch.long)
        proposal, request.prediction_offset = propose_from_prediction(prediction, output, k, request.prediction_offset)
        return proposal
    assert spec is not None
    index = request.ngram_index
    if index is None:
        index = request.ngram_index = NgramIndex(*spec.lookup)
        index.extend(request.prompt_token_ids)
    index.extend(request.output_token_ids[len(index.tokens) - len(request.prompt_token_ids) :])
    return index.propose(k)
