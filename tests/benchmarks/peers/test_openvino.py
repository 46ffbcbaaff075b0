"""OpenVINO GenAI peer: the venv's build steps and pins, the export's arguments and cache, and the probe's worker
protocol (driven through the real worker script against a stand-in `openvino_genai`; no OpenVINO install)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.peers import openvino, openvino_client, openvino_probe
from benchmarks.peers.openvino_client import OpenVinoWorker, ProbeError, parse_reply
from benchmarks.peers.openvino_probe import ProbeConfig, Sample


def _reply(**changes: object) -> str:
    doc: dict[str, object] = {
        "input_tokens": [64, 64],
        "generated_tokens": [8, 8],
        "ttft_ms": 30.0,
        "tpot_ms": 4.0,
        "throughput_tok_s": 240.0,
        "generate_ms": 60.0,
        "step_ms": [30.0, 8.0, 8.0],
        "batch_sizes": [2, 2, 2],
        "wall_ms": 61.0,
    }
    doc.update(changes)
    return json.dumps(doc)


def test_build_steps_install_the_cpu_torch_first_then_the_pins_under_constraints(tmp_path: Path) -> None:
    cache = openvino.OpenVinoCache(tmp_path / "ov", "9.9")
    steps = openvino.build_steps(cache, "/usr/bin/python3")
    pip = [str(cache.python), "-m", "pip"]
    constrained = [*pip, "install", "-c", str(cache.constraints)]
    assert steps[0] == ["/usr/bin/python3", "-m", "venv", "--clear", str(cache.venv)]
    assert steps[2] == [*constrained, "torch==2.13.0"]
    assert steps[3] == [*constrained, *openvino.PINNED]
    assert steps[-1] == [*pip, "uninstall", "-y", "torchvision"]
    assert all("==" in pin for pin in openvino.PINNED)
    assert {"openvino-genai", "optimum-intel[openvino]", "nncf"} <= {p.split("==")[0] for p in openvino.PINNED}
    lines = openvino.constraint_lines()
    assert lines[0] == "torch==2.13.0" and not any("[" in line for line in lines)
    assert "optimum-intel==2.2.0" in lines


def test_build_writes_constraints_marks_the_venv_last_and_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = openvino.OpenVinoCache(tmp_path / "ov")
    ran: list[list[str]] = []

    def fake_run(step: list[str], check: bool) -> None:
        assert check and not cache.marker.exists() and cache.constraints.is_file()
        ran.append(step)
        if "venv" in step:
            cache.python.parent.mkdir(parents=True)
            cache.python.write_text("")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert openvino.build(cache, "py") == cache.python and cache.is_built()
    assert ran == openvino.build_steps(cache, "py")
    assert cache.constraints.read_text().splitlines() == openvino.constraint_lines()
    ran.clear()
    assert openvino.build(cache, "py") == cache.python and ran == []


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A GGUF whose float32 checkpoint is already in a temporary batchserve cache."""
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"gguf")
    checkpoint = openvino.gguf_checkpoint_dir(gguf)
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    return gguf


def test_export_runs_optimum_cli_into_a_partial_folder_then_renames_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = openvino.default_cache()
    ran: list[list[str]] = []

    def fake_run(argv: list[str], check: bool, env: dict[str, str]) -> None:
        assert check and env["HF_HUB_OFFLINE"] == "1"
        ran.append(argv)
        out = Path(argv[-1])
        assert out.name.endswith(".partial")
        out.mkdir(parents=True)
        (out / "openvino_model.xml").write_text("")
        (out / "openvino_tokenizer.xml").write_text("")

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = openvino.export(cache, model, "int4")
    assert out == cache.root / "models" / "SmolLM2-135M-Instruct-int4" and openvino.is_exported(out)
    (argv,) = ran
    checkpoint = str(openvino.gguf_checkpoint_dir(model))
    assert argv[:5] == [str(cache.optimum_cli), "export", "openvino", "--model", checkpoint]
    assert argv[5:11] == ["--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "32"]
    assert "--sym" not in argv  # asymmetric, as the notes say
    assert openvino.export(cache, model, "int4") == out and len(ran) == 1  # exported once
    fp32 = openvino.export_argv(cache, Path("ckpt"), "fp32", Path("out"))
    assert fp32[-4:] == ["text-generation-with-past", "--weight-format", "fp32", "out"]
    with pytest.raises(ValueError, match="unknown weight format"):
        cache.model_dir(model, "int3")


def test_paths_command_prints_the_venv_and_both_models(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(openvino, "default_model_path", lambda: model)
    assert openvino.main(["paths"]) == 0
    paths = json.loads(capsys.readouterr().out)
    root = openvino.default_cache().root
    assert paths["python"] == str(root / "venv" / "bin" / "python") and paths["built"] is False
    assert paths["models"] == {f: str(root / "models" / f"SmolLM2-135M-Instruct-{f}") for f in ("int4", "fp32")}
    assert paths["exported"] == {"int4": False, "fp32": False}
    assert paths["checkpoint"] == str(openvino.gguf_checkpoint_dir(model))


def test_worker_argv_isolates_the_venv_and_threads_default_to_the_cores() -> None:
    props = openvino_client.ov_properties(["INFERENCE_PRECISION_HINT=f32"], threads=2)
    assert props == [("INFERENCE_NUM_THREADS", "2"), ("INFERENCE_PRECISION_HINT", "f32")]
    assert openvino_client.ov_properties(["INFERENCE_NUM_THREADS=1"], threads=2) == [("INFERENCE_NUM_THREADS", "1")]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        openvino_client.ov_properties(["oops"], threads=2)
    argv = openvino_client.worker_argv(Path("/v/bin/python"), Path("/m/int4"), props)
    assert argv == [
        "/v/bin/python",
        "-I",
        str(openvino_client.WORKER),
        "/m/int4",
        "--property",
        "INFERENCE_NUM_THREADS=2",
        "--property",
        "INFERENCE_PRECISION_HINT=f32",
    ]


def test_parse_reply_reads_the_metrics_and_checks_what_was_asked() -> None:
    reply = parse_reply(_reply(), prompts=2, prompt_tokens=64, tokens=8)
    assert reply.tpot_ms == 4.0 and reply.decode_tok_s == 250.0 and reply.step_ms == (30.0, 8.0, 8.0)
    with pytest.raises(ProbeError, match="saw prompts of \\(64, 63\\)"):
        parse_reply(_reply(input_tokens=[64, 63]), 2, 64, 8)
    with pytest.raises(ProbeError, match="generated \\(8, 7\\) tokens"):
        parse_reply(_reply(generated_tokens=[8, 7]), 2, 64, 8)
    with pytest.raises(ProbeError, match="worker failed: boom"):
        parse_reply(json.dumps({"error": "boom"}), 2, 64, 8)
    with pytest.raises(ProbeError, match="other than JSON"):
        parse_reply("Segmentation fault", 2, 64, 8)
    with pytest.raises(ProbeError, match="lacks 'tpot_ms'"):
        parse_reply(json.dumps({k: v for k, v in json.loads(_reply()).items() if k != "tpot_ms"}), 2, 64, 8)
    with pytest.raises(ProbeError, match=r"TPOT of 0\.0"):
        parse_reply(_reply(tpot_ms=0.0), 2, 64, 8)


def test_the_worker_imports_only_openvino_genai_and_the_standard_library() -> None:
    tree = ast.parse(openvino_client.WORKER.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            imported.add(node.module.split(".")[0])
    assert "openvino_genai" in imported
    assert {m for m in imported - {"openvino_genai"} if m not in sys.stdlib_module_names} == set()


# A stand-in for openvino_genai with the surface the worker uses: a word tokenizer and a pipeline that "generates"
# the tokens asked and reports fixed metrics.
_FAKE_GENAI = """
class _Mean:
    def __init__(self, mean): self.mean = mean
class _Shape:
    def __init__(self, rows, cols): self.shape = [rows, cols]
class _Encoded:
    def __init__(self, texts): self.input_ids = _Shape(len(texts), max(len(t.split()) for t in texts))
class Tokenizer:
    def encode(self, texts, add_special_tokens=True):
        assert add_special_tokens is False
        return _Encoded([texts] if isinstance(texts, str) else texts)
class _Config: pass
class _Raw:
    token_infer_durations = [20000.0, 5000.0]
    m_batch_sizes = [2, 2]
class _Metrics:
    raw_metrics = _Raw()
    def get_ttft(self): return _Mean(20.0)
    def get_tpot(self): return _Mean(2.5)
    def get_throughput(self): return _Mean(400.0)
    def get_generate_duration(self): return _Mean(30.0)
class _Result:
    def __init__(self, rows, tokens): self.tokens, self.perf_metrics = [[7] * tokens] * rows, _Metrics()
class LLMPipeline:
    def __init__(self, model_dir, device, **properties):
        assert device == "CPU" and properties == {"INFERENCE_NUM_THREADS": 2, "KV_CACHE_PRECISION": "u8"}
    def get_tokenizer(self): return Tokenizer()
    def get_generation_config(self): return _Config()
    def generate(self, inputs, config):
        assert config.min_new_tokens == config.max_new_tokens and config.ignore_eos and not config.do_sample
        return _Result(inputs.input_ids.shape[0], config.max_new_tokens)
def get_version(): return "fake"
"""


def test_the_worker_answers_the_probe_line_by_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "openvino_genai.py").write_text(textwrap.dedent(_FAKE_GENAI))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child inherits it
    props = [("INFERENCE_NUM_THREADS", "2"), ("KV_CACHE_PRECISION", "u8")]
    # The real argv, less -I, so that the stand-in on PYTHONPATH is the openvino_genai imported.
    argv = [a for a in openvino_client.worker_argv(Path(sys.executable), tmp_path / "m", props) if a != "-I"]
    with (tmp_path / "worker.log").open("w") as log, OpenVinoWorker(argv, log) as worker:
        assert worker.ready["version"] == "fake" and worker.ready["properties"]["INFERENCE_NUM_THREADS"] == 2
        reply = worker.generate(["a b c", "d e f"], prompt_tokens=3, tokens=5)
        assert reply.generated_tokens == (5, 5) and reply.decode_tok_s == 400.0 and reply.step_ms == (20.0, 5.0)
        with pytest.raises(ProbeError, match="different lengths"):
            worker.generate(["a b c", "d e"], prompt_tokens=3, tokens=5)
        with pytest.raises(ProbeError, match="saw prompts of \\(3,\\) tokens, batchserve 4"):
            worker.generate(["a b c"], prompt_tokens=4, tokens=5)
    assert (tmp_path / "worker.log").read_text() == ""


def test_rounds_alternate_which_side_goes_first_and_ratios_are_per_round() -> None:
    calls: list[str] = []
    values = {"openvino": iter([10.0, 100.0, 200.0, 20.0, 100.0, 400.0]), "batchserve": iter([5.0, 200.0, 300.0] * 2)}

    def side(name: str):  # type: ignore[no-untyped-def]
        def measure(figure: str) -> float:
            calls.append(f"{name}:{figure}")
            return next(values[name])

        return measure

    rounds = openvino_probe.run_rounds(ProbeConfig(rounds=2), side("openvino"), side("batchserve"))
    assert calls[:2] == ["openvino:batch1_ms_per_token", "batchserve:batch1_ms_per_token"]
    assert calls[6:8] == ["batchserve:batch1_ms_per_token", "openvino:batch1_ms_per_token"]
    assert rounds[0]["openvino"] == Sample(10.0, 100.0, 200.0)
    summary = openvino_probe.summarise(rounds)
    assert summary["batch1_ms_per_token"] == {"openvino": 15.0, "batchserve": 5.0, "batchserve_over_openvino": 0.375}
    assert summary["long_prompt_ttft_ms"]["batchserve_over_openvino"] == pytest.approx((1.5 + 0.75) / 2)
    table = openvino_probe.format_table(summary, 32, 1024)
    assert "| batch 32 decode (tok/s) | 100.0 | 200.0 | 2.00x (higher is better) |" in table


class _WordTokenizer:
    """Every word one token, except "xx", which is two: cutting inside it does not round-trip."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for word in text.split() for w in ([word[:1], word[1:]] if word == "xx" else [word])]

    def decode(self, ids: list[int]) -> str:
        return " ".join("y" * i for i in ids)


def test_exact_text_finds_a_prefix_of_exactly_the_length_asked() -> None:
    tokenizer = _WordTokenizer()
    assert tokenizer.encode(openvino_probe.exact_text(tokenizer, "aa bbb c dd e", 3)) == [2, 3, 1]
    with pytest.raises(ValueError, match="exactly 9 tokens"):
        openvino_probe.exact_text(tokenizer, "aa bbb", 9)


def test_probe_config_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(ValueError):
        ProbeConfig(batch=1)
    with pytest.raises(ValueError):
        ProbeConfig(prompt_tokens=64, long_prompt_tokens=32)


def test_probe_without_a_build_says_how_to_build(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(openvino_probe, "default_model_path", lambda: model)
    assert openvino_probe.main(["--rounds", "1"]) == 1
    assert "run `python -m benchmarks openvino-build build`" in capsys.readouterr().err


def test_probe_takes_an_int4_gemm_scope_and_refuses_an_unknown_one(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--int4-gemm except-qkv` puts batchserve on OpenVINO's own trade (int8 activations past the row switch)."""
    monkeypatch.setattr(openvino_probe, "default_model_path", lambda: model)
    assert openvino_probe.main(["--int4-gemm", "except-qkv", "--rounds", "1"]) == 1  # parsed; then: not built
    with pytest.raises(SystemExit):
        openvino_probe.main(["--int4-gemm", "qkv"])
    assert "invalid choice: 'qkv'" in capsys.readouterr().err
