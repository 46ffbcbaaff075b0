"""Shortest prompt first, with aging: a plug-in policy over continuous batching.

    batchserve serve --policy scheduler.examples.shortest_prompt_first:ShortestPromptFirst

Among the waiting requests, the one with the fewest prompt tokens still to compute joins first, so short
questions are not stuck behind long documents. Pure shortest-first starves long prompts under steady load; aging
fixes that: every second a request waits takes `AGING_TOKENS_PER_S` tokens off its effective length. Preempted
requests still come back first, as in continuous batching. Everything else (chunked prefill, the step budget,
preemption) is `ContinuousPolicy`'s.
"""

from __future__ import annotations

from scheduler.continuous import ContinuousPolicy
from scheduler.policy import PolicyContext
from scheduler.request import SequenceRequest

AGING_TOKENS_PER_S = 200.0  # a 1,000-token prompt overtakes fresh 10-token ones after about 5 s of waiting


class ShortestPromptFirst(ContinuousPolicy):
    def admission_order(self, ctx: PolicyContext, now: float) -> list[SequenceRequest]:
        def key(request: SequenceRequest) -> tuple[bool, float, float]:
            waited = now - request.arrival
            effective = ctx.pending_tokens(request) - AGING_TOKENS_PER_S * waited
            return (request.num_preemptions == 0, effective, request.arrival)

        return sorted(ctx.waiting, key=key)
