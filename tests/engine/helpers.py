"""What several engine test modules share: a tiny engine and a minimal scheduler that drives it to the end, the
Hugging Face references, the speculative runner and its oracle drafts, and a grammar that allows a fixed token set."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.linear import Int4DotLinear
from engine.model.model_runner import TransformersRunner
from engine.outputs import FinishReason, StepOutput, TokenOutput
from engine.platform import native
from engine.sample.grammar import BITS_PER_WORD
from engine.sample.sampling_params import SamplingParams
from engine.spec.ngram_drafter import NgramIndex
from engine.weights.quantization import Int4Weight

ARCHS = ("llama", "qwen2", "mistral")
GREEDY: dict[str, Any] = dict(temperature=0.0)


def make_engine(
    model: PreTrainedModel, eos_token_ids: Sequence[int] = (), cpu_kernels: bool = True, **config: object
) -> Engine:
    """`cpu_kernels=False` runs the plain torch path (F.linear, gathered attention), as on a GPU."""
    settings: dict = dict(max_rows=8, kv_cache_tokens=1024, block_size=4)
    settings.update(config)
    runner = TransformersRunner(model, prepack_weights=cpu_kernels, native_attention=cpu_kernels)
    return Engine(runner, EngineConfig(**settings), eos_token_ids=eos_token_ids)


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The n-gram drafts for a sequence seen once: a fresh `NgramIndex` over all of it."""
    index = NgramIndex(n_min, n_max)
    index.extend(tokens)
    return index.propose(k)


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(  # type: ignore[operator]  # transformers types `generate` loosely
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


@torch.inference_mode()
def hf_log_softmax(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] next-token log-probabilities from the HF model's own full forward."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def stored_output(engine: Engine, seq_id: int) -> list[int]:
    """The output tokens the engine holds in the sequence's row (what a recompute after preemption would use)."""
    rows = engine.rows
    row = rows.row(seq_id)
    return rows.token_buffer[row, int(rows.prompt_len[row]) : int(rows.seq_len[row])].tolist()


@dataclass
class Driver:
    """A minimal scheduler for tests: a per-step token budget, decode tokens first, then prompt chunks.

    Cache is reserved incrementally (just enough for what each step computes), so block boundaries are
    crossed step by step; finished sequences are checked against the tokens stored in their rows and removed.
    """

    engine: Engine
    token_budget: int = 16
    max_chunk: int = 7
    outputs: dict[int, list[TokenOutput]] = field(default_factory=dict)
    finished: dict[int, FinishReason | None] = field(default_factory=dict)  # None: removed by the test
    paused: set[int] = field(default_factory=set)
    steps: list[list[tuple[int, int]]] = field(default_factory=list)
    mixed_steps: int = 0  # steps that computed decode tokens and a prompt chunk together

    @property
    def running(self) -> list[int]:
        return [s for s in self.outputs if s not in self.finished and s not in self.paused]

    def add(self, seq_id: int, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add(seq_id, prompt, params)
        self.outputs[seq_id] = []

    def preempt(self, seq_id: int) -> None:
        self.engine.release_cache(seq_id)
        self.paused.add(seq_id)

    def resume(self, seq_id: int) -> None:
        self.paused.discard(seq_id)

    def tokens(self, seq_id: int) -> list[int]:
        return [t.token_id for t in self.outputs[seq_id]]

    def schedule(self) -> list[tuple[int, int]]:
        engine, budget = self.engine, self.token_budget
        decode = [s for s in self.running if engine.num_pending(s) == 1]
        prefill = [s for s in self.running if engine.num_pending(s) > 1]
        schedule = [(s, 1) for s in decode[:budget]]
        budget -= len(schedule)
        for s in prefill:
            if budget <= 0:
                break
            n = min(engine.num_pending(s), self.max_chunk, budget)
            schedule.append((s, n))
            budget -= n
        for s, n in schedule:
            assert engine.reserve(s, engine.num_computed(s) + n), "test cache too small"
        return schedule

    def step(self) -> StepOutput:
        schedule = self.schedule()
        assert schedule, "nothing to run"
        if any(n == 1 for _, n in schedule) and any(n > 1 for _, n in schedule):
            self.mixed_steps += 1
        self.steps.append(schedule)
        out = self.engine.step(schedule)
        sampled = [t.seq_id for t in out.tokens]
        assert len(sampled) == len(set(sampled)), "a sequence got two tokens in one step"
        for token in out.tokens:
            assert token.seq_id not in self.finished
            self.outputs[token.seq_id].append(token)
            if token.finish_reason is not None:
                self.finished[token.seq_id] = token.finish_reason
                assert stored_output(self.engine, token.seq_id) == self.tokens(token.seq_id)
                self.engine.remove(token.seq_id)
        return out

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.running:
                return
            self.step()
        raise AssertionError("sequences did not finish")


def run_alone(model: PreTrainedModel, prompt: list[int], params: SamplingParams, **engine_kw) -> list[TokenOutput]:
    driver = Driver(make_engine(model, **engine_kw))
    driver.add(0, prompt, params)
    driver.run()
    return driver.outputs[0]


Drafter = Callable[[int, list[int]], list[int]]  # (seq id, its tokens so far) -> drafts


def run(
    engine: Engine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    drafter: Drafter | None = None,
    chunk: int = 6,
) -> tuple[dict[int, list[int]], dict[int, FinishReason | None], list[tuple[int, int]]]:
    """Run every sequence to its end, prompts in chunks of `chunk`; returns outputs, finish reasons and each step's
    (draft tokens, accepted tokens)."""
    for seq_id, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add(seq_id, prompt, p)
    outputs: dict[int, list[int]] = {s: [] for s in range(len(prompts))}
    finished: dict[int, FinishReason | None] = {}
    stats: list[tuple[int, int]] = []
    while len(finished) < len(prompts):
        schedule, drafts = [], {}
        for seq_id in outputs:
            if seq_id in finished:
                continue
            count = min(engine.num_pending(seq_id), chunk)
            extra: list[int] = []
            if drafter is not None and count == engine.num_pending(seq_id):
                extra = drafter(seq_id, prompts[seq_id] + outputs[seq_id])
            assert engine.reserve(seq_id, engine.num_computed(seq_id) + count + len(extra))
            schedule.append((seq_id, count))
            if extra:
                drafts[seq_id] = extra
        out = engine.step(schedule, drafts)
        stats.append((out.drafts.num_draft_tokens, out.drafts.num_accepted_tokens))
        for token in out.tokens:
            assert token.seq_id not in finished
            outputs[token.seq_id].append(token.token_id)
            if token.finish_reason is not None:
                finished[token.seq_id] = token.finish_reason
    for seq_id in outputs:
        engine.remove(seq_id)
    assert engine.blocks.pool.num_used == 0, "a KV block leaked"
    return outputs, finished, stats


def oracle(
    reference: dict[int, list[int]], prompts: Sequence[list[int]], k: int, wrong_at: int | None = None
) -> Drafter:
    """Drafts read from the reference output (right ones), optionally with the draft at `wrong_at` changed."""

    def draft(seq_id: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(prompts[seq_id])
        proposal = list(reference[seq_id][done : done + k])
        if wrong_at is not None and wrong_at < len(proposal):
            proposal[wrong_at] = (proposal[wrong_at] + 1) % 160
        return proposal

    return draft


@dataclass
class SetMatcher:
    """Allows `allowed` at every step; after `length` tokens allows only `end`, whose acceptance terminates it."""

    allowed: frozenset[int]
    length: int | None = None
    end: int = -1
    accepted: list[int] = field(default_factory=list)

    def _now(self) -> frozenset[int]:
        return frozenset({self.end}) if self.length is not None and len(self.accepted) >= self.length else self.allowed

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        words = [0] * bitmask.shape[1]
        for token in self._now():
            words[token // BITS_PER_WORD] |= 1 << (token % BITS_PER_WORD)
        # int32 words: bit 31 set is a negative number
        bitmask[index] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._now():
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.end and self.length is not None


@dataclass(frozen=True)
class SetGrammar:
    allowed: frozenset[int]
    length: int | None = None
    end: int = -1
    made: list[SetMatcher] = field(default_factory=list, compare=False)

    def matcher(self) -> SetMatcher:
        made = SetMatcher(self.allowed, self.length, self.end)
        self.made.append(made)
        return made


def int4_dot_kernels(kernels: native.Kernels) -> native.Kernels:
    """The build, or a skip where it has no integer-dot kernels (int4_dot, and int4_gemm on its layout)."""
    if not kernels.has_int4_dot:
        pytest.skip(f"the {kernels.build.name} build has no integer dot product kernels (AVX2, or AVX-512 with VNNI)")
    return kernels


def count_int4_gemm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every `Int4DotLinear.gemm` call from now on (a skip where no build here has integer-dot kernels):
    which steps ran the one-digit GEMM."""
    loaded = native.load_kernels()
    if loaded is None or not loaded.has_int4_dot:
        pytest.skip("no build with integer dot products here")
    calls: list[int] = []
    gemm = Int4DotLinear.gemm

    def counted(self: Int4DotLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append(int(x.shape[0]))
        return gemm(self, x)

    monkeypatch.setattr(Int4DotLinear, "gemm", counted)
    return calls


def random_int4(n: int, k: int, seed: int = 0, group: int = 32) -> Int4Weight:
    """Random int4 codes with small positive scales and zeros around 0, seeded."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zeros = (torch.rand(n, k // group, generator=gen) - 0.5) * 0.1
    return Int4Weight(values, scales, zeros, group)
