"""Export a GGUF checkpoint as a plain Hugging Face folder, for the `transformers serve` baseline.

`transformers serve` cannot start from a GGUF: the config transformers derives from GGUF metadata has no
`architectures`, which serve reads to pick the model class (TypeError at load). A model loaded from GGUF also
refuses `save_pretrained` (it is marked quantized), so its dequantised weights are copied into a plain instance.

    python -m benchmarks hf-export MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path


def default_export_dir(gguf: Path) -> Path:
    return Path.home() / ".cache" / "batchserve-bench" / "hf" / gguf.stem


def is_exported(out_dir: Path) -> bool:
    return (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors"))


def export(gguf: Path, out_dir: Path) -> Path:
    """Writes the folder once; later calls find it and return at once."""
    if is_exported(out_dir):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when there is work to do

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    # Write beside the target and rename, so an interrupted export never looks finished.
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(out_dir)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks hf-export", description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path, nargs="?", default=None)
    args = parser.parse_args(argv)
    out = export(args.gguf, args.out_dir or default_export_dir(args.gguf))
    print(out)
    return 0
