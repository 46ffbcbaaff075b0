"""The CUDA path: the same engine and both policies on an NVIDIA GPU, held to the CPU's parity bar.

Skipped where torch sees no GPU (CI has none); run on a GPU machine with `python -m pytest -q -m cuda`.
On the GPU the runner takes its plain torch path (F.linear, gathered attention): the compiled kernels are
CPU-only. Float32 matmuls keep TF32 off (torch's default), so greedy decoding must match `generate()` on the
same device token for token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from api.runtime.offline import LLM
from engine.sample.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from scheduler.request import Outcome
from tests.conftest import TINY_VOCAB_SIZE, train_byte_level_tokenizer
from tests.engine.helpers import ARCHS, GREEDY, Driver, make_engine, random_prompt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU that torch can see"),
]


def on_cuda(model: PreTrainedModel) -> PreTrainedModel:
    # transformers wraps `to` in functools.wraps, which mypy takes for an unbound callable: "cuda" is no `self`
    return copy.deepcopy(model).to("cuda")  # type: ignore[arg-type]


def cuda_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(  # type: ignore[operator]  # transformers types `generate` loosely
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_on_cuda_matches_generate_alone(
    arch: str, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = on_cuda(tiny_model_builder(arch))
    engine = make_engine(model, max_rows=6, cpu_kernels=False, device="cuda")
    assert engine.cache.data.device.type == "cuda"
    driver = Driver(engine, token_budget=16, max_chunk=7)
    plan = [(1, 20), (7, 15), (60, 12), (13, 25), (33, 10), (4, 18)]
    prompts = [random_prompt(n, seed=300 + i, vocab_size=model.config.vocab_size) for i, (n, _) in enumerate(plan)]
    for i, (_, max_tokens) in enumerate(plan):
        driver.add(i, prompts[i], SamplingParams(max_tokens=max_tokens, **GREEDY))
    driver.run()
    assert driver.mixed_steps > 0  # prefill chunks ran beside decodes
    for i, (_, max_tokens) in enumerate(plan):
        assert driver.tokens(i) == cuda_greedy(model, prompts[i], max_tokens), f"sequence {i} diverged on CUDA"
    assert engine.blocks.pool.num_free == engine.config.num_blocks
    assert engine.cache_usage == 0.0


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_llama: PreTrainedModel) -> Path:
    """The tiny Llama as a checkpoint folder, loaded through `--model` like any other (the API test fixtures'
    checkpoint needs the openai client, which a GPU machine may lack)."""
    directory = tmp_path_factory.mktemp("cuda-checkpoint")
    tiny_llama.save_pretrained(directory)
    tokenizer = train_byte_level_tokenizer(["the quick brown fox jumps over the lazy dog"], TINY_VOCAB_SIZE, "</s>")
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_both_policies_serve_on_cuda_with_generate_answers(mode: str, llama_checkpoint: Path) -> None:
    prompts = [random_prompt(n, seed=400 + n, vocab_size=150) for n in (3, 17, 40, 9, 25)]
    lengths = (4, 30, 12, 20, 7)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in lengths]
    with LLM(model=str(llama_checkpoint), mode=mode, device="cuda", max_num_seqs=4, max_batch_size=4) as llm:
        outputs = llm.generate(prompts, params)
        model = llm.loaded.model
    assert next(model.parameters()).device.type == "cuda"
    assert all(o.finish_reason is Outcome.LENGTH for o in outputs)
    for prompt, length, output in zip(prompts, lengths, outputs, strict=True):
        assert output.token_ids == cuda_greedy(model, prompt, length)


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_ngram_speculation_on_cuda_gives_the_generate_answers(mode: str, llama_checkpoint: Path) -> None:
    """Drafts verified in the step's one forward on the GPU (positions, KV rollback, acceptance on device tensors):
    greedy output is still `generate()`'s, and drafts were accepted (the prompts repeat, so n-gram drafts exist)."""
    prompts = [random_prompt(n, seed=500 + n, vocab_size=150) * 3 for n in (4, 9, 6)]
    lengths = (24, 16, 30)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in lengths]
    spec = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
        '"draft_length": "fixed"}'
    )
    with LLM(
        model=str(llama_checkpoint), mode=mode, device="cuda", max_num_seqs=4, max_batch_size=4, speculative=spec
    ) as llm:
        outputs = llm.generate(prompts, params)
        model = llm.loaded.model
    assert sum(o.timings.num_accepted_tokens for o in outputs) > 0, "no draft was accepted on CUDA"
    for prompt, length, output in zip(prompts, lengths, outputs, strict=True):
        assert output.token_ids == cuda_greedy(model, prompt, length)
