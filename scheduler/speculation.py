"""The scheduler's half of speculative decoding: which rows of a planned step get drafts, how many, and the cache for
them. The engine verifies them (engine/speculative.py); docs/speculative.md has the design.

Now: every row whose step samples (greedy or sampled; the engine's acceptance keeps the distribution) gets the
configured number of n-gram drafts, in every mode, capped so that they never run past
`max_tokens` (so a sequence never reserves beyond its whole length, which the continuous policy's thrash guard
relies on) and within what the step's token budget leaves. A row whose cache cannot grow for its drafts gets none:
drafts never preempt anyone. Dynamic and static reserve a batch's whole length up front, so there the drafts
always fit.
"""

from __future__ import annotations

import torch

from engine.ngram_drafter import propose_ngram
from scheduler.config import SchedulerConfig
from scheduler.policy import PolicyContext, StepPlan


def propose_drafts(config: SchedulerConfig, ctx: PolicyContext, plan: StepPlan) -> dict[int, list[int]]:
    """Draft tokens by sequence id for this step's plan, their cache reserved; {} with speculation off."""
    spec = config.speculative
    if spec is None:
        return {}
    n_min, n_max = spec.lookup
    budget = config.max_num_batched_tokens - sum(count for _, count in plan)
    drafts: dict[int, list[int]] = {}
    for request, count in plan:
        if budget <= 0:
            break
        if count != ctx.pending_tokens(request):
            continue  # a prompt chunk that does not end the prompt samples nothing
        room = request.params.max_tokens - len(request.output_token_ids) - 1  # the last token needs no draft after it
        k = min(spec.num_speculative_tokens, room, budget)
        if k <= 0:
            continue
        tokens = torch.tensor([*request.prompt_token_ids, *request.output_token_ids], dtype=torch.long)
        proposal = propose_ngram(tokens, k, n_min, n_max)
        if proposal and ctx.reserve(request, ctx.computed_tokens(request) + count + len(proposal)):
            drafts[request.seq_id] = proposal
            budget -= len(proposal)
    return drafts
