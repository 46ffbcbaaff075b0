"""The compiled prompt-chunk attention over a bf16 paged cache (engine/csrc/paged_prefill_attention.cpp): against
float32 SDPA on the same bf16 inputs, once per build that has it (the avx512_bf16 build; the others skip), and
through the engine against the SDPA path it replaces.

Tolerance: the kernel rounds each softmax weight to bf16 before the weighted sum of the values (2^-9 relative per
weight) and its output to bf16 (2^-9 relative), with float32 sums throughout; the reference rounds nothing but the
output comparison. So |kernel - reference| <= 1e-2 + 1e-2 |reference| elementwise (measured worst: 0.0093 at
|reference| ~3, about the output's own bf16 rounding), and the mean error stays under 2e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.platform import native
from engine.platform.cpu_features import features_for
from engine.sample.sampling_params import SamplingParams
from tests.conftest import build_tiny_causal_lm

SCALE = 0.125


def _prefill_kernel(kernels: native.Kernels) -> native.PrefillKernel:
    kernel = kernels.prefill_attention
    if kernel is None:
        pytest.skip(f"the {kernels.build.name} build has no prefill kernel (it needs AVX512-BF16)")
    return kernel


def test_only_the_bf16_build_has_the_prefill_kernel(kernels: native.Kernels) -> None:
    assert (kernels.prefill_attention is not None) == (kernels.build.name == "avx512_bf16")


def _case(counts: list[int], starts: list[int], heads: int, kv_heads: int, dim: int, block_size: int, shuffled: bool):
    """Random bf16 queries (rows' chunks packed), cache and block tables; row r's chunk is positions
    starts[r] .. starts[r] + counts[r] - 1, its context the keys before and including them."""
    generator = torch.Generator().manual_seed(sum(counts) + 7 * sum(starts) + heads)
    context = [start + count for start, count in zip(starts, counts, strict=True)]
    max_blocks, rows = max(-(-c // block_size) for c in context), len(counts)
    num_blocks = rows * max_blocks + 3
    order = torch.randperm(num_blocks, generator=generator) if shuffled else torch.arange(num_blocks)
    table = order[: rows * max_blocks].view(rows, max_blocks).contiguous()
    caches = [torch.randn(kv_heads, num_blocks * block_size, dim, generator=generator).bfloat16() for _ in range(2)]
    query = (2 * torch.randn(sum(counts), heads, dim, generator=generator)).bfloat16()
    token_start = torch.tensor([sum(counts[:r]) for r in range(rows)])
    return query, *caches, table, token_start, torch.tensor(counts), torch.tensor(context)


def _reference(query, key_cache, value_cache, table, token_start, counts, context, block_size: int) -> torch.Tensor:
    """float32 SDPA per row over its gathered keys, query i of a chunk seeing keys 0 .. start + i."""
    out = torch.zeros(query.shape)
    for r in range(table.shape[0]):
        n, c, first = int(counts[r]), int(context[r]), int(token_start[r])
        slots = (table[r][:, None] * block_size + torch.arange(block_size)).reshape(-1)[:c]
        keys, values = key_cache[:, slots].float(), value_cache[:, slots].float()
        visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        q = query[first : first + n].float().transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=visible, scale=SCALE, enable_gqa=True
        )
        out[first : first + n] = attended[0].transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("counts", "starts", "heads", "kv_heads", "dim", "block_size", "shuffled"),
    [
        ([100], [0], 9, 3, 64, 16, False),  # a lone chunk from 0 (SmolLM2's heads), 100 = 6 tiles and 4
        ([37], [0], 9, 3, 64, 16, True),  # blocks not consecutive
        ([45], [70], 9, 3, 64, 16, True),  # a second chunk, or one after a cached prefix
        ([33, 7, 50, 1], [0, 20, 13, 90], 32, 8, 64, 16, True),  # several rows; the 1B model's heads (ratio 4)
        ([20, 3], [5, 90], 4, 1, 128, 8, True),  # head size 128
        ([29], [3], 6, 3, 64, 5, True),  # ratio 2; blocks of 5, not a divisor of any tile
        ([40], [9], 8, 1, 64, 16, True),  # ratio 8: two passes of 4 heads
        ([18], [0], 2, 2, 64, 4, True),  # ratio 1
    ],
)
def test_the_kernel_matches_float32_sdpa_on_the_same_inputs(
    kernels: native.Kernels,
    counts: list[int],
    starts: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    shuffled: bool,
) -> None:
    kernel = _prefill_kernel(kernels)
    case = _case(counts, starts, heads, kv_heads, dim, block_size, shuffled)
    got = kernel(*case, block_size, SCALE)
    expected = _reference(*case, block_size)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    error = (got.float() - expected).abs()
    assert bool((error <= 1e-2 + 1e-2 * expected.abs()).all()), f"worst error {error.max().item():.4f}"
    assert error.mean().item() < 2e-3


def test_peaked_attention_matches_float32_sdpa(kernels: native.Kernels) -> None:
    """Queries 20x larger: scores spread by hundreds, so most keys' weights underflow (the kernel hides keys above
    the diagonal with -FLT_MAX and lets 2^x fall to 0 with no clamp) and lanes' maxima move late in the row."""
    kernel = _prefill_kernel(kernels)
    query, *rest = _case([130], [40], 9, 3, 64, 16, True)
    case = ((20 * query.float()).bfloat16(), *rest)
    got = kernel(*case, 16, SCALE)
    expected = _reference(*case, 16)
    assert bool(torch.isfinite(got.float()).all())
    error = (got.float() - expected).abs()
    assert bool((error <= 1e-2 + 1e-2 * expected.abs()).all()), f"worst error {error.max().item():.4f}"


def test_the_kernel_refuses_a_block_table_outside_the_cache(kernels: native.Kernels) -> None:
    kernel = _prefill_kernel(kernels)
    query, key_cache, value_cache, table, token_start, counts, context = _case([10], [0], 4, 2, 64, 4, False)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(query, key_cache, value_cache, table + 1000, token_start, counts, context, 4, SCALE)


PROMPTS = [list(range(3, 80)), [7, 1, 9, 4, 150, 22, 8] * 6]
NEW_TOKENS = 8


def _greedy(runner: TransformersRunner) -> list[int]:
    """Greedy tokens of two prompts: the first prefilled in two chunks, beside the second's whole prompt and then
    beside the second's first decode step (a chunk starting mid-prompt in a step with a decode row); then both
    decoded together."""
    engine = Engine(runner, EngineConfig(max_rows=2, kv_cache_tokens=256, block_size=16), dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for seq_id, prompt in enumerate(PROMPTS):
        engine.add(seq_id, prompt, params)
        assert engine.reserve(seq_id, len(prompt) + NEW_TOKENS)
    first = 30
    tokens = [out.token_id for out in engine.step([(0, first), (1, len(PROMPTS[1]))]).tokens]
    tokens += [out.token_id for out in engine.step([(0, len(PROMPTS[0]) - first), (1, 1)]).tokens]
    for _ in range(NEW_TOKENS - 2):
        tokens += [out.token_id for out in engine.step([(0, 1), (1, 1)]).tokens]
    return tokens


def test_bf16_greedy_through_the_engine_matches_the_sdpa_path(kernels: native.Kernels) -> None:
    _prefill_kernel(kernels)
    # Head size 64 (the kernel's): hidden 256 over 4 query heads, 2 KV heads.
    model = build_tiny_causal_lm("llama", hidden_size=256, intermediate_size=256).to(torch.bfloat16)
    native_runner = TransformersRunner(model, kernel_build=kernels.build, prefill_attention="kernel")
    sdpa_runner = TransformersRunner(model, kernel_build=kernels.build, prefill_attention="sdpa")
    assert native_runner.prefill_kernel is not None and sdpa_runner.prefill_kernel is None
    calls = []
    kernel = native_runner.prefill_kernel

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(args[4].numel())  # rows
        return kernel(*args)

    native_runner.prefill_kernel = counted
    got = _greedy(native_runner)
    assert calls == [2, 2, 1, 1]  # both layers of both prefill steps ran the kernel (the second's one chunk)
    assert got == _greedy(sdpa_runner)


def test_float32_keeps_sdpa(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    assert TransformersRunner(tiny_llama).prefill_kernel is None


@pytest.mark.parametrize("amx", [True, False])
def test_auto_takes_sdpa_where_torch_runs_amx(kernels: native.Kernels, monkeypatch, amx: bool) -> None:  # type: ignore[no-untyped-def]
    _prefill_kernel(kernels)
    monkeypatch.setattr("engine.model.model_runner.torch_runs_amx", lambda: amx)
    model = build_tiny_causal_lm("llama", hidden_size=256, intermediate_size=256).to(torch.bfloat16)
    runner = TransformersRunner(model, kernel_build=kernels.build)
    assert (runner.prefill_kernel is None) == amx


def test_an_unknown_prefill_attention_is_refused(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="prefill_attention='flash'"):
        TransformersRunner(tiny_llama, prefill_attention="flash")


def test_amx_needs_the_flags_under_the_cap_and_the_kernels_grant() -> None:
    amx = frozenset({"avx2", "avx", "fma", "f16c", "bmi1", "bmi2", "movbe", "avx512f", "avx512bw", "avx512vl"})
    amx |= {"avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert not native.torch_runs_amx(features_for("x86_64", amx - {"amx_tile", "amx_bf16"}, None))
    assert not native.torch_runs_amx(features_for("x86_64", amx, "avx512_vnni"))  # the cap hides AMX
    # With the flags, the answer is Linux's: torch asks it for the tile state (granted or not, never assumed).
    assert native.torch_runs_amx(features_for("x86_64", amx, None)) == torch.cpu._init_amx()
