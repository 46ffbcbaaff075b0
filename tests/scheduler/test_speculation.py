"""Speculation through the real scheduler and engine (scheduler/speculation.py): in every mode greedy output with
n-gram drafts is identical to output without, with prefix caching, and under preemption in continuous mode; seeded
sampled requests (temperature, top-p, top-k, penalties) get drafts too and keep their output token for token (the
acceptance draws each position's token with the same (seed, output index) as a plain step); the step stats count
drafts and acceptances, and each sequence its judged first and later drafts; a verify step's tokens reach the
consumer flagged as one step's; the cache is all returned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from transformers import PreTrainedModel

from engine.config import EngineConfig
from engine.engine import Engine, StepOutput
from engine.model.model_runner import TransformersRunner
from engine.sample.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from scheduler.config import Mode, SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import SequenceRequest, TokenEvent
from scheduler.stats import StepStats
from tests.engine.helpers import random_prompt
from tests.fakes import FakeClock, Stream, step_until_done

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def serve(
    model: PreTrainedModel,
    prompts: list[list[int]],
    params: list[SamplingParams],
    spec: SpeculativeConfig | None,
    kv_cache_tokens: int,
    mode: Mode = Mode.CONTINUOUS,
    predictions: list[list[int]] | None = None,
    step_cost: tuple[float, float] | None = None,
) -> tuple[list[list[int]], list[StepStats], list[SequenceRequest]]:
    """`step_cost`: (seconds a step, seconds a token) the fake clock moves during each engine step, which the
    draft-length rule measures; None: steps take no time, so the rule never has costs and drafts every k."""
    engine = Engine(
        TransformersRunner(model), EngineConfig(max_rows=len(prompts), kv_cache_tokens=kv_cache_tokens, block_size=4)
    )
    config = SchedulerConfig(
        mode=mode, max_num_seqs=len(prompts), max_batch_size=len(prompts), max_num_batched_tokens=24, speculative=spec
    )
    steps: list[StepStats] = []
    clock = FakeClock()
    if step_cost is not None:
        plain_step = engine.step

        def timed_step(
            schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None
        ) -> StepOutput:
            output = plain_step(schedule, drafts)
            clock.advance(step_cost[0] + step_cost[1] * output.num_tokens)
            return output

        engine.step = timed_step  # type: ignore[method-assign]
    scheduler = Scheduler(engine, config, clock=clock, on_step=steps.append)
    streams = [Stream(str(i), p, q.max_tokens) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    predicted = predictions or [[] for _ in prompts]
    requests = [
        SequenceRequest(s.request_id, s.prompt, q, s, prediction=tuple(guess))
        for s, q, guess in zip(streams, params, predicted, strict=True)
    ]
    for request in requests:
        scheduler.submit(request)
    step_until_done(scheduler, clock, streams, max_steps=2000)
    assert all(s.finish is not None for s in streams)
    assert engine.cache_usage == 0 and engine.num_free_rows == len(prompts)
    assert (sum(r.num_preemptions for r in requests) > 0) == (kv_cache_tokens < 100 and mode is Mode.CONTINUOUS)
    return [s.tokens for s in streams], steps, requests


@pytest.mark.parametrize(
    ("mode", "kv_cache_tokens"),
    [(Mode.CONTINUOUS, 1024), (Mode.CONTINUOUS, 96), (Mode.DYNAMIC, 1024), (Mode.STATIC, 1024)],
)  # 96: the sequences cannot all fit, some are preempted
def test_output_is_unchanged_by_ngram_drafts_in_every_mode(
    tiny_llama: PreTrainedModel, mode: Mode, kv_cache_tokens: int
) -> None:
    vocab = tiny_llama.config.vocab_size
    prompts = [
        random_prompt(5, 1, vocab) * 4,
        random_prompt(13, 2, vocab),
        random_prompt(5, 1, vocab) * 3,  # shares a prefix with the first: prefix cache hits
        random_prompt(4, 3, vocab) * 3,
        random_prompt(9, 4, vocab),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (20, 17, 22, 9, 14)]
    params[3] = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, presence_penalty=0.5, seed=3, max_tokens=9)
    params[4] = SamplingParams(temperature=0.8, seed=7, max_tokens=14)  # sampled: drafts, same seeded output
    plain, plain_steps, _ = serve(tiny_llama, prompts, params, None, kv_cache_tokens, mode)
    spec, spec_steps, _ = serve(tiny_llama, prompts, params, SPEC, kv_cache_tokens, mode)
    assert spec == plain
    drafted = sum(s.num_draft_tokens for s in spec_steps)
    accepted = sum(s.num_accepted_tokens for s in spec_steps)
    assert 0 < accepted <= drafted
    assert sum(sum(s.accepted_per_pos) for s in spec_steps) == accepted  # acceptance is a prefix, counted by position
    assert all(list(s.accepted_per_pos) == sorted(s.accepted_per_pos, reverse=True) for s in spec_steps)
    assert all(s.num_drafts <= s.num_seqs and (s.num_drafts > 0) == (s.num_draft_tokens > 0) for s in spec_steps)
    assert sum(s.num_draft_tokens for s in plain_steps) == 0
    assert sum(s.num_generated for s in spec_steps) == sum(len(t) for t in plain)
    if kv_cache_tokens == 1024:
        assert len(spec_steps) < len(plain_steps)  # accepted drafts save steps
    # Drafts stay within the step's token budget (dynamic and static prefill whole prompts beyond it, without drafts)
    assert all(s.num_tokens <= 24 for s in spec_steps if s.num_draft_tokens)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("spec", [None, SPEC], ids=["prediction-only", "with-ngram"])
def test_a_prediction_drafts_without_changing_the_output(
    tiny_llama: PreTrainedModel, mode: Mode, spec: SpeculativeConfig | None
) -> None:
    """Predicted Outputs: a right prediction is accepted whole, one that leaves the answer and one that never
    matches cost only rejected drafts; every output is the one without a prediction (greedy and seeded), and without
    --speculative-config the requests with no prediction get no drafts."""
    vocab = tiny_llama.config.vocab_size
    prompts = [random_prompt(n, 10 + n, vocab) for n in (6, 11, 8, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 20, 16, 12)]
    params[3] = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12)
    plain, plain_steps, _ = serve(tiny_llama, prompts, params, None, 1024, mode)
    predictions = [
        plain[0],  # right
        [*plain[1][:6], vocab - 1, vocab - 2, *plain[1][6:]],  # right, then an insertion the answer lacks
        [vocab - 3] * 10,  # wrong throughout
        plain[3],  # right for the seeded sampled request
    ]
    output, steps, requests = serve(tiny_llama, prompts, params, spec, 1024, mode, predictions)
    assert output == plain
    right, edited = requests[0], requests[1]
    assert right.num_accepted_tokens == right.num_draft_tokens > 0
    assert 0 < edited.num_accepted_tokens < edited.num_draft_tokens
    assert requests[2].num_accepted_tokens == 0
    assert requests[3].num_accepted_tokens == requests[3].num_draft_tokens > 0
    assert len(steps) < len(plain_steps)  # accepted drafts save steps
    # The draft-length rule's counts, from each verify step's accepted length: every judged draft of a right
    # prediction was right; a wrong one's first drafts (if it drafted) were all wrong and no later draft was judged
    for request in requests:
        counts = request.acceptance
        assert counts.first_right + counts.later_right == request.num_accepted_tokens
        assert counts.first_judged + counts.later_judged <= request.num_draft_tokens
    # A step's tokens are flagged as such: all but a request's last token of the step say `more` follow, so each
    # verify step closes one run, and a request's runs are its tokens less its accepted drafts.
    for request in requests:
        tokens = [event for event in request.sink.events if isinstance(event, TokenEvent)]  # type: ignore[attr-defined]
        assert not tokens[-1].more
        assert sum(not event.more for event in tokens) == len(tokens) - request.num_accepted_tokens
    assert any(event.more for event in right.sink.events if isinstance(event, TokenEvent))  # type: ignore[attr-defined]
    for request in (right, requests[3]):
        counts = request.acceptance
        assert counts.first_right == counts.first_judged > 0 and counts.later_right == counts.later_judged > 0
    wrong = requests[2].acceptance
    assert (wrong.first_right, wrong.later_judged) == (0, 0)
    assert edited.acceptance.later_right < edited.acceptance.later_judged or (
        edited.acceptance.first_right < edited.acceptance.first_judged
    )


@pytest.mark.parametrize(
    ("step_cost", "draft_length", "drafts_later"),
    [
        ((0.010, 0.00001), "auto", True),  # weight-bound: drafts are nearly free, the rule keeps them
        ((0.0, 0.001), "auto", False),  # every token costs its share: the rule stops drafting (probes aside)
        ((0.0, 0.001), "fixed", True),  # fixed: k every step, whatever it costs
    ],
)
def test_the_rule_drafts_where_the_measured_step_cost_pays_for_it(
    tiny_llama: PreTrainedModel, step_cost: tuple[float, float], draft_length: str, drafts_later: bool
) -> None:
    vocab = tiny_llama.config.vocab_size
    prompts = [random_prompt(4, 20 + i, vocab) * 4 for i in range(4)]  # repeating: n-gram drafts exist
    params = [SamplingParams(temperature=0.0, max_tokens=40) for _ in prompts]
    spec = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, draft_length=draft_length
    )
    plain, _, _ = serve(tiny_llama, prompts, params, None, 1024, Mode.CONTINUOUS, step_cost=step_cost)
    output, steps, _ = serve(tiny_llama, prompts, params, spec, 1024, Mode.CONTINUOUS, step_cost=step_cost)
    assert output == plain
    later = [s for s in steps[6:] if s.num_prompt_tokens == 0]  # decode steps once costs are measured
    drafted = [s.num_draft_tokens for s in later]
    if drafts_later:
        assert sum(drafted) > 0 and sum(d > 0 for d in drafted) > len(later) // 2
    else:
        assert sum(d > 0 for d in drafted) <= len(later) // 32 + 1  # only the probe steps


def test_speculative_config_is_checked() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_json('{"method": "ngram"}')
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}')
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "method": "eagle"}')
    with pytest.raises(ValueError, match="unknown key 'k'"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "k": 1}')
    with pytest.raises(ValueError, match="JSON object"):
        SpeculativeConfig.from_json("[3]")
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_max": 4}').lookup == (4, 4)
    assert SpeculativeConfig(num_speculative_tokens=2).lookup == (5, 5)
    assert SchedulerConfig(mode=Mode.STATIC, speculative=SPEC).speculative == SPEC  # every mode takes it
