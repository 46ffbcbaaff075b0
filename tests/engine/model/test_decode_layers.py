"""A pure decode step's layers in one compiled call (engine/model/fused_decode.py, engine/csrc/decode_layers.cpp): the
same tokens and logprobs as the per-op path, bit for bit, once per build of the kernels that has the integer-dot
int4 matmul; and the steps it must leave to the per-op path."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.fused_decode import LAYER_TENSORS, layer_offsets
from engine.model.model_runner import TransformersRunner
from engine.platform import native
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import load_model
from tests.engine.helpers import oracle, run

PROMPTS = [[5, 9, 2, 77, 31], [1, 2, 3], list(range(40, 57))]
NEW_TOKENS = 12


def _runner(
    checkpoint: Path, dtype: str, build: native.KernelBuild, quantized_head: bool = True, **options: Any
) -> TransformersRunner:
    loaded = load_model(checkpoint, dtype=dtype, quantization="int4")
    quantized = {name: w for name, w in loaded.quantized.items() if quantized_head or name != "lm_head"}
    return TransformersRunner(loaded.model, quantized=quantized, kernel_build=build, **options)


def _count_per_op_steps(runner: TransformersRunner) -> Callable[[], int]:
    """Counts the steps that run the per-op layers (the instance's own `_layers`, wrapped)."""
    calls = []
    per_op = runner._layers

    def counted(*args: Any) -> None:
        calls.append(1)
        per_op(*args)

    runner._layers = counted  # type: ignore[method-assign,assignment]
    return lambda: len(calls)


def _greedy(runner: TransformersRunner, dtype: torch.dtype) -> list[tuple[int, float | None]]:
    engine = Engine(runner, EngineConfig(max_rows=4, kv_cache_tokens=256, block_size=4), dtype=dtype)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)
    for seq_id, prompt in enumerate(PROMPTS):
        engine.add(seq_id, prompt, params)
        assert engine.reserve(seq_id, len(prompt) + NEW_TOKENS)
    outputs = list(engine.step([(i, len(p)) for i, p in enumerate(PROMPTS)]).tokens)
    for step in range(NEW_TOKENS - 1):
        rows = 1 if step < 3 else len(PROMPTS)  # batch 1 first, then all three
        outputs += engine.step([(i, 1) for i in range(rows)]).tokens
    return [(out.token_id, out.logprob) for out in outputs]


def _dot_build(kernels: native.Kernels) -> native.KernelBuild:
    if not kernels.has_int4_dot:
        pytest.skip(f"the {kernels.build.name} build has no integer dot product kernel (AVX2, or AVX-512 with VNNI)")
    return kernels.build


def test_the_cpp_offsets_of_a_layers_tensors_are_the_python_tables() -> None:
    """decode_layers.cpp indexes each layer's tensors by named constants; fused_decode.py's LAYER_TENSORS orders the
    list it is given. Each constant must be its field's offset in that table (kQkvProj for qkv_proj, ...)."""
    source = (Path(native.__file__).parent.parent / "csrc" / "decode_layers.cpp").read_text()
    enum = re.search(r"enum LayerTensor : int64_t \{(.*?)\};", source, re.DOTALL)
    assert enum is not None
    in_cpp = {name: int(value) for name, value in re.findall(r"(k\w+) = (\d+)", enum.group(1))}
    expected = {"k" + name.title().replace("_", ""): offset for name, offset in layer_offsets().items()}
    assert in_cpp == expected
    assert in_cpp["kLayerTensors"] == sum(count for _, count in LAYER_TENSORS) == 14


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_gives_the_per_op_paths_bits(kernels: native.Kernels, tiny_checkpoint: Path, dtype: str) -> None:
    build = _dot_build(kernels)
    fused = _runner(tiny_checkpoint, dtype, build)
    assert fused.fused_decode is not None
    per_op_steps = _count_per_op_steps(fused)
    got = _greedy(fused, getattr(torch, dtype))
    assert per_op_steps() == 1  # the prefill only: every decode step ran fused
    expected = _greedy(_runner(tiny_checkpoint, dtype, build, fused_decode=False), getattr(torch, dtype))
    assert got == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_steps_run_fused_and_emit_the_plain_steps_tokens(
    kernels: native.Kernels, tiny_checkpoint: Path, dtype: str
) -> None:
    """A row verifying drafts attends as one decode row per position (engine/model/forward_batch.py), so steps with
    drafts run fused too, with the per-op path's tokens, and in float32 the plain steps' (right drafts, a wrong one,
    and a row without). The float32 check holds the LM head dense: the int8 head's kernel changes with a step's rows
    (its dense copy past the row switch, AVX2's float kernel past 5), and a verify step has more rows than a plain one.
    """
    build = _dot_build(kernels)
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)] * len(PROMPTS)

    def engine(**options: Any) -> Engine:
        config = EngineConfig(max_rows=4, kv_cache_tokens=256, block_size=4)
        runner = _runner(tiny_checkpoint, dtype, build, quantized_head=dtype != "float32", **options)
        return Engine(runner, config, dtype=getattr(torch, dtype))

    reference, _, _ = run(engine(), PROMPTS, params, chunk=64)
    drafters = {0: oracle(reference, PROMPTS, 4), 1: oracle(reference, PROMPTS, 3, wrong_at=1)}

    def drafter(seq_id: int, tokens: list[int]) -> list[int]:
        return drafters[seq_id](seq_id, tokens) if seq_id in drafters else []

    fused = engine()
    per_op_steps = _count_per_op_steps(fused.runner)  # type: ignore[arg-type]
    got, _, stats = run(fused, PROMPTS, params, drafter, chunk=64)
    assert sum(accepted for _, accepted in stats) > 0
    assert per_op_steps() == 1  # the prefill only: every step with drafts ran fused
    assert got == run(engine(fused_decode=False), PROMPTS, params, drafter, chunk=64)[0]
    if dtype == "float32":  # bfloat16's prefill step, which verifies its drafts as a chunk, rounds otherwise
        assert got == reference


@pytest.fixture(scope="module")
def llama_1b_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One decoder layer of Llama-3.2-1B's shape (hidden 2,048, 32 query and 8 KV heads, MLP 8,192), which the
    default model's (576, 9 and 3, 1,536) never exercises, with the tiny tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.server_harness import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(7)
    directory = tmp_path_factory.mktemp("llama-1b-layer")
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# Slow: a 2,048-wide layer costs seconds of CPU per greedy run; the tiny-shape test above covers the same fused path.
@pytest.mark.slow
def test_fused_decode_at_llama_1b_shapes_gives_the_per_op_paths_bits(
    kernels: native.Kernels, llama_1b_layer: Path
) -> None:
    build = _dot_build(kernels)
    fused = _runner(llama_1b_layer, "float32", build)
    assert fused.fused_decode is not None
    assert _greedy(fused, torch.float32) == _greedy(
        _runner(llama_1b_layer, "float32", build, fused_decode=False), torch.float32
    )


def test_steps_past_the_row_switch_run_per_op(kernels: native.Kernels, tiny_checkpoint: Path) -> None:
    """With quantised weights for up to 2 rows, the 3-row steps run the dense copy, one op at a time."""
    build = _dot_build(kernels)
    runner = _runner(tiny_checkpoint, "float32", build, max_quantized_rows=2)
    assert runner.fused_decode is not None
    assert [runner.fused_decode.kernel(rows) for rows in (1, 2, 3)] == ["int4_dot", "int4_dot", None]
    per_op_steps = _count_per_op_steps(runner)
    got = _greedy(runner, torch.float32)
    assert per_op_steps() == 1 + (NEW_TOKENS - 1 - 3)  # the prefill and every 3-row step
    unfused = _runner(tiny_checkpoint, "float32", build, max_quantized_rows=2, fused_decode=False)
    assert got == _greedy(unfused, torch.float32)


def test_layers_without_integer_dot_weights_keep_the_per_op_path(
    kernels: native.Kernels, tiny_checkpoint: Path
) -> None:
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int8")
    assert TransformersRunner(loaded.model, quantized=loaded.quantized, kernel_build=kernels.build).fused_decode is None
    dense = load_model(tiny_checkpoint, dtype="float32", quantization="none")
    assert TransformersRunner(dense.model, kernel_build=kernels.build).fused_decode is None
    int4 = _runner(tiny_checkpoint, "float32", kernels.build)
    assert (int4.fused_decode is not None) == kernels.has_int4_dot


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("switch", [0, 2])
def test_one_digit_steps_run_fused_with_the_per_op_paths_bits(
    kernels: native.Kernels, tiny_checkpoint: Path, dtype: str, switch: int
) -> None:
    """Without a dense copy (`--int4-gemm all`), steps past the row switch run int4_gemm's one digit; they run fused
    too (every step, where the switch is 0 rows: `auto`'s choice where one digit was faster at one row), with the
    per-op path's tokens and logprobs."""
    build = _dot_build(kernels)
    options = {"max_quantized_rows": switch, "int4_gemm": "all"}
    fused = _runner(tiny_checkpoint, dtype, build, **options)
    assert fused.fused_decode is not None
    assert [fused.fused_decode.kernel(rows) for rows in (1, 3)] == [
        "int4_dot" if rows <= switch else "int4_gemm" for rows in (1, 3)
    ]
    per_op_steps = _count_per_op_steps(fused)
    got = _greedy(fused, getattr(torch, dtype))
    assert per_op_steps() == 1  # the prefill only
    expected = _greedy(_runner(tiny_checkpoint, dtype, build, fused_decode=False, **options), getattr(torch, dtype))
    assert got == expected


def test_a_projection_on_its_dense_copy_keeps_the_step_per_op(kernels: native.Kernels, tiny_checkpoint: Path) -> None:
    """`--int4-gemm except-qkv`: past the switch q/k/v run their dense copy and the rest one digit, so those steps
    are not fused."""
    build = _dot_build(kernels)
    runner = _runner(tiny_checkpoint, "float32", build, max_quantized_rows=2, int4_gemm="except-qkv")
    assert runner.fused_decode is not None
    assert [runner.fused_decode.kernel(rows) for rows in (2, 3)] == ["int4_dot", None]
