"""A request's server-side timings as the JSON object every response carries (`timings`). Pure: no torch or
transformers import, so the simulator (benchmarks) writes the very same object."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import RequestTimings


def timings_json(
    timings: RequestTimings | None, num_choices: int, replica: str | None = None, arrival_time: float | None = None
) -> dict[str, object] | None:
    """`replica`: which replica served it, behind a proxy of several (api.scale_out.ray_serve); absent on one server.
    `arrival_time`: when the server received the request (Unix seconds), the instant the queue orders by; it
    lets a benchmark replay requests in the order the server saw them, which is not the order they were sent."""
    if timings is None:
        return None

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000.0, 3)

    decode = None
    if timings.first_token is not None and timings.last_token is not None:
        decode = timings.last_token - timings.first_token
    document: dict[str, object] = {
        "mode": timings.mode,
        "queue_time_ms": ms(timings.queue_time),
        "time_to_first_token_ms": ms(timings.time_to_first_token),
        "decode_time_ms": ms(decode),
        "held_time_ms": ms(timings.held_time),
        "e2e_time_ms": ms(timings.e2e_time),
        "num_steps": timings.num_steps,
        "num_preemptions": timings.num_preemptions,
        "priority": timings.priority,
        "cached_tokens": timings.num_cached_tokens,
        "batch_id": timings.batch_id,
        "num_choices": num_choices,
        "draft_tokens": timings.num_draft_tokens,  # speculation (docs/speculative.md); 0 without
        "accepted_tokens": timings.num_accepted_tokens,
    }
    if arrival_time is not None:
        document["arrival_time"] = round(arrival_time, 6)
    if replica is not None:
        document["replica"] = replica
    return document
