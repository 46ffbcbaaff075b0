"""OpenVINO GenAI (Intel's runtime) as a peer: a venv built once into a cache, and the default model exported to
OpenVINO IR in it, in int4 and float32.

    python -m benchmarks openvino-build build    # venv + pip install + both exports (a few minutes; about 2 GB)
    python -m benchmarks openvino-build paths    # where they are (JSON)

The venv holds `openvino-genai` (what runs the model) and `optimum-intel[openvino]` + `nncf` (what exports and
compresses it), pinned below so runs stay comparable; it is apart from batchserve's, whose transformers differs.
The export reads the float32 checkpoint batchserve itself caches for the default model (as `llama-build` converts
it), so both runtimes start from the same weights.

Cache: `<batchserve cache>/openvino/<openvino-genai version>/` with `venv/` and `models/<model>-<format>/`. A `.built`
file in the venv and each model folder's final name are written last, so a step that stopped half way is never
taken for a finished one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.peer_venv import PeerVenv
from engine.weights.checkpoints import gguf_checkpoint_dir, resolve_cache_dir
from engine.weights.loader import default_model_path, load_model

OPENVINO_GENAI_VERSION = "2026.4.1.0"
# torch first, alone: pip takes it from the default index (on the development VM a local CPU wheel), and the
# constraints file keeps optimum-intel's dependencies from swapping it for PyPI's CUDA build.
TORCH = "torch==2.13.0"
# Exact versions that installed and exported together (2026-12-04); the constraints file pins the ones that move.
PINNED = (
    f"openvino-genai=={OPENVINO_GENAI_VERSION}",
    "openvino==2026.4.1",
    "openvino-tokenizers==2026.4.1.0",
    "optimum-intel[openvino]==2.2.0",
    "optimum==2.3.0",
    "nncf==3.4.0",
    "transformers==5.5.4",
)
# optimum-intel pulls torchvision, built for another torch: its operators fail to register against the CPU one, and
# transformers then cannot import PreTrainedModel ("operator torchvision::nms does not exist"). A text model needs
# none of it.
_UNNEEDED = ("torchvision",)
# int4: groups of 32 (the default 128 does not divide the default model's hidden size of 576), asymmetric
# (optimum-intel's default: int4_asym for every projection, int8_asym per channel for the tied embedding/LM head).
WEIGHT_FORMATS: dict[str, tuple[str, ...]] = {
    "int4": ("--weight-format", "int4", "--group-size", "32"),
    "fp32": ("--weight-format", "fp32"),
}
FORMAT_NOTES = {
    "int4": "int4 asymmetric, groups of 32; embedding/LM head int8 asymmetric per channel",
    "fp32": "float32 weights (OpenVINO's CPU plugin runs them in bf16 where the CPU has it unless "
    "INFERENCE_PRECISION_HINT=f32)",
}


@dataclass(frozen=True)
class OpenVinoCache(PeerVenv):
    root: Path  # <cache>/openvino/<version>
    version: str = OPENVINO_GENAI_VERSION

    @property
    def optimum_cli(self) -> Path:
        return self.venv / "bin" / "optimum-cli"

    @property
    def constraints(self) -> Path:
        return self.root / "constraints.txt"

    def model_dir(self, model: Path, weight_format: str) -> Path:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weight_format!r}; choose from {', '.join(WEIGHT_FORMATS)}")
        return self.root / "models" / f"{model.stem.split('.')[0]}-{weight_format}"


def is_exported(model_dir: Path) -> bool:
    return (model_dir / "openvino_model.xml").is_file() and (model_dir / "openvino_tokenizer.xml").is_file()


def default_cache(version: str = OPENVINO_GENAI_VERSION) -> OpenVinoCache:
    """Beside llama.cpp's and vLLM's builds, under batchserve's cache ($BATCHSERVE_CACHE_DIR moves all three)."""
    return OpenVinoCache(resolve_cache_dir() / "openvino" / version, version)


def constraint_lines() -> list[str]:
    """Every pin without its extras: a constraints file may not name extras."""
    return [TORCH, *(pin.replace("[openvino]", "") for pin in PINNED)]


def build_steps(cache: OpenVinoCache, base_python: str = sys.executable) -> list[list[str]]:
    pip = [str(cache.python), "-m", "pip"]
    constrained = [*pip, "install", "-c", str(cache.constraints)]
    return [
        [base_python, "-m", "venv", "--clear", str(cache.venv)],
        [*pip, "install", "--upgrade", "pip"],
        [*constrained, TORCH],
        [*constrained, *PINNED],
        [*pip, "uninstall", "-y", *_UNNEEDED],
    ]


def build(cache: OpenVinoCache, base_python: str = sys.executable) -> Path:
    """Reuses a finished venv; otherwise builds it anew. Returns its python."""
    if cache.is_built():
        return cache.python
    cache.root.mkdir(parents=True, exist_ok=True)
    cache.constraints.write_text("\n".join(constraint_lines()) + "\n")
    for step in build_steps(cache, base_python):
        subprocess.run(step, check=True)
    cache.marker.write_text("\n".join([TORCH, *PINNED]) + "\n")
    return cache.python


def export_argv(cache: OpenVinoCache, checkpoint: Path, weight_format: str, out: Path) -> list[str]:
    return [
        str(cache.optimum_cli),
        "export",
        "openvino",
        "--model",
        str(checkpoint),
        "--task",
        "text-generation-with-past",
        *WEIGHT_FORMATS[weight_format],
        str(out),
    ]


def export(cache: OpenVinoCache, model: Path, weight_format: str) -> Path:
    """The float32 checkpoint batchserve caches for `model` as OpenVINO IR (the checkpoint is made if missing)."""
    out = cache.model_dir(model, weight_format)
    if is_exported(out):
        return out
    checkpoint = gguf_checkpoint_dir(model)
    if not (checkpoint / "config.json").is_file():
        load_model(model)  # fills batchserve's conversion cache
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # a local folder: nothing to fetch
    subprocess.run(export_argv(cache, checkpoint, weight_format, partial), check=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out


def paths(cache: OpenVinoCache, model: Path) -> dict[str, object]:
    return {
        "venv": str(cache.venv),
        "python": str(cache.python),
        "built": cache.is_built(),
        "checkpoint": str(gguf_checkpoint_dir(model)),
        "models": {fmt: str(cache.model_dir(model, fmt)) for fmt in WEIGHT_FORMATS},
        "exported": {fmt: is_exported(cache.model_dir(model, fmt)) for fmt in WEIGHT_FORMATS},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks openvino-build", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help="create the venv and export the default model (each only if missing)")
    build_parser.add_argument(
        "--python", default=sys.executable, help="the interpreter the venv is made from (default: this one)"
    )
    build_parser.add_argument("--skip-export", action="store_true")
    sub.add_parser("paths", help="print the venv's and the exported models' paths as JSON")
    args = parser.parse_args(argv)
    cache = default_cache()
    model = default_model_path()
    if args.command == "build":
        print(build(cache, args.python))
        if not args.skip_export:
            for weight_format in WEIGHT_FORMATS:
                print(export(cache, model, weight_format))
        return 0
    print(json.dumps(paths(cache, model), indent=2))
    return 0
