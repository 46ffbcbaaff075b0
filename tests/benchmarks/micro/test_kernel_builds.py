"""The per-build kernel timings: every build this CPU can execute gets every kernel it has, decode attention
included, and the attention case is a valid paged cache the kernel agrees with torch on."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.micro import kernel_builds
from engine.platform import native
from engine.platform.cpu_features import cpu_features

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="the kernels need a C++ compiler")


@pytest.mark.slow
def test_every_build_reports_every_kernel_it_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_builds, "median_us", lambda call, repeats=50: (call(), 1.0)[1])
    assert kernel_builds.main(["--out", str(tmp_path)]) == 0
    table = json.loads((tmp_path / "result.json").read_text())["median_us"]
    builds = native.builds_for(cpu_features())
    assert list(table) == [build.name for build in builds]
    expected = {"decode_attention bf16 1 rows", "decode_attention bf16 32 rows", "silu_mul bf16 16 rows"}
    small = ("add_rms_norm bf16", "rope_write_cache bf16", "argmax_rows f32", "prompt_scores f32")
    expected |= {f"{op} 16 rows" for op in small}
    for build in builds:
        times = table[build.name]
        assert expected <= set(times), build.name
        assert ("int4_dot bf16 16 rows" in times) == native.load_kernels(build).has_int4_dot


def test_the_attention_case_matches_torch_softmax_attention() -> None:
    query, keys, values, table, lengths = kernel_builds.attention_case(3)
    kernels = native.load_kernels()
    scale = kernel_builds.HEAD_DIM**-0.5
    got = kernels.ops.paged_decode_attention(query, keys, values, table, lengths, kernel_builds.BLOCK_SIZE, scale)
    group = kernel_builds.HEADS // kernel_builds.KV_HEADS
    for row in range(3):
        slots = torch.cat(
            [torch.arange(b * kernel_builds.BLOCK_SIZE, (b + 1) * kernel_builds.BLOCK_SIZE) for b in table[row]]
        )[: lengths[row]]
        k = keys[:, slots].float().repeat_interleave(group, dim=0)  # [heads, context, dim]
        v = values[:, slots].float().repeat_interleave(group, dim=0)
        q = query[row].float().unsqueeze(1)  # [heads, 1, dim]
        expected = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1) @ v
        torch.testing.assert_close(got[row].float(), expected.squeeze(1), rtol=4e-3, atol=4e-3)
