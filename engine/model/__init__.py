"""The model: the runner over a transformers model's own modules, the forward's packed batch, attention over the
paged cache, the weight matmuls, the element-wise kernels, whole-layer decode steps and prompt scoring."""
