"""Check the simulator against real runs: headline table, per-request comparison, trace export."""
