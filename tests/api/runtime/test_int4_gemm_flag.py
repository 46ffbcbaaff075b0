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
from api.runtime.format_choice import gemm_steps
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.linear import RowSwitchedLinear, gemm_without_dense_copy
from engine.model.model_runner import TransformersRunner
from engine.platform import native
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import load_model
from tests.engine.helpers import count_int4_gemm_calls
from tests.server_harness import mode_config, model_name, running_server


def test_int4_gemm_serves_past_the_row_switch_with_no_dense_copy(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RuntimeOptions(int4_gemm="all") through build_runner, as `serve --int4-gemm all` builds it: every int4 projection
    keeps no dense copy, a 12-row prefill (past the switch of 2) runs int4_gemm in every layer, decode steps run
    int4_dot, and the greedy tokens match a runner that prefills through int4_gemm with its dense copy kept."""
    calls = count_int4_gemm_calls(monkeypatch)
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    options = RuntimeOptions(quantization="int4", dtype="float32", max_quantized_rows=2, int4_gemm="all")
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


def test_except_qkv_keeps_the_dense_copy_of_the_attention_input_alone(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--int4-gemm except-qkv`: the fused q/k/v projection keeps its dense copy and runs a 12-row prefill on it; the
    output projection and both MLP projections keep none and run it on int4_gemm, three calls a layer."""
    calls = count_int4_gemm_calls(monkeypatch)
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    options = RuntimeOptions(quantization="int4", dtype="float32", max_quantized_rows=2, int4_gemm="except-qkv")
    runner = build_runner(options, loaded)
    for layer in runner.layers:
        linears = TransformersRunner.layer_linears(layer)
        assert all(isinstance(linear, RowSwitchedLinear) for linear in linears)
        qkv, *others = linears
        assert isinstance(qkv, RowSwitchedLinear) and qkv.dense is not None
        assert all(isinstance(linear, RowSwitchedLinear) and linear.dense is None for linear in others)
    engine = Engine(runner, EngineConfig(max_rows=2, kv_cache_tokens=64, block_size=4), dtype=torch.float32)
    engine.add(0, list(range(1, 13)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.reserve(0, 16)
    assert len(engine.step([(0, 12)]).tokens) == 1
    assert calls == [12] * (3 * len(runner.layers))


@pytest.mark.parametrize(
    ("scope", "names", "expected"),
    [
        ("off", ["model.layers.0.mlp.down_proj"], False),
        ("all", ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"], True),
        ("except-qkv", ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.v_proj"], False),
        ("except-qkv", ["model.layers.3.self_attn.o_proj"], True),
        ("except-qkv", ["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"], True),
    ],
)
def test_which_projections_each_scope_takes_off_their_dense_copy(scope: str, names: list[str], expected: bool) -> None:
    assert gemm_without_dense_copy(scope, names) is expected


@pytest.mark.parametrize(
    ("option", "measured", "switch", "expected"),
    [
        ("auto", None, 16, ("off", None)),  # nothing measured (no probe, or one digit never won)
        ("auto", 17, 16, ("all", None)),  # every step past the switch: no dense copy
        ("auto", 33, 16, ("off", 33)),  # the dense copy from 17 to 32 rows, one digit from 33
        ("auto", 5, None, ("off", None)),  # no row switch: every step quantised
        ("off", 17, 16, ("off", None)),
        ("except-qkv", None, 16, ("except-qkv", None)),
    ],
)
def test_auto_takes_the_one_digit_steps_the_probe_measured(
    option: str, measured: int | None, switch: int | None, expected: tuple[str, int | None]
) -> None:
    assert gemm_steps(option, measured, switch) == expected


def test_a_measured_one_digit_start_runs_prompts_on_int4_gemm_with_no_dense_copy(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default options on weights `auto` measured with one digit from right past the switch (as load_auto returns
    them): no dense copy, and a 12-row prefill on int4_gemm in every layer; with `--int4-gemm off`, the dense copy."""
    kernels = native.load_kernels()
    if kernels is None or not kernels.has_int4_dot:
        pytest.skip("no build with integer dot products here (the probe measures no one-digit steps there)")
    calls = count_int4_gemm_calls(monkeypatch)
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4").with_row_switch(2, 3)
    for option, gemm in (("auto", True), ("off", False)):
        runner = build_runner(RuntimeOptions(quantization="int4", dtype="float32", int4_gemm=option), loaded)
        switched = [
            linear
            for layer in runner.layers
            for linear in TransformersRunner.layer_linears(layer)
            if isinstance(linear, RowSwitchedLinear)
        ]
        assert switched and all((linear.dense is None) is gemm for linear in switched)
        calls.clear()
        engine = Engine(runner, EngineConfig(max_rows=2, kv_cache_tokens=64, block_size=4), dtype=torch.float32)
        engine.add(0, list(range(1, 13)), SamplingParams(max_tokens=2, temperature=0.0))
        engine.reserve(0, 16)
        assert len(engine.step([(0, 12)]).tokens) == 1
        assert (set(calls) == {12}) is gemm


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("scope", ["all", "except-qkv"])
def test_int4_gemm_with_weights_that_are_not_int4_is_refused_naming_the_flag(quantization: str, scope: str) -> None:
    with pytest.raises(ValueError, match=rf"^int4_gemm needs int4 weights .*got quantization '{quantization}'$"):
        ServerConfig(int4_gemm=scope, quantization=quantization)
    with pytest.raises(ValueError, match=r"^int4_gemm needs int4 weights"):
        RuntimeOptions(int4_gemm=scope, quantization=quantization)
    assert ServerConfig(int4_gemm=scope).runtime_options().int4_gemm == scope  # auto may choose int4


def test_an_unknown_scope_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"^int4_gemm must be one of auto, off, except-qkv, all; got 'qkv'$"):
        RuntimeOptions(int4_gemm="qkv")
    with pytest.raises(ValueError, match=r"^int4_gemm must be one of"):
        gemm_without_dense_copy("on", [])


def test_the_serve_flag_sets_int4_gemm_and_a_bad_pairing_exits_with_one_line() -> None:
    for scope in ("all", "except-qkv", "off", "auto"):
        assert config_from_args(build_parser().parse_args(["serve", "--int4-gemm", scope])).int4_gemm == scope
    assert config_from_args(build_parser().parse_args(["serve"])).int4_gemm == "auto"
    result = subprocess.run(
        [sys.executable, "-m", "api", "serve", "--int4-gemm", "all", "--quantization", "none"],
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
    """The real app under uvicorn, `--int4-gemm all` on a tiny int4 model: the runner it built holds no dense copy,
    and a prompt longer than the row switch (a prefill step on int4_gemm) is answered."""
    kernels = native.load_kernels()
    if kernels is None or not kernels.has_int4_dot:
        pytest.skip("no build with integer dot products here")
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    config = mode_config("continuous", int4_gemm="all", dtype="float32", quantization="int4")
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
