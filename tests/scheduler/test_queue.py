"""The queue classes alone: where a request joins, where a preempted one goes back, and whom each order ranks last."""

from __future__ import annotations

from collections.abc import Iterable

from engine.sample.sampling_params import SamplingParams
from scheduler.queue import ByPriority, FirstComeFirstServed, request_queue
from scheduler.request import RequestEvent, SequenceRequest


def _ignore(event: RequestEvent) -> None:
    pass


def _request(name: str, arrival: float, priority: int = 0) -> SequenceRequest:
    return SequenceRequest(name, [1], SamplingParams(max_tokens=1), _ignore, arrival=arrival, priority=priority)


def _names(requests: Iterable[SequenceRequest]) -> list[str]:
    return [r.request_id for r in requests]


def test_first_come_first_served_by_arrival_with_preempted_requests_at_the_head() -> None:
    queue = request_queue(by_priority=False)
    assert isinstance(queue, FirstComeFirstServed)
    late, early = _request("late", 5.0), _request("early", 1.0)
    queue.add(late)
    queue.add(early)  # submitted after, arrived before
    preempted = _request("preempted", 3.0)
    preempted.num_preemptions = 1
    queue.requeue(preempted)
    queue.add(_request("earliest", 0.0))  # does not pass the preempted one
    assert _names(queue.requests) == ["preempted", "earliest", "early", "late"]
    queue.remove(early)
    assert _names(queue.requests) == ["preempted", "earliest", "late"]
    # The lowest ranked running request is the one seated last that `where` allows.
    running = [_request("a", 0.0), _request("b", 9.0), _request("c", 1.0)]
    assert queue.lowest_ranked(running, lambda r: True) is running[2]
    assert queue.lowest_ranked(running, lambda r: r.request_id != "c") is running[1]
    assert queue.lowest_ranked(running, lambda r: False) is None


def test_by_priority_then_arrival_and_the_newest_of_equals_ranks_last() -> None:
    queue = request_queue(by_priority=True)
    assert isinstance(queue, ByPriority)
    for name, arrival, priority in [("mid", 2.0, 1), ("low", 1.0, 9), ("urgent", 3.0, -3), ("mid-early", 0.5, 1)]:
        queue.add(_request(name, arrival, priority))
    preempted = _request("preempted", 4.0, 1)
    queue.requeue(preempted)  # by priority too: behind the requests of its class that arrived earlier
    assert _names(queue.requests) == ["urgent", "mid-early", "mid", "preempted", "low"]
    tie_a, tie_b = _request("tie-a", 2.0, 5), _request("tie-b", 2.0, 5)
    running = [_request("worst-early", 0.0, 7), tie_a, _request("worst-late", 1.0, 7), tie_b]
    assert queue.lowest_ranked(running, lambda r: True) is running[2]  # priority 7, the later arrival
    assert queue.lowest_ranked(running, lambda r: r.priority < 7) is tie_b  # exact tie: the one seated last
