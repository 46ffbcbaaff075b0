"""A Q4_K_M GGUF end to end (tests/tiny_gguf.py writes a tiny one): its Q4_K projections load as int4 from the file's
own blocks, its other types are requantised to int4, its Q6_K LM head loads as the file holds it, `auto` offers the
int4 candidates, and the engine on the int4 weights answers as on the same file dequantised to float32."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from api.runtime.format_probe import load_auto
from api.runtime.format_rule import candidates
from api.runtime.offline import LLM
from engine.model.linear import Int4DotLinear, Int6DotLinear, Linear
from engine.sample.sampling_params import SamplingParams
from engine.weights.kquants import decode_q4_k
from engine.weights.loader import LoadedModel, load_model
from engine.weights.quantization import Int4Weight, Int6Weight, gguf_projection_types, int4_from_dense, open_gguf
from engine.weights.weight_format import WeightFormat
from tests.reference_models import dequantized_model, generate_exactly
from tests.tiny_gguf import quantize_q4_k, quantize_q6_k, write_tiny_q4_k_m_gguf

PROMPTS = [[5, 9, 12, 40, 7], [100, 3, 3, 8], [17, 250, 61, 2, 90, 11, 4]]
NEW_TOKENS = 12
# Q6_K in the tiny file, as in llama.cpp's Q4_K_M: requantised to int4, not read from blocks.
REQUANTISED = ("model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_q4_k_m_gguf(tmp_path_factory.mktemp("q4-k-m") / "tiny.Q4_K_M.gguf")


def test_the_tiny_file_is_a_q4_k_m_mix(q4_k_m: Path) -> None:
    types = gguf_projection_types(open_gguf(q4_k_m))
    assert {name for name, kind in types.items() if kind != "Q4_K"} == {*REQUANTISED, "lm_head"}
    assert types["model.layers.0.self_attn.q_proj"] == "Q4_K"


def test_q4_k_projections_load_as_int4_bit_for_bit_and_the_rest_requantised(q4_k_m: Path) -> None:
    loaded = load_model(q4_k_m, dtype="float32", quantization="auto")
    assert loaded.weight_format == WeightFormat(torch.float32, "int4")
    dense = {name: module.weight.data for name, module in loaded.model.named_modules() if name in loaded.quantized}
    assert len(loaded.quantized) == 2 * 7 + 1  # every projection, and the LM head (the file's Q6_K)
    head = loaded.quantized["lm_head"]
    assert isinstance(head, Int6Weight) and torch.equal(head.dequantize(), dense["lm_head"])
    for name, weight in loaded.quantized.items():
        if name == "lm_head":
            continue
        assert isinstance(weight, Int4Weight) and weight.group_size == 32
        if name in REQUANTISED:  # a second quantisation of the file's Q6_K values
            assert torch.equal(weight.values, int4_from_dense(dense[name]).values)
            assert not torch.equal(weight.dequantize(), dense[name])
        else:  # transformers' dequantisation of the Q4_K blocks (the dense model), bit for bit in float32
            assert torch.equal(weight.dequantize(), dense[name]), name


def test_bfloat16_scales_round_q4_k_groups_by_under_4_percent_of_a_step() -> None:
    """With bf16 activations the int4 kernels read each group's scale and zero in bf16: d*sc and 8*d*sc - dmin*m
    round. On Gaussian weights the worst weight moves by 3.6 % of its group's step (0.30 % of the largest weight),
    as Q4_1's d and m + 8d do (3.8 %); in float32 the groups are gguf's dequantisation bit for bit."""
    weights = (np.random.default_rng(0).standard_normal((256, 2048)) * 0.02).astype(np.float32)
    blocks = quantize_q4_k(weights)
    reference = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(256, 2048))
    decoded = decode_q4_k(blocks, rows=256)
    assert torch.equal(decoded.dequantize(torch.float32), reference)
    step = decoded.scales.repeat_interleave(32, dim=1)
    error = (decoded.dequantize(torch.bfloat16) - reference).abs()
    assert 0 < (error / step).max().item() < 0.04


def test_requantising_q6_k_to_int4_costs_its_two_extra_bits() -> None:
    """What a Q4_K_M file's Q6_K projections lose as int4 groups of 32, on Gaussian weights (RMS error over the
    weights' RMS): Q6_K's own 1.9 % becomes 8.1 %, a fresh 4-bit quantisation's 7.8 %."""
    weights = (np.random.default_rng(0).standard_normal((64, 1024)) * 0.02).astype(np.float32)
    q6_k = dequantize(quantize_q6_k(weights), GGMLQuantizationType.Q6_K).reshape(64, 1024)
    requantised = int4_from_dense(torch.from_numpy(q6_k)).dequantize().numpy()

    def relative(values: np.ndarray) -> float:
        return float(np.sqrt(((values - weights) ** 2).mean() / (weights**2).mean()))

    assert relative(q6_k) < 0.025 and 0.07 < relative(requantised) < 0.09


def _greedy(loaded: object, cpu_kernels: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=4, cpu_kernels=cpu_kernels) as llm:  # type: ignore[arg-type]
        return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def only_q4_k(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    """A file whose projections are all Q4_K, loaded as float32/none and as int4/float32."""
    folder = tmp_path_factory.mktemp("only-q4-k")
    path = write_tiny_q4_k_m_gguf(folder / "tiny.Q4_K.gguf", only_q4_k=True)
    exact = load_model(path, cache_dir=folder, dtype="float32", quantization="none")
    int4 = load_model(path, cache_dir=folder, dtype="float32", quantization="int4")
    assert int4.weight_format.quantization == "int4" and len(int4.quantized) == 15  # and the Q6_K LM head
    return exact, int4


def test_the_engine_on_an_all_q4_k_file_in_int4_answers_as_on_it_dequantised_to_float32(
    only_q4_k: tuple[LoadedModel, LoadedModel],
) -> None:
    """Through torch's int4 kernel (float32 scales and activations) the int4 weights are the file's float32 ones; the
    Q6_K LM head, without the compiled kernels, runs its own values dense: the reference is the file dequantised."""
    _, int4 = only_q4_k
    reference = dequantized_model(int4)
    assert _greedy(int4, cpu_kernels=False) == [generate_exactly(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_the_integer_dot_kernel_on_an_all_q4_k_file_stays_within_its_rounding_of_float32(
    only_q4_k: tuple[LoadedModel, LoadedModel],
) -> None:
    """The compiled kernels' integer-dot int4 matmul rounds the scales to bf16 and the activations to two int8 digits
    (engine/model/linear.py Int4DotLinear), and the Q6_K head's activations too (Int6DotLinear), so greedy tokens may
    part where two logits are that close: scored teacher-forced against the float32 model, every prompt token's
    log-probability is within 0.05 and every greedy pick within 0.05 of the top one. The prompts run through int4 too
    (no switch to the dense copy)."""
    exact, int4 = only_q4_k
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    everywhere = int4.with_row_switch(1 << 20)
    with LLM(mode="continuous", loaded=everywhere, max_num_seqs=4, cpu_kernels=True) as llm:
        runner = llm.runtime.engine.runner
        linears = runner.layer_linears(runner.layers[0])  # type: ignore[attr-defined]
        if not any(isinstance(getattr(lin, "quantized", lin), Int4DotLinear) for lin in linears):
            pytest.skip("no integer-dot int4 kernel on this CPU")
        head = getattr(runner.lm_head, "quantized", runner.lm_head)  # type: ignore[attr-defined]
        assert isinstance(head, Int6DotLinear if runner.kernels.has_int6_dot else Linear)  # type: ignore[attr-defined]
        outputs = llm.generate(PROMPTS, params)
    worst_prompt, worst_pick = 0.0, 0.0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.inference_mode():
            logits = exact.model(torch.tensor([prompt + output.token_ids])).logits[0].float().log_softmax(-1)
        assert output.prompt_logprobs is not None
        scored = torch.tensor(output.prompt_logprobs.logprobs)
        expected = logits[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        worst_prompt = max(worst_prompt, (scored - expected).abs().max().item())
        for step, token in enumerate(output.token_ids):
            row = logits[len(prompt) - 1 + step]
            worst_pick = max(worst_pick, row.max().item() - row[token].item())
    assert worst_prompt < 0.05 and worst_pick < 0.05  # 0.014 and 0.011 measured on AVX-512 VNNI


def test_the_engine_on_a_mixed_file_in_int4_answers_as_generate_on_its_int4_weights(q4_k_m: Path) -> None:
    """The requantised projections are other weights than the file's (they changed greedy tokens here): the
    engine must answer as transformers does on the int4 weights it holds."""
    loaded = load_model(q4_k_m, dtype="float32", quantization="int4")
    reference = dequantized_model(loaded)
    assert _greedy(loaded, cpu_kernels=False) == [generate_exactly(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_auto_loads_a_q4_k_m_file_as_int4_which_makes_the_int4_formats_candidates(q4_k_m: Path) -> None:
    loaded = load_model(q4_k_m, dtype="auto", quantization="auto")
    assert loaded.weight_format.quantization == "int4"
    # what load_auto passes `candidates` for this file
    pairs = candidates("auto", "auto", loaded.weight_format.quantization == "int4", stored_float32=False)
    assert ("float32", "int4") in pairs and ("bfloat16", "int4") in pairs


@pytest.mark.slow  # a real measurement of four formats: a minute on a loaded 2-core machine
def test_auto_offers_the_int4_candidates_for_a_q4_k_m_file(
    q4_k_m: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        loaded = load_auto(q4_k_m, cache_dir=tmp_path)
    assert "4 candidates (float32, bfloat16, int4/float32, int4/bfloat16)" in caplog.text
    assert loaded.weight_format.label in ("float32", "bfloat16", "int4/float32", "int4/bfloat16")
