"""How many compare workloads run at once (`--max-workloads`): each starts up to --max-prompts sequences in every
pane, so a server runs at most that many, one by default, as the page sends them; one more is a 429.

The count lives on the app's `ServerState` and is only touched on the event loop, so checking and taking a slot
with no await between them cannot race.
"""

from __future__ import annotations

from api.endpoints.state import ServerState
from api.protocol.errors import APIError


def check_free(state: ServerState) -> None:
    """A 429 in the API's error shape, naming the limit, while every slot is held."""
    limit = state.config.max_workloads
    if state.workloads >= limit:
        running = "one is" if state.workloads == 1 else f"{state.workloads} are"
        message = (
            f"at most {limit} workload{'s' if limit > 1 else ''} at a time on this server (--max-workloads) and "
            f"{running} running; retry when one ends"
        )
        raise APIError(429, message, headers={"Retry-After": "5"})


class WorkloadSlot:
    """One of the server's --max-workloads slots, held from `take` until the first `release`."""

    def __init__(self, state: ServerState) -> None:
        self._state: ServerState | None = state

    @classmethod
    def take(cls, state: ServerState) -> WorkloadSlot:
        check_free(state)
        state.workloads += 1
        return cls(state)

    def release(self) -> None:
        """Idempotent: a workload releases at its last answer's end and again when its stream closes."""
        if self._state is not None:
            self._state.workloads -= 1
            self._state = None
