"""A server process's own accounting, read from Linux's /proc/PID/status (memory in kB there)."""

from __future__ import annotations

from pathlib import Path


def status_fields(pid: int) -> dict[str, str]:
    """Each `Name: value` line of /proc/PID/status, the value as written (e.g. "2316 kB", "14")."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {name: value.strip() for name, value in (line.split(":", 1) for line in lines if ":" in line)}


def field_mb(fields: dict[str, str], name: str) -> float:
    """A memory field (VmRSS, VmHWM, ...) in MB."""
    return int(fields[name].split()[0]) / 1024
