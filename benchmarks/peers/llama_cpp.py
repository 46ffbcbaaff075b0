"""Build llama.cpp's `llama-server` and `llama-quantize` and the GGUFs they are compared on, once, into a cache.

The sources come from the `llama-cpp-python` sdist on PyPI, which vendors a pinned llama.cpp: pip can fetch it
on any machine that reaches PyPI, and the pin keeps runs comparable. Nothing of llama.cpp is kept in this repo.

    python -m benchmarks llama-build build [--model M] [--quantize Q4_0,Q4_K_M,Q4_1] [--jobs 2]
    python -m benchmarks llama-build paths [--model M] [--quantize ...]   # where they are (JSON)

Cache: `<batchserve cache>/llama.cpp/<llama-cpp-python version>/` with `src/` (the vendored llama.cpp, kept for
its `convert_hf_to_gguf.py`), `bin/llama-server` and `bin/llama-quantize` (static, CPU only, native CPU flags),
`<model>-f32.gguf`, converted from the float32 checkpoint batchserve itself loads (or from `--model`'s HF folder),
and `<model>-<TYPE>.gguf`, quantised from that f32 file by llama.cpp's own tool. Every format is then one file
that both servers load: llama.cpp's fastest CPU layouts are repacked from Q4_0 and the K-quants, not Q4_1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.weights.checkpoints import gguf_checkpoint_dir, resolve_cache_dir
from engine.weights.loader import default_model_path, load_model

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_VENDOR_PREFIX = "vendor/llama.cpp/"
# The converter imports sentencepiece before it looks at the tokenizer files, even for a BPE model like SmolLM2.
_CONVERTER_MODULES = ("sentencepiece", "numpy", "torch", "transformers")
# -march=native turns on AMX where the CPU lists it, but on the development VM its first tile instruction
# (ldtilecfg in ggml_backend_amx_mul_mat) faults and kills the server on any Q4_1 model; batchserve uses no AMX.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


# llama.cpp's own switches for a build capped at an instruction set, so it runs the paths batchserve runs with
# BATCHSERVE_CPU_ISA set to the same value (engine/platform/cpu_features.py); "native" is whatever this CPU has.
_AVX2_OPTIONS = {
    "GGML_NATIVE": "OFF",
    "GGML_AVX": "ON",
    "GGML_AVX2": "ON",
    "GGML_FMA": "ON",
    "GGML_F16C": "ON",
    "GGML_BMI2": "ON",
    "GGML_AVX_VNNI": "OFF",
    "GGML_AVX512": "OFF",
}
_ISA_OPTIONS = {
    "native": {"GGML_NATIVE": "ON"},
    "avx2": _AVX2_OPTIONS,
    # The Xeon class with AVX-512 VNNI and no BF16 (Cascade Lake).
    "avx512_vnni": _AVX2_OPTIONS
    | {"GGML_AVX512": "ON", "GGML_AVX512_VNNI": "ON", "GGML_AVX512_VBMI": "OFF", "GGML_AVX512_BF16": "OFF"},
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
    def quantize_tool(self) -> Path:
        return self.server.with_name("llama-quantize" if self.isa == "native" else f"llama-quantize-{self.isa}")

    @property
    def convert_script(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def f32_gguf(self, model: Path) -> Path:
        return self.gguf(model, "f32")

    def gguf(self, model: Path, kind: str) -> Path:
        """`kind`: "f32" or a llama-quantize type (Q4_0, Q4_K_M, ...), from `model` (a GGUF or an HF folder)."""
        return self.root / f"{model_stem(model)}-{kind}.gguf"


_FORMAT_SUFFIX = re.compile(r"(?i)(i?q\d\w*|f16|f32|bf16)")


def model_stem(model: Path) -> str:
    """A model's name without its format: `SmolLM2-135M-Instruct` for `SmolLM2-135M-Instruct.Q4_1.gguf`; a
    folder's name as it is (`llama-3.2-1b-random`)."""
    if model.is_dir():
        return model.name
    name, _, suffix = model.stem.rpartition(".")
    return name if name and _FORMAT_SUFFIX.fullmatch(suffix) else model.stem


def default_cache(version: str = LLAMA_CPP_PYTHON_VERSION, isa: str | None = None) -> LlamaCppCache:
    """`isa`: None follows BATCHSERVE_CPU_ISA where llama.cpp has a build for that cap (an "avx2" cap builds and runs
    an AVX2-only binary, "avx512_vnni" one without BF16), else native."""
    if isa is None:
        cap = os.environ.get("BATCHSERVE_CPU_ISA", "").strip().lower()
        isa = cap if cap in _ISA_OPTIONS else "native"
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


_TOOLS = ("llama-server", "llama-quantize")
# llama-quantize's types measured here: the two llama.cpp repacks for its fast CPU paths, and the shipped file's.
QUANT_TYPES = ("Q4_0", "Q4_K_M", "Q4_1")


def build_argv(build_dir: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--target", *_TOOLS, "-j", str(jobs)]


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
    """Reuses cached binaries; otherwise configures and builds only the llama-server and llama-quantize targets."""
    if cache.server.is_file() and cache.quantize_tool.is_file():
        return cache.server
    cache.root.mkdir(parents=True, exist_ok=True)
    source = cache.source
    if not (source / "CMakeLists.txt").is_file():
        extract_source(sdist or fetch_sdist(cache.root / "sdist"), source)
    build_dir = cache.root / f"build-{cache.isa}"
    subprocess.run(configure_argv(source, build_dir, cache.isa), check=True)
    subprocess.run(build_argv(build_dir, jobs), check=True)
    cache.server.parent.mkdir(parents=True, exist_ok=True)
    for tool, dest in zip(_TOOLS, (cache.server, cache.quantize_tool), strict=True):
        partial = dest.with_name(f".{dest.name}.partial")
        shutil.copy2(build_dir / "bin" / tool, partial)
        os.replace(partial, dest)
    shutil.rmtree(build_dir, ignore_errors=True)
    return cache.server


def convert_argv(cache: LlamaCppCache, checkpoint: Path, out: Path) -> list[str]:
    return [sys.executable, str(cache.convert_script), str(checkpoint), "--outtype", "f32", "--outfile", str(out)]


def convert_f32(cache: LlamaCppCache, model: Path) -> Path:
    """`model` as an f32 GGUF: an HF folder converted as it is, a GGUF through the float32 checkpoint batchserve
    caches for it (made if missing)."""
    out = cache.f32_gguf(model)
    if out.is_file():
        return out
    missing = [name for name in _CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"convert_hf_to_gguf.py needs {', '.join(missing)}: pip install {' '.join(missing)}")
    checkpoint = model if model.is_dir() else gguf_checkpoint_dir(model)
    if not (checkpoint / "config.json").is_file():
        load_model(model)  # fills batchserve's conversion cache
    partial = out.with_name(f".{out.name}.partial")
    # The converter must run with its own gguf-py, not whichever `gguf` this venv happens to hold.
    env = {**os.environ, "PYTHONPATH": str(cache.source / "gguf-py")}
    subprocess.run(convert_argv(cache, checkpoint, partial), check=True, env=env)
    os.replace(partial, out)
    return out


def quantize_argv(cache: LlamaCppCache, source: Path, out: Path, kind: str, threads: int) -> list[str]:
    return [str(cache.quantize_tool), str(source), str(out), kind, str(threads)]


def quantize(cache: LlamaCppCache, model: Path, kind: str, threads: int = 2) -> Path:
    """`model` quantised to `kind` by llama-quantize, from its f32 GGUF (both made if missing)."""
    out = cache.gguf(model, kind)
    if out.is_file():
        return out
    if kind not in QUANT_TYPES:
        raise ValueError(f"unknown quantisation {kind!r}; choose from {', '.join(QUANT_TYPES)}")
    source = convert_f32(cache, model)
    partial = out.with_name(f".{out.name}.partial")
    subprocess.run(quantize_argv(cache, source, partial, kind, threads), check=True)
    os.replace(partial, out)
    return out


def parse_quant_types(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip().upper() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in QUANT_TYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown types {unknown}; choose from {', '.join(QUANT_TYPES)}")
    return kinds


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
            "--model", type=Path, default=None, help="a GGUF or HF folder (default: batchserve's default model)"
        )
        command.add_argument(
            "--quantize",
            type=parse_quant_types,
            default=(),
            help=f"comma list of llama-quantize types to make from the f32 GGUF ({','.join(QUANT_TYPES)})",
        )
        command.add_argument(
            "--cpu-isa",
            choices=sorted(_ISA_OPTIONS),
            default=None,
            help="the binary's instruction set (default: avx2 under BATCHSERVE_CPU_ISA=avx2, else native)",
        )
    args = parser.parse_args(argv)
    cache = default_cache(isa=args.cpu_isa)
    model = args.model or default_model_path()
    if args.command == "build":
        print(build_server(cache, args.sdist, args.jobs))
        if not args.skip_convert:
            print(convert_f32(cache, model))
            for kind in args.quantize:
                print(quantize(cache, model, kind, args.jobs))
        return 0
    paths = {"server": cache.server, "quantize": cache.quantize_tool, "f32": cache.f32_gguf(model)}
    paths |= {kind.lower(): cache.gguf(model, kind) for kind in args.quantize}
    print(json.dumps({name: str(path) for name, path in paths.items()}, indent=2))
    return 0
