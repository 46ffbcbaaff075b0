"""Build llama.cpp's `llama-server` and the GGUFs it is compared on, once, into a cache.

The sources come from the `llama-cpp-python` sdist on PyPI, which vendors a pinned llama.cpp: pip can fetch it
on any machine that reaches PyPI, and the pin keeps runs comparable. Nothing of llama.cpp is kept in this repo.

    python -m benchmarks llama-build build [--sdist FILE] [--jobs 2]   # binary + f32 GGUF (10-30 min on 2 cores)
    python -m benchmarks llama-build paths                             # where they are (JSON)

Cache: `<batchserve cache>/llama.cpp/<llama-cpp-python version>/` with `src/` (the vendored llama.cpp, kept for
its `convert_hf_to_gguf.py`), `bin/llama-server` (static, CPU only, native CPU flags) and `<model>-f32.gguf`,
converted from the float32 checkpoint batchserve itself loads, so both servers run the same weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.loader import default_model_path, gguf_checkpoint_dir, load_model, resolve_cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_VENDOR_PREFIX = "vendor/llama.cpp/"
# The converter imports sentencepiece before it looks at the tokenizer files, even for a BPE model like SmolLM2.
_CONVERTER_MODULES = ("sentencepiece", "numpy", "torch", "transformers")
# -march=native turns on AMX where the CPU lists it, but on the development VM its first tile instruction
# (ldtilecfg in ggml_backend_amx_mul_mat) faults and kills the server on any Q4_1 model; batchserve uses no AMX.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


# llama.cpp's own switches for a build capped at an instruction set, so it runs the paths batchserve runs with
# BATCHSERVE_CPU_ISA set to the same value (engine/cpu_features.py); "native" is whatever this CPU has.
_ISA_OPTIONS = {
    "native": {"GGML_NATIVE": "ON"},
    "avx2": {
        "GGML_NATIVE": "OFF",
        "GGML_AVX": "ON",
        "GGML_AVX2": "ON",
        "GGML_FMA": "ON",
        "GGML_F16C": "ON",
        "GGML_BMI2": "ON",
        "GGML_AVX_VNNI": "OFF",
        "GGML_AVX512": "OFF",
    },
}


@dataclass(frozen=True)
class LlamaCppCache:
    root: Path  # <cache>/llama.cpp/<version>
    isa: str = "native"  # a key of _ISA_OPTIONS: the binary's instruction set

    @property
    def source(self) -> Path:
        return self.root / "src"

    @property
    def server(self) -> Path:
        return self.root / "bin" / ("llama-server" if self.isa == "native" else f"llama-server-{self.isa}")

    @property
    def convert_script(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def f32_gguf(self, model: Path) -> Path:
        return self.root / f"{model.stem.split('.')[0]}-f32.gguf"


def default_cache(version: str = LLAMA_CPP_PYTHON_VERSION, isa: str | None = None) -> LlamaCppCache:
    """`isa`: None follows BATCHSERVE_CPU_ISA (an "avx2" cap builds and runs an AVX2-only binary), else native."""
    if isa is None:
        isa = "avx2" if os.environ.get("BATCHSERVE_CPU_ISA", "").strip().lower() == "avx2" else "native"
    return LlamaCppCache(resolve_cache_dir() / "llama.cpp" / version, isa)


def configure_argv(source: Path, build_dir: Path, isa: str = "native") -> list[str]:
    """CPU only, optimised for this CPU (or capped at `isa`), one static binary; nothing that reaches the network."""
    options = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",  # a single self-contained file is simpler to cache
        **_ISA_OPTIONS[isa],
        "GGML_CUDA": "OFF",
        "LLAMA_CURL": "OFF",  # older llama.cpp: model download over HTTP
        "LLAMA_OPENSSL": "OFF",  # newer llama.cpp: the same, over HTTPS
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",  # would download the web UI from Hugging Face at build time
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_TOOLS": "ON",
        "LLAMA_BUILD_SERVER": "ON",
    }
    if platform.machine().lower() in ("x86_64", "amd64"):
        options |= {"CMAKE_C_FLAGS": _NO_AMX, "CMAKE_CXX_FLAGS": _NO_AMX}  # GCC lets these override -march
    return ["cmake", "-S", str(source), "-B", str(build_dir), *(f"-D{key}={value}" for key, value in options.items())]


def build_argv(build_dir: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]


def fetch_sdist(dest: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The sdist from PyPI (source only: a wheel would carry no convert script and no server)."""
    name = f"llama_cpp_python-{version}.tar.gz"
    if (dest / name).is_file():
        return dest / name
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps"]
    subprocess.run([*pip, "--no-binary", ":all:", "-d", str(dest)], check=True)
    return dest / name


def extract_source(sdist: Path, dest: Path) -> Path:
    """Unpack only the vendored llama.cpp tree, renamed to `dest`."""
    if (dest / "CMakeLists.txt").is_file():
        return dest
    partial = Path(tempfile.mkdtemp(prefix=".src-", dir=dest.parent))
    try:
        with tarfile.open(sdist) as archive:
            members = []
            for member in archive.getmembers():
                _, _, inside = member.name.partition("/")
                if inside.startswith(_VENDOR_PREFIX):
                    member.name = inside.removeprefix(_VENDOR_PREFIX)
                    members.append(member)
            if not members:
                raise RuntimeError(f"{sdist} holds no {_VENDOR_PREFIX}")
            archive.extractall(partial, members=members, filter="data")
        os.replace(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def build_server(cache: LlamaCppCache, sdist: Path | None = None, jobs: int = 2) -> Path:
    """Reuses a cached binary; otherwise configures and builds only the llama-server target."""
    if cache.server.is_file():
        return cache.server
    cache.root.mkdir(parents=True, exist_ok=True)
    source = cache.source
    if not (source / "CMakeLists.txt").is_file():
        extract_source(sdist or fetch_sdist(cache.root / "sdist"), source)
    build_dir = cache.root / f"build-{cache.isa}"
    subprocess.run(configure_argv(source, build_dir, cache.isa), check=True)
    subprocess.run(build_argv(build_dir, jobs), check=True)
    built = build_dir / "bin" / "llama-server"
    cache.server.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.server.with_name(".llama-server.partial")
    shutil.copy2(built, partial)
    os.replace(partial, cache.server)
    shutil.rmtree(build_dir, ignore_errors=True)
    return cache.server


def convert_argv(cache: LlamaCppCache, checkpoint: Path, out: Path) -> list[str]:
    return [sys.executable, str(cache.convert_script), str(checkpoint), "--outtype", "f32", "--outfile", str(out)]


def convert_f32(cache: LlamaCppCache, model: Path) -> Path:
    """The float32 checkpoint batchserve caches for `model`, as an f32 GGUF (the checkpoint is made if missing)."""
    out = cache.f32_gguf(model)
    if out.is_file():
        return out
    missing = [name for name in _CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"convert_hf_to_gguf.py needs {', '.join(missing)}: pip install {' '.join(missing)}")
    checkpoint = gguf_checkpoint_dir(model)
    if not (checkpoint / "config.json").is_file():
        load_model(model)  # fills batchserve's conversion cache
    partial = out.with_name(f".{out.name}.partial")
    # The converter must run with its own gguf-py, not whichever `gguf` this venv happens to hold.
    env = {**os.environ, "PYTHONPATH": str(cache.source / "gguf-py")}
    subprocess.run(convert_argv(cache, checkpoint, partial), check=True, env=env)
    os.replace(partial, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks llama-build", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build llama-server and convert the f32 GGUF (each only if missing)")
    build.add_argument("--sdist", type=Path, default=None, help="a local llama-cpp-python sdist (default: PyPI)")
    build.add_argument("--jobs", type=int, default=2)
    build.add_argument("--skip-convert", action="store_true")
    paths_parser = sub.add_parser("paths", help="print the cached paths as JSON")
    for command in (build, paths_parser):
        command.add_argument(
            "--cpu-isa",
            choices=sorted(_ISA_OPTIONS),
            default=None,
            help="the binary's instruction set (default: avx2 under BATCHSERVE_CPU_ISA=avx2, else native)",
        )
    args = parser.parse_args(argv)
    cache = default_cache(isa=args.cpu_isa)
    model = default_model_path()
    if args.command == "build":
        print(build_server(cache, args.sdist, args.jobs))
        if not args.skip_convert:
            print(convert_f32(cache, model))
        return 0
    paths = {"server": cache.server, "f32": cache.f32_gguf(model), "q4_1": model}
    print(json.dumps({name: str(path) for name, path in paths.items()}, indent=2))
    return 0
