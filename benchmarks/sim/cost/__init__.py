"""Step-cost models: the CPU fit, the GPU roofline, the cost.json format, the served-load extras."""
