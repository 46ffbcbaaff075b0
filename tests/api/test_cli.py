"""The `batchserve` command line: its flags, its refusals, and a real server process that drains on SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.apps.loading import build_runtime
from api.cli import build_parser, main
from api.config import API_KEY_ENV, ServerConfig
from api.flags import FLAGS_DOC, config_from_args
from engine.model.linear import Linear, onednn_available
from engine.model.model_runner import TransformersRunner
from tests.server_harness import PROMPT, free_port, tiny_loaded_model, wait_until
from tests.toolchain import CAN_BUILD_KERNELS

BATCHSERVE = str(Path(sys.executable).with_name("batchserve"))


def parse_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str, str]:
    """The command line's parse in-process, as `main` runs it first: (exit code, stdout, stderr). Only the
    console-script test and the server process below pay for a new interpreter."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def option_help(help_text: str) -> dict[str, str]:
    """Flag -> its help paragraph, from argparse's `options:` section."""
    section = help_text.split("options:", 1)[1]
    blocks: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        match = re.match(r"^  (--[a-z0-9-]+|-h, --help)", line)
        if match:
            current = match.group(1)
            blocks[current] = line
        elif current is not None:
            blocks[current] += " " + line.strip()
    return {flag: " ".join(text.split()) for flag, text in blocks.items()}


def test_serve_help_lists_every_flag_with_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # the width a command's captured output gets
    code, out, err = parse_cli(["serve", "--help"], capsys)
    assert code == 0, err
    options = option_help(out)
    fields = dataclasses.fields(ServerConfig)
    for field in fields:
        flag = "--" + field.name.replace("_", "-")
        assert flag in options, flag
        assert "(default:" in options[flag], f"{flag} does not show its default: {options[flag]}"
        assert options[flag].count("(default:") == 1, options[flag]
    assert len([f for f in options if f.startswith("--")]) == len(fields) + 1  # and --replicas (scale-out)
    assert "(default: 1, no Ray)" in options["--replicas"]
    assert "(default: continuous)" in options["--mode"] and "{dynamic,continuous,static}" in options["--mode"]
    assert "(default: 8000)" in options["--port"]
    assert "(default: 127.0.0.1)" in options["--host"]
    assert "(default: 50.0)" in options["--batch-timeout-ms"]
    assert "(default: 256)" in options["--max-queue"]


def flags_doc_rows() -> dict[str, tuple[str, str, str]]:
    """docs/flags.md's table: flag -> (default, range, help), as the generated file holds them."""
    rows = {}
    for line in FLAGS_DOC.read_text().splitlines():
        cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        flag = re.match(r"`(--[a-z0-9-]+)`", cells[0]) if len(cells) == 4 else None
        if flag is not None:
            rows[flag.group(1)] = (cells[1], cells[2], cells[3])
    return rows


def test_serve_help_says_what_the_generated_docs_flags_md_says(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --help` (unwrapped) and docs/flags.md come from the same fields: each flag's help, range, default and
    choices read the same in both, so neither can describe a rule the other has dropped."""
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping: a hyphenated word stays whole
    code, out, err = parse_cli(["serve", "--help"], capsys)
    assert code == 0, err
    options = option_help(out)
    rows = flags_doc_rows()
    assert set(rows) == {flag for flag in options if flag.startswith("--")}
    defaults = {"on": "True", "off": "False", "unset": "None"}
    for flag, (default, span, text) in rows.items():
        help_text = options[flag]
        described, _, choices = text.partition(" (one of: ")
        assert described in help_text, f"{flag}: --help says {help_text!r}, docs/flags.md {described!r}"
        assert span in help_text, flag
        value = defaults.get(default, default.strip("`"))
        if "(default:" not in described:  # else the help says what unset means, in both
            assert f"(default: {value}" in help_text or (default == "unset" and "(default: ()" in help_text), flag
        if choices:
            assert "{" + choices.rstrip(")").replace(", ", ",") + "}" in help_text, flag
    assert "measured" in options["--dtype"] and "measured" in options["--quantization"]  # auto is measured


def test_abbreviated_flags_are_refused_not_guessed(capsys: pytest.CaptureFixture[str]) -> None:
    # `compare` has no --mode; argparse's prefix matching used to read it as --model and load "dynamic"
    for argv in (["compare", "--mode", "dynamic"], ["serve", "--max-batch", "3"], ["generate", "--max", "4"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
        assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err, argv


def test_flags_build_the_server_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--mode",
            "dynamic",
            "--max-batch-size",
            "3",
            "--batch-timeout-ms",
            "7.5",
            "--port",
            "0",
            "--cors-origins",
            "http://a",
            "http://b",
        ]
    )
    config = config_from_args(args)
    assert config.mode == "dynamic" and config.max_batch_size == 3 and config.batch_timeout_ms == 7.5
    assert config.cors_origins == ("http://a", "http://b")
    assert config.seats == 3
    assert config.cpu_kernels is True
    assert config_from_args(build_parser().parse_args(["serve", "--no-cpu-kernels"])).cpu_kernels is False


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_cpu_kernels_flag_reaches_the_engine(cpu_kernels: bool) -> None:
    runtime = build_runtime(ServerConfig(cpu_kernels=cpu_kernels), tiny_loaded_model())
    runner = runtime.engine.runner
    assert isinstance(runner, TransformersRunner)
    assert (runner.decode_kernel is not None) == (cpu_kernels and CAN_BUILD_KERNELS)
    qkv_proj = runner.layers[0].qkv_proj
    assert isinstance(qkv_proj, Linear)  # the tiny model's weights are dense, not quantised
    assert (qkv_proj.packed is not None) == (cpu_kernels and onednn_available(runner.device, runner.dtype))


def test_api_key_comes_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config_from_args(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert config_from_args(build_parser().parse_args(["serve", "--api-key", "flag"])).api_key == "flag"


def test_unknown_mode_exits_non_zero_naming_the_choices() -> None:
    # the installed console script, a real process: the entry point itself works
    result = subprocess.run([BATCHSERVE, "serve", "--mode", "bogus"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--mode" in result.stderr and "bogus" in result.stderr
    assert "dynamic" in result.stderr and "continuous" in result.stderr


@pytest.mark.parametrize(
    "argv",
    [("serve", "--max-n", "0"), ("serve", "--batch-timeout-ms", "inf"), ("compare", "--batch-window-ms", "1e-320")],
)
def test_invalid_limit_exits_2_with_one_line_naming_the_flag(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    # the command's parser, before anything loads (tests/api/test_flag_ranges.py walks every flag)
    code, _, err = parse_cli(list(argv), capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"batchserve {argv[0]}: error: argument {argv[1]}: ")
    assert "Traceback" not in err


def test_missing_subcommand_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = parse_cli([], capsys)
    assert code not in (0, None) and "serve" in err


# ----- a real server process -----
def health_status(base_url: str) -> int | None:
    """/health's status, or None when nothing listens any more."""
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


@pytest.fixture
def server_process(tiny_checkpoint: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "api",
            "serve",
            "--model",
            str(tiny_checkpoint),
            "--port",
            str(port),
            "--mode",
            "continuous",
            "--shutdown-grace-s",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert process.poll() is None, f"the server exited early:\n{process.stdout.read()}"  # type: ignore[union-attr]
            try:
                return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, "the server process to become healthy", timeout_s=120)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.slow
def test_sigterm_lets_the_running_stream_finish_then_exits_zero(
    server_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, base_url = server_process
    model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    assert model.startswith("tiny-checkpoint")  # the checkpoint directory's name
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True, "logprobs": 0}
    events = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        events.append(first)
        process.send_signal(signal.SIGTERM)
        # Draining (once the signal is handled): no new work is accepted, 503 or the listener is closed.
        wait_until(lambda: health_status(base_url) != 200, "the server to stop reporting healthy")
        assert health_status(base_url) in (503, None)
        events.extend(line for line in lines if line)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"  # it ran to its end, not aborted
    assert final["usage"]["completion_tokens"] == 60
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"]) == 60
    assert process.wait(60) == 0
    output = process.stdout.read() if process.stdout is not None else ""
    assert "batchserve ready on" in output
    # the server owns its process: what loading built is out of the garbage collector's reach (api.runtime.heap)
    frozen = re.search(r"heap frozen: ([\d,]+) objects", output)
    assert frozen is not None and int(frozen.group(1).replace(",", "")) > 10_000
    assert health_status(base_url) is None


def test_a_model_that_fails_to_load_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # in-process: the same path as the command, without a new interpreter
        main(["serve", "--model", str(tmp_path / "missing"), "--port", str(free_port())])
    assert exited.value.code not in (0, None)
    assert "could not be loaded" in str(exited.value.code)
    assert "failed to load the model" in capsys.readouterr().err
