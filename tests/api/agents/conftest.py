"""One live real-model server per mode for the agent-client tests, shared by the module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.agents.harness import RecordedServer, recorded_server, require_client_libraries

MODES = ("continuous", "dynamic")


@pytest.fixture(scope="module", params=MODES)
def agent_server(request: pytest.FixtureRequest) -> Iterator[RecordedServer]:
    require_client_libraries()
    with recorded_server(request.param) as server:
        yield server
