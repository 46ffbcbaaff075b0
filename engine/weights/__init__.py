"""Model weights: loading a checkpoint or GGUF file, the weight formats `--dtype`/`--quantization` resolve to, and
the quantised weights (GGUF's own blocks, or quantised from dense weights at load)."""
