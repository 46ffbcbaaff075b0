"""Where each request spent its time: waiting, prefill, decoding, finished-but-held.

batchserve reports these in a `timings` object on the last chunk; other servers don't (llama-server sends a
`timings` object of a different shape), so we fall back to what the client saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.loadgen.client import RequestRecord

_REQUIRED = ("queue_time_ms", "time_to_first_token_ms", "decode_time_ms", "held_time_ms", "e2e_time_ms")


@dataclass(frozen=True)
class ServerTimings:
    """batchserve's per-request timings, in milliseconds."""

    mode: str | None
    queue_ms: float
    ttft_ms: float
    decode_ms: float
    held_ms: float
    e2e_ms: float
    num_steps: int | None
    batch_id: int | None

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> ServerTimings | None:
        """None unless `raw` has every field batchserve sends, as numbers."""
        if raw is None or not all(isinstance(raw.get(k), int | float) for k in _REQUIRED):
            return None
        steps, batch = raw.get("num_steps"), raw.get("batch_id")
        return cls(
            mode=str(raw["mode"]) if raw.get("mode") is not None else None,
            queue_ms=float(raw["queue_time_ms"]),
            ttft_ms=float(raw["time_to_first_token_ms"]),
            decode_ms=float(raw["decode_time_ms"]),
            held_ms=float(raw["held_time_ms"]),
            e2e_ms=float(raw["e2e_time_ms"]),
            num_steps=steps if isinstance(steps, int) else None,
            batch_id=batch if isinstance(batch, int) else None,
        )

    @property
    def prefill_ms(self) -> float:
        """Scheduled to first token.

        The protocol does not pin whether TTFT counts the queue (vLLM's does); whichever reading makes the
        phases add up to e2e is the one the server used.
        """
        tail = self.decode_ms + self.held_ms
        includes_queue = abs(self.ttft_ms + tail - self.e2e_ms) <= abs(
            self.queue_ms + self.ttft_ms + tail - self.e2e_ms
        )
        return max(self.ttft_ms - self.queue_ms, 0.0) if includes_queue else self.ttft_ms


@dataclass(frozen=True)
class Phases:
    """Seconds since the run started (start) and durations in seconds of each phase."""

    start: float
    waiting: float
    prefill: float
    decoding: float
    held: float
    source: str  # "server" or "client"

    @property
    def end(self) -> float:
        return self.start + self.waiting + self.prefill + self.decoding + self.held


def request_phases(record: RequestRecord) -> Phases | None:
    """None for failed requests and requests that produced no token."""
    if not record.ok or record.first_token_time is None:
        return None
    timings = ServerTimings.parse(record.server_timings)
    if timings is not None:
        return Phases(
            start=record.send_time,
            waiting=timings.queue_ms / 1e3,
            prefill=timings.prefill_ms / 1e3,
            decoding=timings.decode_ms / 1e3,
            held=timings.held_ms / 1e3,
            source="server",
        )
    last_chunk = record.chunk_times[-1]
    return Phases(
        start=record.send_time,
        waiting=0.0,  # the client cannot tell queueing from prefill
        prefill=record.first_token_time - record.send_time,
        decoding=last_chunk - record.first_token_time,
        held=max(record.end_time - last_chunk, 0.0),
        source="client",
    )
