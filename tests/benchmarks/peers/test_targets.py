"""A/B targets, server launch settings and the A/B CLI's own parsing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from benchmarks.loadgen.client import EosPolicy
from benchmarks.loadgen.flags import parse_rates
from benchmarks.loadgen.server_proc import LaunchConfig, free_port
from benchmarks.online import ab
from benchmarks.peers import targets
from benchmarks.peers.hf_export import default_export_dir, export, is_exported
from benchmarks.peers.targets import ServerSettings, Target, Unavailable, baseline_targets, batchserve_target


def test_both_modes_get_the_same_seats() -> None:
    settings = ServerSettings(seats=8, batch_timeout_ms=20, max_queue=64)
    dyn = batchserve_target("dynamic", "dynamic", settings)
    cont = batchserve_target("continuous", "continuous", settings)
    for target in (dyn, cont):
        argv = list(target.argv)
        assert argv[:4] == [sys.executable, "-m", "api", "serve"]
        assert argv[argv.index("--max-batch-size") + 1] == "8"
        assert argv[argv.index("--max-num-seqs") + 1] == "8"
        assert argv[argv.index("--batch-timeout-ms") + 1] == "20"
        assert argv[argv.index("--max-queue") + 1] == "64"
        assert "--model" not in argv  # batchserve's default model
        assert target.eos_policy is EosPolicy.IGNORE_EOS
    assert dyn.argv[dyn.argv.index("--mode") + 1] == "dynamic"
    assert cont.argv[cont.argv.index("--mode") + 1] == "continuous"


def test_nobatch_baseline_is_dynamic_with_one_seat() -> None:
    target = batchserve_target("nobatch", "dynamic", ServerSettings(seats=8, model="/m"), seats=1)
    argv = list(target.argv)
    assert argv[argv.index("--max-batch-size") + 1] == "1"
    assert argv[argv.index("--model") + 1] == "/m"


def test_baselines_resolve_to_a_target_or_a_reason() -> None:
    found = baseline_targets(("transformers", "transformers-cb", "llama-server"), ServerSettings())
    assert [item.name for item in found] == ["transformers", "transformers-cb", "llama-server"]
    for item in found:
        assert isinstance(item, Target | Unavailable)
        if isinstance(item, Unavailable):
            assert item.reason
        elif item.name.startswith("transformers"):
            assert item.argv[1] == "serve"
            assert item.eos_policy is EosPolicy.HF_MIN_NEW_TOKENS  # it rejects ignore_eos
            assert ("--continuous-batching" in item.argv) == (item.name == "transformers-cb")
    with pytest.raises(ValueError, match="unknown baseline 'vllm'"):
        baseline_targets(("vllm",), ServerSettings())


def test_launch_config_fills_host_and_port() -> None:
    config = LaunchConfig(argv=("srv", "--host", "{host}", "--port", "{port}"))
    assert config.command(1234) == ["srv", "--host", "127.0.0.1", "--port", "1234"]
    assert 0 < free_port() < 65536
    with pytest.raises(ValueError, match="argv must not be empty"):
        LaunchConfig(argv=())


def test_rate_and_baseline_lists() -> None:
    assert parse_rates("0.5,1,2,inf") == (0.5, 1.0, 2.0, math.inf)
    with pytest.raises(ValueError, match="--sweep-rates needs positive numbers"):
        parse_rates("1,0")
    assert ab.parse_baselines("none") == ()
    assert ab.parse_baselines("nobatch, llama-server") == ("nobatch", "llama-server")
    with pytest.raises(ValueError, match=r"unknown baselines \['vllm'\]"):
        ab.parse_baselines("nobatch,vllm")


def test_cli_rejects_bad_flags_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    # Each refusal is checked on its own: one shared stderr check would pass if only one of them said why.
    with pytest.raises(SystemExit) as exited:
        ab.main(["--out", "x", "--seats", "0"])
    assert exited.value.code == 2 and "seats must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        ab.main(["--out", "x", "--sweep-rates", "1,-2"])
    assert exited.value.code == 2 and "--sweep-rates needs positive numbers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seats": 0}, "seats must be >= 1"),
        ({"batch_timeout_ms": -1.0}, "batch_timeout_ms must be >= 0"),
        ({"max_queue": 0}, "max_queue must be >= 1"),
    ],
)
def test_invalid_server_settings(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerSettings(**kwargs)  # type: ignore[arg-type]


def test_batchserve_device_is_passed_through() -> None:
    argv = list(batchserve_target("continuous", "continuous", ServerSettings(device="cuda")).argv)
    assert argv[argv.index("--device") + 1] == "cuda"


def test_transformers_baseline_serves_an_exported_folder_for_a_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers serve cannot load GGUF itself, so a GGUF model gets a one-off export step first.
    monkeypatch.setattr(targets, "_TRANSFORMERS_SERVE_MODULES", ())
    gguf = tmp_path / "tiny-test-model-that-is-never-exported.gguf"
    gguf.write_bytes(b"")
    found = baseline_targets(("transformers",), ServerSettings(model=str(gguf)))[0]
    if isinstance(found, Unavailable):  # no transformers CLI on this machine
        assert "transformers" in found.reason
        return
    export_dir = str(default_export_dir(gguf))
    assert found.argv[2] == export_dir
    assert found.prepare == (sys.executable, "-m", "benchmarks", "hf-export", str(gguf), export_dir)


def test_export_is_skipped_when_the_folder_exists(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert is_exported(tmp_path)
    assert export(tmp_path / "missing.gguf", tmp_path) == tmp_path  # nothing loaded, nothing written


def test_a_target_with_prefix_caching_off_passes_the_flag_and_says_so() -> None:
    on = batchserve_target("continuous", "continuous", ServerSettings())
    off = batchserve_target("continuous-nocache", "continuous", ServerSettings(enable_prefix_caching=False))
    assert "--no-enable-prefix-caching" not in on.argv
    assert off.argv[-1] == "--no-enable-prefix-caching" and "no prefix caching" in off.note
