"""`serve --int4-gemm` (api.config's int4_gemm): int4 projections keep no dense copy and run steps past the row
switch on int4_gemm (engine/csrc/int4_gemm.cpp), through the options and runner the server builds; and the
pairings it refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from api.cli import build_parser
from api.config import RuntimeOptions, ServerConfig
from api.flags import config_from_args
from api.runtime.build import build_runner
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.linear import RowSwitchedLinear
from engine.model.model_runner import TransformersRunner
from engine.platform import native
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import load_model
from tests.engine.helpers import count_int4_gemm_calls
from tests.server_harness import mode_config, model_name, running_server


def test_int4_gemm_serves_past_the_row_switch_with_no_dense_copy(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RuntimeOptions(int4_gemm=True) through build_runner, as `serve --int4-gemm` builds it: every int4 projection
    keeps no dense copy, a 12-row prefill (past the switch of 2) runs int4_gemm in every layer, decode steps run
    int4_dot, and the greedy tokens match a runner that prefills through int4_gemm with its dense copy kept."""
    calls = count_int4_gemm_calls(monkeypatch)
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    options = RuntimeOptions(quantization="int4", dtype="float32", max_quantized_rows=2, int4_gemm=True)
    runners = {
        "no dense copy": build_runner(options, loaded),
        "dense copy kept": TransformersRunner(
            loaded.model, quantized=loaded.quantized, max_quantized_rows=2, min_gemm_rows=3
        ),
    }
    switched = [
        linear
        for layer in runners["no dense copy"].layers
        for linear in TransformersRunner.layer_linears(layer)
        if isinstance(linear, RowSwitchedLinear)
    ]
    assert switched and all(linear.dense is None for linear in switched)
    tokens = {}
    for label, runner in runners.items():
        calls.clear()
        engine = Engine(runner, EngineConfig(max_rows=2, kv_cache_tokens=64, block_size=4), dtype=torch.float32)
        engine.add(0, list(range(1, 13)), SamplingParams(max_tokens=4, temperature=0.0))
        engine.reserve(0, 16)
        tokens[label] = [t.token_id for t in engine.step([(0, 12)]).tokens]
        for _ in range(3):
            tokens[label] += [t.token_id for t in engine.step([(0, 1)]).tokens]
        assert set(calls) == {12} and len(calls) >= len(runner.layers)
    assert len(tokens["no dense copy"]) == 4 and tokens["no dense copy"] == tokens["dense copy kept"]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_int4_gemm_with_weights_that_are_not_int4_is_refused_naming_the_flag(quantization: str) -> None:
    with pytest.raises(ValueError, match=rf"^int4_gemm needs int4 weights .*got quantization '{quantization}'$"):
        ServerConfig(int4_gemm=True, quantization=quantization)
    with pytest.raises(ValueError, match=r"^int4_gemm needs int4 weights"):
        RuntimeOptions(int4_gemm=True, quantization=quantization)
    assert ServerConfig(int4_gemm=True).runtime_options().int4_gemm is True  # auto may choose int4


def test_the_serve_flag_sets_int4_gemm_and_a_bad_pairing_exits_with_one_line() -> None:
    assert config_from_args(build_parser().parse_args(["serve", "--int4-gemm"])).int4_gemm is True
    assert config_from_args(build_parser().parse_args(["serve"])).int4_gemm is False
    result = subprocess.run(
        [sys.executable, "-m", "api", "serve", "--int4-gemm", "--quantization", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    # The last line (a log line about the CPU may come first), and only one line of it: no traceback.
    assert result.stderr.strip().splitlines()[-1] == (
        "batchserve: int4_gemm needs int4 weights (quantization int4 or auto); got quantization 'none'"
    )
    assert result.stderr.count("int4_gemm") == 1


def test_a_server_with_int4_gemm_answers_a_long_prompt_from_int4_weights_alone(tiny_checkpoint: Path) -> None:
    """The real app under uvicorn, `--int4-gemm` on a tiny int4 model: the runner it built holds no dense copy,
    and a prompt longer than the row switch (a prefill step on int4_gemm) is answered."""
    kernels = native.load_kernels()
    if kernels is None or not kernels.has_int4_dot:
        pytest.skip("no build with integer dot products here")
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    config = mode_config("continuous", int4_gemm=True, dtype="float32", quantization="int4")
    with running_server(config, loaded) as server:
        runner = server.runtime.engine.runner
        assert all(
            linear.dense is None
            for layer in runner.layers
            for linear in TransformersRunner.layer_linears(layer)
            if isinstance(linear, RowSwitchedLinear)
        )
        body = {"model": model_name(server), "prompt": list(range(1, 40)), "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (39, 4)
