"""The simulator: the real Scheduler over a simulated engine whose steps cost what cost.json says."""
