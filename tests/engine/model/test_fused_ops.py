"""The fused element-wise kernels (engine/model/elementwise.py, engine/csrc/fused_ops.cpp) against the unfused torch
code they replace, in float32 and bfloat16, over odd sizes and several rows; and the decode attention kernel on a bf16
cache.

Every test runs once per build of the kernels this CPU can execute (engine/platform/native.py). Tolerances: everything
is bit-exact against transformers' own modules except float32 RMSNorm, whose sum of squares the kernel takes in
double (torch sums in float in its own order): there the output may differ in the last bit or two (rtol 1e-6);
and float32 SiLU, exact only in the build whose exp is the one torch runs here (elsewhere the engine runs torch's op);
bfloat16 SiLU reads a table of torch's own values, exact on every build.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.attention import paged_attention, prepare
from engine.model.elementwise import ElementwiseOps, RotaryTables
from engine.model.forward_batch import build_forward_batch
from engine.model.model_runner import TransformersRunner
from engine.platform import native
from engine.sample import sampler
from engine.sample.kernels import argmax_rows, token_logprobs
from engine.sample.sampling_params import SamplingParams
from tests.toolchain import load_build

DTYPES = (torch.float32, torch.bfloat16)
SIZES = ((1, 576), (7, 33), (40, 576), (3, 1), (5, 1000))  # (rows, width): odd widths exercise the kernels' tails
TORCH = ElementwiseOps(None)


@pytest.fixture
def fused(kernels: native.Kernels) -> ElementwiseOps:
    return ElementwiseOps.build(kernels)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "width"), SIZES)
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "no-add"])
def test_add_rms_norm_matches_llama_rms_norm_of_the_sum(
    fused: ElementwiseOps, dtype: torch.dtype, rows: int, width: int, with_delta: bool
) -> None:
    x = _random((rows, width), dtype, seed=width)
    delta = _random((rows, width), dtype, seed=width + 1) if with_delta else None
    module = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    module.weight.data = (torch.rand(width, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    expected_sum = x + delta if delta is not None else x.clone()
    expected = module(expected_sum)
    for ops in (fused, TORCH):
        residual = x.clone()
        normed = ops.add_rms_norm(residual, delta, module.weight.data, 1e-5)
        assert torch.equal(residual, expected_sum), "the residual is updated in place with the plain sum"
        assert normed.dtype == dtype
        if dtype == torch.float32 and ops is fused:
            torch.testing.assert_close(normed, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "width"), SIZES)
def test_silu_mul_gives_the_bits_of_silu_times_up(
    kernels: native.Kernels, fused: ElementwiseOps, dtype: torch.dtype, rows: int, width: int
) -> None:
    gate_up = _random((rows, 2 * width), dtype, seed=width, scale=4.0)  # wide enough for exp to saturate
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    for ops in (fused, TORCH):  # the engine's choice is exact on every build: the kernel, or torch's own op
        assert torch.equal(ops.gated_activation(gate_up, torch.nn.SiLU()), expected)
    assert fused.fused_silu == kernels.silu_matches_torch
    got = kernels.ops.silu_mul(gate_up)
    if kernels.silu_matches_torch:
        assert torch.equal(got, expected)
    else:  # another exp than torch's: within an ulp of the exp, one bf16 rounding on top
        tolerance = 1e-6 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("width", [1536, 1000, 33])  # whole steps of torch's loop; a tail of 40 (AVX-512); short
def test_bf16_silu_by_table_gives_torchs_bits_for_every_bf16_value(kernels: native.Kernels, width: int) -> None:
    """Every one of the 65,536 bfloat16 gate values (NaNs compared as NaN), at every position of a row, through the
    table kernel and the engine's choice, against torch's SiLU(gate) * up."""
    every_value = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = -(-65536 // width)
    gate = torch.cat((every_value, every_value[: rows * width - 65536])).view(rows, width)
    up = _random((rows, width), torch.bfloat16, seed=width, scale=3.0)
    gate_up = torch.cat((gate, up), dim=1)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]  # the engine's strided view: torch's loop per row
    fused = ElementwiseOps.build(kernels)
    assert fused.silu_table is not None
    for got in (
        kernels.ops.silu_mul_table(gate_up, fused.silu_table, fused.silu_vector_step),
        fused.gated_activation(gate_up, torch.nn.SiLU()),
    ):
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_silu_table_refuses_a_wrong_table(kernels: native.Kernels) -> None:
    gate_up = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="silu_table must be float32 \\[65536\\]"):
        kernels.ops.silu_mul_table(gate_up, torch.zeros(100), 64)


def test_the_build_for_torchs_own_capability_claims_exact_silu() -> None:
    """Whatever capability torch runs here (capped or not), the engine's default build matches it."""
    kernels = load_build(native.best_build())
    assert kernels.silu_matches_torch == (kernels.build is not native.NATIVE_BUILD)


def test_other_activations_take_the_torch_path(fused: ElementwiseOps) -> None:
    gate_up = _random((3, 10), torch.float32, seed=0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused.gated_activation(gate_up, torch.nn.GELU()), F.gelu(gate) * up)


def _rope_case(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int):
    qkv = _random((tokens, (heads + 2 * kv_heads) * dim), dtype, seed=tokens + heads, scale=2.0)
    angles = torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(1)) * 100
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)  # as a Llama rotary embedding lays them out
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    slots = torch.randperm(4 * tokens + 5, generator=torch.Generator().manual_seed(3))[:tokens]
    return qkv, cos, sin, slots, 4 * tokens + 5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"),
    [(1, 9, 3, 64), (13, 4, 4, 6), (40, 6, 2, 16), (5, 3, 1, 2), (7, 4, 2, 128), (3, 2, 1, 32)],
)
def test_rope_and_cache_write_match_transformers(
    fused: ElementwiseOps, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    qkv, cos, sin, slots, num_slots = _rope_case(dtype, tokens, heads, kv_heads, dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None]  # HF's [batch, heads, tokens, dim]
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim).transpose(0, 1)[None]
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).transpose(0, 1)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    rotary = RotaryTables.build(cos, sin)
    for ops in (fused, TORCH):
        key_cache = torch.full((kv_heads, num_slots, dim), 7.0, dtype=dtype)
        value_cache = torch.full((kv_heads, num_slots, dim), 7.0, dtype=dtype)
        query = ops.rope_write_cache(qkv, rotary, key_cache, value_cache, slots, heads, kv_heads)
        assert torch.equal(query, expected_q[0].transpose(0, 1))
        assert torch.equal(key_cache[:, slots], expected_k[0])
        assert torch.equal(value_cache[:, slots], v)
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[slots] = False
        assert bool((key_cache[:, untouched] == 7).all()) and bool((value_cache[:, untouched] == 7).all())


def test_rope_kernel_rejects_a_slot_outside_the_cache(kernels: native.Kernels) -> None:
    qkv, cos, sin, slots, num_slots = _rope_case(torch.float32, 4, 2, 1, 8)
    cache = torch.zeros(1, num_slots, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.ops.rope_write_cache(qkv, cos, sin, cache, cache.clone(), slots * 0 + num_slots, 2, 1)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 49157])
def test_argmax_rows_matches_torch_with_ties_and_infinities(kernels: native.Kernels, vocab: int) -> None:
    logits = _random((9, vocab), torch.float32, seed=vocab)
    logits[1] = float("-inf")  # a row with every token banned still has an answer: index 0, as torch says
    logits[2, vocab // 2 :] = logits[2].max() + 1  # a tie spanning blocks: the lowest index wins
    logits[3, -1] = 1e30  # the winner in the last, partial block
    logits[4, 0] = float("inf")
    assert torch.equal(argmax_rows(logits, kernels), logits.argmax(dim=-1))


def test_argmax_rows_of_no_rows(kernels: native.Kernels) -> None:
    assert argmax_rows(torch.zeros(0, 5), kernels).shape == (0,)


@pytest.mark.parametrize(("vocab", "k"), [(49157, 5), (49157, 0), (7, 20), (1000, 1)])
def test_token_logprobs_match_log_softmax_gather_and_topk(kernels: native.Kernels, vocab: int, k: int) -> None:
    logits = _random((6, vocab), torch.float32, seed=vocab, scale=5.0)
    logits[2, 3] = -1e30  # a very unlikely token, chosen
    logits[4] += 3e38 - logits[4].max()  # near float32's maximum: the shift by the row maximum keeps it finite
    tokens = torch.tensor([0, vocab - 1, 3, vocab // 2, 1, 2]) % vocab
    chosen, top_ids, top_logprobs = token_logprobs(logits, tokens, k, kernels)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chosen, reference.gather(1, tokens[:, None])[:, 0], rtol=1e-6, atol=2e-5)
    if k == 0:
        assert top_ids is None and top_logprobs is None
        return
    assert top_ids is not None and top_logprobs is not None
    expected_logprobs, expected_ids = reference.topk(min(k, vocab), dim=-1)
    torch.testing.assert_close(top_logprobs, expected_logprobs, rtol=1e-6, atol=2e-5)
    distinct = [0, 1, 2, 3, 5]  # row 4's logits collapse to a few float32 values near 3e38: ties everywhere
    assert torch.equal(top_ids[distinct], expected_ids[distinct])
    if vocab > k:  # among tied values the kernel lists the lowest ids first, as argmax picks the lowest
        assert top_ids[4].tolist() == sorted(top_ids[4].tolist())


def test_the_sampler_runs_the_runners_kernels_never_the_processs(
    kernels: native.Kernels, tiny_llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--no-cpu-kernels` builds a runner without kernels: its engine samples through torch although this process
    has loaded a build (`kernels`), and a runner with kernels hands them to the sampler."""
    read_ops: list[str] = []  # the build of every Kernels whose ops anything reads
    given: list[native.Kernels | None] = []  # the kernels each greedy sampling step was given

    def spied_ops(self: native.Kernels) -> object:
        read_ops.append(self.build.name)
        return getattr(torch.ops, self.build.namespace)

    def spied_argmax(logits: torch.Tensor, kernels: native.Kernels | None = None) -> torch.Tensor:
        given.append(kernels)
        return argmax_rows(logits, kernels)

    monkeypatch.setattr(native.Kernels, "ops", property(spied_ops))
    monkeypatch.setattr(sampler, "argmax_rows", spied_argmax)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    for runner in (
        TransformersRunner(tiny_llama, native_attention=False),
        TransformersRunner(tiny_llama, kernel_build=kernels.build),
    ):
        engine = Engine(runner, EngineConfig(max_rows=1, kv_cache_tokens=64, block_size=4))
        engine.add(0, [5, 9, 2], params)
        assert engine.reserve(0, 6)
        read_ops.clear()
        given.clear()
        outputs = [*engine.step([(0, 3)]).tokens, *engine.step([(0, 1)]).tokens]
        assert [len(out.top_logprobs or ()) for out in outputs] == [2, 2]
        assert given == [runner.kernels] * 2
        assert bool(read_ops) == (runner.kernels is not None)  # no kernel ran anywhere in the step without them


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
)
def test_decode_kernel_reads_a_bf16_cache(
    kernels: native.Kernels, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """Against the torch path in float32 on the same (bf16-rounded) values; the kernel accumulates in float32."""
    rows, heads, kv_heads, dim, block_size, max_blocks = 6, 9, 3, 64, 4, 5
    num_blocks = rows * max_blocks + 2
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=generator).to(cache_dtype)
    value_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=generator).to(cache_dtype)
    query = torch.randn(rows, heads, dim, generator=generator).to(query_dtype)
    block_table = torch.randperm(num_blocks, generator=generator)[: rows * max_blocks].view(rows, max_blocks)
    context = torch.randint(1, max_blocks * block_size + 1, (rows,), generator=generator)
    tokens = torch.zeros(rows, max_blocks * block_size, dtype=torch.long)
    batch, _ = build_forward_batch(
        torch.arange(rows), torch.ones(rows, dtype=torch.long), context - 1, context, tokens, block_table, block_size
    )
    kernel = kernels.decode_attention
    groups = prepare(batch.groups, kv_heads, num_blocks, block_size, native_decode=True)
    got = paged_attention(query, key_cache, value_cache, groups, 0.125, decode_kernel=kernel)
    torch_groups = prepare(batch.groups, kv_heads, num_blocks, block_size, native_decode=False)
    expected = paged_attention(query.float(), key_cache.float(), value_cache.float(), torch_groups, 0.125)
    assert got.dtype == query_dtype
    tolerance = 1e-5 if query_dtype == torch.float32 else 8e-3  # a bf16 output is rounded once, at the end
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


# ----- the runner: fused and unfused layers give the same model -----


def _greedy_outputs(
    model: PreTrainedModel, dtype: torch.dtype, fused: bool, build: native.KernelBuild
) -> list[tuple[int, float | None]]:
    runner = TransformersRunner(model, fused_ops=fused, kernel_build=build)
    assert (runner.ops.kernels is not None) == fused
    engine = Engine(runner, EngineConfig(max_rows=4, kv_cache_tokens=256, block_size=4), dtype=dtype)
    prompts = [[5, 9, 2, 77, 31], [1, 2, 3], list(range(40, 57))]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    for seq_id, prompt in enumerate(prompts):
        engine.add(seq_id, prompt, params)
        assert engine.reserve(seq_id, len(prompt) + 12)
    outputs = list(engine.step([(i, len(p)) for i, p in enumerate(prompts)]).tokens)
    for _ in range(11):
        outputs += engine.step([(i, 1) for i in range(len(prompts))]).tokens
    return [(out.token_id, out.logprob) for out in outputs]


def test_fused_layers_decode_the_same_tokens_in_float32(kernels: native.Kernels, tiny_llama: PreTrainedModel) -> None:
    fused = _greedy_outputs(tiny_llama, torch.float32, True, kernels.build)
    unfused = _greedy_outputs(tiny_llama, torch.float32, False, kernels.build)
    assert [t for t, _ in fused] == [t for t, _ in unfused]
    torch.testing.assert_close([lp for _, lp in fused], [lp for _, lp in unfused], rtol=1e-5, atol=1e-5)


def test_fused_layers_give_the_bits_of_the_torch_path_in_bfloat16(
    kernels: native.Kernels, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model: PreTrainedModel = copy.deepcopy(tiny_model_builder("qwen2"))  # qwen2: q/k/v biases too
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types `to` loosely
    fused = _greedy_outputs(model, torch.bfloat16, True, kernels.build)
    assert fused == _greedy_outputs(model, torch.bfloat16, False, kernels.build)
