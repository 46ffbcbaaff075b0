"""Measure this machine and fit cost.json: step grid, served probes, engine replays."""
