"""Each weight format on the real SmolLM2-135M-Instruct against transformers on the same weights.

int4 reads the GGUF's own Q4_1 blocks, so with float32 activations its projections are the very weights the float32
model holds (transformers dequantised the same blocks); the LM head is int8 per row. Float32 activations are held to
token-for-token parity with `generate()` on a model holding the same dequantised weights. bfloat16 rounds where
transformers' modules round differently, so there the engine's scores must stay within bf16 rounding of
transformers' on the same tokens (teacher-forced), and greedy picks must be transformers' top token or within that
rounding of it.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from api.runtime.offline import LLM
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel, load_model
from engine.weights.quantization import Int4Weight, Int8Weight
from tests.reference_models import dequantized_model, generate_exactly

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom by the sea, " * 6,
    "Q: What is 2+2?\nA:",
]
# nats. bf16 keeps 8 bits of mantissa and 30 layers add their roundings, in a different order than transformers'
# modules (fused q/k/v, one-pass RMSNorm): measured, single positions differ by up to ~0.17 and the mean over a
# prompt by 0.05-0.07.
BF16_LOGPROB_TOLERANCE = 0.3
BF16_MEAN_TOLERANCE = 0.08


@functools.cache
def _loaded(dtype: str, quantization: str) -> LoadedModel:
    return load_model(None, dtype=dtype, quantization=quantization)


@functools.cache
def _prompts() -> list[list[int]]:
    tokenizer = _loaded("float32", "int4").tokenizer
    return [list(tokenizer(text)["input_ids"]) for text in TEXTS]


def _engine(loaded: LoadedModel, prompts: list[list[int]], seats: int, prompt_logprobs: bool = False) -> list[Any]:
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0 if prompt_logprobs else None
    )
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=seats, max_num_batched_tokens=256) as llm:
        return llm.generate(prompts, params)


@functools.cache
def _batched(dtype: str, quantization: str) -> tuple[tuple[int, ...], ...]:
    """Every prompt's greedy tokens from one engine run with a seat each (shared by the parity and the alone
    checks: the same run either way)."""
    return tuple(tuple(out.token_ids) for out in _engine(_loaded(dtype, quantization), _prompts(), seats=len(TEXTS)))


def test_int4_from_the_gguf_is_the_files_own_blocks() -> None:
    loaded = _loaded("float32", "int4")
    projections = {name: w for name, w in loaded.quantized.items() if name != "lm_head"}
    assert len(projections) == 30 * 7 and all(isinstance(w, Int4Weight) for w in projections.values())
    assert isinstance(loaded.quantized["lm_head"], Int8Weight)  # int8 per row with float32 activations too
    assert isinstance(_loaded("bfloat16", "int4").quantized["lm_head"], Int8Weight)
    modules = dict(loaded.model.named_modules())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.17.self_attn.k_proj", "model.layers.29.mlp.up_proj"):
        assert torch.equal(projections[name].dequantize(), modules[name].weight)  # no second quantisation


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantised_float32_engine_matches_generate_on_the_same_weights(quantization: str) -> None:
    loaded = _loaded("float32", quantization)
    reference = dequantized_model(loaded)
    expected = [generate_exactly(reference, prompt, NEW_TOKENS) for prompt in _prompts()]
    assert [list(tokens) for tokens in _batched("float32", quantization)] == expected


def test_int4_batched_equals_alone() -> None:
    loaded = _loaded("float32", "int4")
    alone = [_engine(loaded, [prompt], seats=1)[0].token_ids for prompt in _prompts()]
    assert [list(tokens) for tokens in _batched("float32", "int4")] == alone


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_bfloat16_engine_stays_within_bf16_rounding_of_transformers(quantization: str) -> None:
    loaded = _loaded("bfloat16", quantization)
    reference = dequantized_model(loaded)
    outputs = _engine(loaded, _prompts(), seats=len(TEXTS), prompt_logprobs=True)
    differences = []
    for prompt, output in zip(_prompts(), outputs, strict=True):
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + output.token_ids])).logits[0].float().log_softmax(-1)
        scored = torch.tensor(output.prompt_logprobs.logprobs)
        expected = logits[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        differences.append((scored - expected).abs())
        assert differences[-1].max().item() < BF16_LOGPROB_TOLERANCE
        for step, token in enumerate(output.token_ids):
            row = logits[len(prompt) - 1 + step]
            assert row.max().item() - row[token].item() < BF16_LOGPROB_TOLERANCE
    assert torch.cat(differences).mean().item() < BF16_MEAN_TOLERANCE  # over every scored prompt position
