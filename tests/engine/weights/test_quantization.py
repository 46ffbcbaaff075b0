"""Weight formats on tiny models: GGUF block decoding against gguf's own dequantisation, the int4/int8 matmuls
against `F.linear` on the same dequantised weights, the runner in each format against `generate()` on those
weights, and the `--dtype`/`--quantization` options from the CLI down to the loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from api.cli import build_parser
from api.config import ServerConfig
from api.flags import config_from_args
from api.runtime.offline import LLM
from engine.config import LoadConfig
from engine.model.linear import Int4Linear, Int8Linear, Linear, build_linear
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel, load_model
from engine.weights.quantization import (
    Int4Weight,
    Int6Weight,
    Int8Weight,
    concat_rows,
    gguf_projection_types,
    int4_from_dense,
    int8_from_dense,
    open_gguf,
    read_gguf_int4,
)
from engine.weights.weight_format import WeightFormat, cpu_has_native_bf16, resolve
from tests.reference_models import dequantized_model, generate_exactly

HEADS, KV_HEADS, HIDDEN = 4, 2, 64
NEW_TOKENS = 12


# ----- GGUF blocks -----------------------------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> None:
    writer = GGUFWriter(path, arch)
    for name, (dense, kind) in tensors.items():
        blocks = quantize(dense, kind)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reverse_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reversal of llama.cpp's q/k row order (modeling_gguf_pytorch_utils), restated."""
    dim = weight.shape[0] // heads // 2
    return weight.reshape(heads, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    dense = {
        "blk.0.attn_q.weight": (rng.standard_normal((HIDDEN, HIDDEN)), GGMLQuantizationType.Q4_1),
        "blk.0.attn_k.weight": (rng.standard_normal((32, HIDDEN)), GGMLQuantizationType.Q4_1),
        "blk.0.attn_v.weight": (rng.standard_normal((32, HIDDEN)), GGMLQuantizationType.Q4_0),
        "blk.0.ffn_down.weight": (rng.standard_normal((HIDDEN, 128)) + 0.5, GGMLQuantizationType.Q4_0),
        "output.weight": (rng.standard_normal((96, HIDDEN)), GGMLQuantizationType.Q8_0),
        "blk.0.ffn_up.weight": (rng.standard_normal((128, HIDDEN)), GGMLQuantizationType.F32),
    }
    tensors = {name: (weight.astype(np.float32), kind) for name, (weight, kind) in dense.items()}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, "llama", tensors)
    reference = {name: dequantize(quantize(weight, kind), kind) for name, (weight, kind) in tensors.items()}
    return path, reference


def test_q4_blocks_load_as_int4_exactly_as_gguf_dequantizes_them(
    gguf_file: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, reference = gguf_file
    weights = read_gguf_int4(open_gguf(path), HEADS, KV_HEADS)
    assert set(weights) == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.mlp.down_proj",
    }  # the F32 and Q8_0 tensors are not int4
    expected = {
        "model.layers.0.self_attn.q_proj": _reverse_permute(reference["blk.0.attn_q.weight"], HEADS),
        "model.layers.0.self_attn.k_proj": _reverse_permute(reference["blk.0.attn_k.weight"], KV_HEADS),
        "model.layers.0.self_attn.v_proj": reference["blk.0.attn_v.weight"],
        "model.layers.0.mlp.down_proj": reference["blk.0.ffn_down.weight"],
    }
    for name, weight in weights.items():
        assert weight.values.dtype == torch.uint8 and int(weight.values.max()) <= 15
        torch.testing.assert_close(weight.dequantize(), torch.from_numpy(expected[name]), rtol=0, atol=1e-6)


def test_projection_types_are_reported_by_module_name(gguf_file: tuple[Path, dict[str, np.ndarray]]) -> None:
    types = gguf_projection_types(open_gguf(gguf_file[0]))
    assert types["model.layers.0.self_attn.q_proj"] == "Q4_1"
    assert types["model.layers.0.self_attn.v_proj"] == "Q4_0"
    assert types["model.layers.0.mlp.up_proj"] == "F32"
    assert types["lm_head"] == "Q8_0"


# ----- quantising dense weights ---------------------------------------------------------------------------------


def test_int4_quantisation_error_is_within_half_a_step_per_group() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    int4 = int4_from_dense(weight)
    step = int4.scales.repeat_interleave(32, dim=1)
    assert bool(((int4.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    assert int(int4.values.max()) == 15 and int(int4.values.min()) == 0  # the range is used in full


def test_int8_quantisation_error_is_within_half_a_step_per_row() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    int8 = int8_from_dense(weight)
    assert bool(((int8.dequantize() - weight).abs() <= int8.scales[:, None] / 2 + 1e-6).all())


def test_int8_conversion_by_blocks_of_rows_is_the_whole_weights_and_reads_int6_values_as_dense() -> None:
    """Converted a block of rows at a time (bounding the float32 temporaries a 128k-row head would need), the
    result is bit for bit the one-pass formula's, past a block's edge too; an Int6Weight converts as its values."""
    weight = torch.randn(5000, 64, generator=torch.Generator().manual_seed(3))
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    int8 = int8_from_dense(weight)
    assert torch.equal(int8.scales, scales)
    assert torch.equal(int8.values, torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
    codes = torch.randint(0, 64, (4100, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    sub = torch.randint(-127, 128, (4100, 16), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    int6 = Int6Weight(codes, sub, torch.rand(4100, 1) * 1e-3)
    from_int6, from_values = int8_from_dense(int6), int8_from_dense(int6.dequantize())
    assert torch.equal(from_int6.values, from_values.values) and torch.equal(from_int6.scales, from_values.scales)


def test_int4_refuses_inputs_that_are_not_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of the int4 group size"):
        int4_from_dense(torch.randn(8, 40))


def test_fused_rows_concatenate_in_order() -> None:
    a, b = int4_from_dense(torch.randn(8, 64)), int4_from_dense(torch.randn(16, 64))
    fused = concat_rows([a, b])
    assert isinstance(fused, Int4Weight)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="cannot fuse"):
        concat_rows([a, int8_from_dense(torch.randn(8, 64))])


# ----- the matmuls ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int4_linear_in_float32_is_f_linear_on_its_dequantised_weight(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = int4_from_dense(torch.randn(96, 128, generator=generator))
    bias = torch.randn(96, generator=generator) if with_bias else None
    linear = build_linear(weight, bias, torch.float32, prepack=True)
    assert isinstance(linear, Int4Linear)
    x = torch.randn(rows, 160, generator=generator)[:, 16:144]  # strided, as the runner's slices are
    torch.testing.assert_close(linear(x), F.linear(x, weight.dequantize(), bias), rtol=1e-5, atol=1e-4)


def test_int8_linear_in_float32_is_f_linear_on_its_dequantised_weight() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = int8_from_dense(torch.randn(80, 64, generator=generator))
    bias = torch.randn(80, generator=generator)
    linear = build_linear(weight, bias, torch.float32, prepack=True)
    assert isinstance(linear, Int8Linear) and linear.in_features == 64
    x = torch.randn(7, 64, generator=generator)
    torch.testing.assert_close(linear(x), F.linear(x, weight.dequantize(), bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["int4", "int8", "dense"])
def test_bfloat16_matmuls_stay_within_bfloat16_rounding(kind: str) -> None:
    generator = torch.Generator().manual_seed(4)
    dense = torch.randn(64, 128, generator=generator) * 0.05
    weight: Int4Weight | Int8Weight | torch.Tensor
    if kind == "int4":
        weight = int4_from_dense(dense)
    elif kind == "int8":
        weight = int8_from_dense(dense)
    else:
        weight = dense.bfloat16()
    reference_weight = weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()
    linear = build_linear(weight, None, torch.bfloat16, prepack=True)
    x = torch.randn(9, 128, generator=generator).bfloat16()
    out = linear(x)
    assert out.dtype == torch.bfloat16
    reference = F.linear(x.float(), reference_weight)
    assert (out.float() - reference).abs().max().item() <= 0.02 * reference.abs().max().item()


def test_dense_linear_reports_its_input_size() -> None:
    assert Linear.build(torch.randn(8, 24), None, prepack=False).in_features == 24


# ----- the runner on the tiny model, each format against generate() on the same weights ----------------------


PROMPTS = [[5, 17, 42, 9], [100, 3], [7] * 30, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def _engine_outputs(loaded: LoadedModel, prompts: list[list[int]], seats: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=seats, max_num_batched_tokens=64) as llm:
        return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_quantised_float32_runner_matches_generate_on_the_same_weights(
    tiny_checkpoint: Path, quantization: str, cpu_kernels: bool
) -> None:
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization=quantization)
    assert loaded.weight_format == WeightFormat(torch.float32, quantization)
    assert "model.layers.1.mlp.down_proj" in loaded.quantized
    assert isinstance(loaded.quantized["lm_head"], Int8Weight)  # int8 per row with float32 activations too
    expected_kind = Int4Weight if quantization == "int4" else Int8Weight
    assert isinstance(loaded.quantized["model.layers.0.self_attn.q_proj"], expected_kind)
    reference = dequantized_model(loaded)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=4, cpu_kernels=cpu_kernels) as llm:
        runner = llm.runtime.engine.runner
        assert all(not isinstance(lin, Linear) for lin in runner.layer_linears(runner.layers[0]))  # type: ignore[attr-defined]
        outputs = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert outputs == [generate_exactly(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]


def test_quantised_runner_batched_equals_alone(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    together = _engine_outputs(loaded, PROMPTS, seats=4)
    alone = [_engine_outputs(loaded, [prompt], seats=1)[0] for prompt in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_bfloat16_runner_follows_generate_on_the_bfloat16_model(tiny_checkpoint: Path, quantization: str) -> None:
    """bf16 rounds at different places than transformers' modules do, so greedy outputs may part where the top two
    logits are within bf16 rounding of each other: each step's engine logits must be within that tolerance of
    transformers' on the same prefix (teacher-forced), and the first token must agree."""
    loaded = load_model(tiny_checkpoint, dtype="bfloat16", quantization=quantization)
    assert loaded.weight_format.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    if quantization != "none":
        assert isinstance(loaded.quantized["lm_head"], Int8Weight)  # the LM head is int8 per row with bf16
    reference = dequantized_model(loaded)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=4) as llm:
        assert llm.runtime.engine.cache.data.dtype == torch.bfloat16
        outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        sequence = prompt + output.token_ids
        with torch.inference_mode():
            logits = reference(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
        expected = generate_exactly(reference, prompt, NEW_TOKENS)
        assert output.token_ids[0] == expected[0]
        # The engine's prompt logprobs score each prompt token; transformers' must agree within bf16 rounding.
        assert output.prompt_logprobs is not None and output.prompt_logprobs.first_position == 1
        scored = torch.tensor(output.prompt_logprobs.logprobs)
        expected_scores = logits[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert (scored - expected_scores).abs().max().item() < 0.1
        # Every greedy pick is transformers' top token or within bf16 rounding of it.
        for step, token in enumerate(output.token_ids):
            row = logits[len(prompt) - 1 + step]
            assert row.max().item() - row[token].item() < 0.1


# ----- options: LoadConfig, auto, the CLI -----------------------------------------------------------------------


def test_load_config_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        LoadConfig(dtype="float16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LoadConfig(quantization="awq")


def test_auto_resolves_from_the_file_and_the_cpu() -> None:
    cpu = torch.device("cpu")
    auto = LoadConfig("auto", "auto")
    assert resolve(auto, cpu, gguf_has_int4=True, checkpoint_dtype=None).quantization == "int4"
    assert resolve(auto, cpu, gguf_has_int4=False, checkpoint_dtype=torch.float32) == WeightFormat(
        torch.float32, "none"
    )
    bf16 = resolve(auto, cpu, gguf_has_int4=False, checkpoint_dtype=torch.bfloat16)
    assert bf16.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve(LoadConfig("bfloat16", "int8"), cpu, False, None) == WeightFormat(torch.bfloat16, "int8")
    quantized_auto = resolve(LoadConfig("auto", "int8"), cpu, False, torch.float32)
    assert quantized_auto.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve(LoadConfig(), cpu, True, None) == WeightFormat(torch.float32, "none")  # the library default
    with pytest.raises(ValueError, match="CPU kernels only"):
        resolve(LoadConfig("auto", "int4"), torch.device("cuda"), True, None)
    assert resolve(auto, torch.device("cuda"), True, None).quantization == "none"


def test_auto_on_a_float32_checkpoint_is_exact(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint, dtype="auto", quantization="auto")
    assert loaded.weight_format == WeightFormat(torch.float32, "none") and not loaded.quantized


def test_cli_flags_reach_the_loader_options() -> None:
    args = build_parser().parse_args(["serve", "--dtype", "bfloat16", "--quantization", "int8"])
    options = config_from_args(args).runtime_options()
    assert (options.dtype, options.quantization) == ("bfloat16", "int8")
    defaults = ServerConfig().runtime_options()
    assert (defaults.dtype, defaults.quantization) == ("auto", "auto")


@pytest.mark.parametrize("flag, value", [("--dtype", "float16"), ("--quantization", "gptq")])
def test_cli_rejects_unknown_formats(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])
    assert "invalid choice" in capsys.readouterr().err


def test_server_config_rejects_unknown_formats() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServerConfig(dtype="half")
