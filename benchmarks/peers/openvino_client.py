"""The probe's side of the OpenVINO worker (`openvino_worker.py`): its command line, and one JSON line out and one
back per measurement, checked against what was asked."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

WORKER = Path(__file__).with_name("openvino_worker.py")


class ProbeError(RuntimeError):
    """The worker failed, or answered something other than what was asked."""


@dataclass(frozen=True)
class OvReply:
    """One worker answer: OpenVINO's own perf metrics for one generate() of a batch."""

    input_tokens: tuple[int, ...]
    generated_tokens: tuple[int, ...]
    ttft_ms: float
    tpot_ms: float  # per output token after the first, across the batch
    throughput_tok_s: float
    generate_ms: float
    step_ms: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    wall_ms: float

    @property
    def decode_tok_s(self) -> float:
        return 1000.0 / self.tpot_ms


def parse_reply(line: str, prompts: int, prompt_tokens: int, tokens: int) -> OvReply:
    """A worker's answer to `prompts` prompts of `prompt_tokens` tokens, `tokens` generated each, checked."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProbeError(f"the worker answered something other than JSON: {line[:200]!r}") from exc
    if not isinstance(doc, dict):
        raise ProbeError(f"the worker answered {doc!r}")
    if "error" in doc:
        raise ProbeError(f"the worker failed: {doc['error']}")
    try:
        reply = OvReply(
            input_tokens=tuple(int(n) for n in doc["input_tokens"]),
            generated_tokens=tuple(int(n) for n in doc["generated_tokens"]),
            ttft_ms=float(doc["ttft_ms"]),
            tpot_ms=float(doc["tpot_ms"]),
            throughput_tok_s=float(doc["throughput_tok_s"]),
            generate_ms=float(doc["generate_ms"]),
            step_ms=tuple(float(s) for s in doc["step_ms"]),
            batch_sizes=tuple(int(b) for b in doc["batch_sizes"]),
            wall_ms=float(doc["wall_ms"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProbeError(f"the worker's answer lacks {exc}: {line[:200]!r}") from exc
    if reply.input_tokens != (prompt_tokens,) * prompts:
        raise ProbeError(f"OpenVINO saw prompts of {reply.input_tokens} tokens, batchserve {prompt_tokens} each")
    if reply.generated_tokens != (tokens,) * prompts:
        raise ProbeError(f"OpenVINO generated {reply.generated_tokens} tokens, not {tokens} each")
    if tokens > 1 and not reply.tpot_ms > 0:
        raise ProbeError(f"OpenVINO reported a TPOT of {reply.tpot_ms} ms")
    return reply


def worker_argv(python: Path, model_dir: Path, properties: Sequence[tuple[str, str]]) -> list[str]:
    """`-I`: the venv's own packages only, whatever PYTHONPATH this process runs with."""
    argv = [str(python), "-I", str(WORKER), str(model_dir)]
    for key, value in properties:
        argv += ["--property", f"{key}={value}"]
    return argv


def ov_properties(extra: Sequence[str], threads: int) -> list[tuple[str, str]]:
    """INFERENCE_NUM_THREADS = `threads` unless `extra` (KEY=VALUE strings) sets it; later keys win."""
    properties = {"INFERENCE_NUM_THREADS": str(threads)}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--ov-property wants KEY=VALUE, got {item!r}")
        properties[key] = value
    return list(properties.items())


class OpenVinoWorker:
    """The worker subprocess: started, asked one JSON line at a time, closed by closing its stdin."""

    def __init__(self, argv: Sequence[str], log: IO[str]) -> None:
        self.argv = list(argv)
        self._log = log
        self._proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}

    def __enter__(self) -> OpenVinoWorker:
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1
        )
        self.ready = json.loads(self._read_line())
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()

    def _read_line(self) -> str:
        """The next JSON line; anything else the runtime prints on stdout goes to the log."""
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith("{"):
                return line
            self._log.write(line)
        raise ProbeError(f"the worker exited ({self._proc.wait()}) without answering; see its log")

    def generate(self, prompts: Sequence[str], prompt_tokens: int, tokens: int) -> OvReply:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"prompts": list(prompts), "tokens": tokens}) + "\n")
        self._proc.stdin.flush()
        return parse_reply(self._read_line(), len(prompts), prompt_tokens, tokens)
