"""The score-memory benchmark's pieces: what it reads from /proc, how it resets the peak, what it sends."""

from __future__ import annotations

import os

from benchmarks.online.score_memory import TOP, body, memory_mb, reset_peak


def test_the_peak_resets_to_the_current_resident_memory() -> None:
    pid = os.getpid()
    ballast = bytearray(64 * 1024 * 1024)  # touched: raises the peak by 64 MB
    ballast[::4096] = b"\x01" * len(ballast[::4096])
    del ballast
    assert memory_mb(pid)["VmHWM"] >= memory_mb(pid)["VmRSS"] + 32
    reset_peak(pid)
    after = memory_mb(pid)
    assert after["VmHWM"] < after["VmRSS"] + 32


def test_the_scored_request_asks_for_the_most_alternatives_on_every_prompt_position() -> None:
    assert body([5, 6], scored=False) == {"prompt": [5, 6], "max_tokens": 1, "temperature": 0}
    scored = body([5, 6], scored=True)
    assert (scored["echo"], scored["logprobs"], scored["prompt_logprobs"]) == (True, TOP, TOP) and TOP == 20
