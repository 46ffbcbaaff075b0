"""In-process engine measurements: steps, quantised kernels, scoring, memory bandwidth, quality, GC pauses."""
