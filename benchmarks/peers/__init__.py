"""The servers batchserve is compared with: llama.cpp's build and probe, the transformers export, targets."""
