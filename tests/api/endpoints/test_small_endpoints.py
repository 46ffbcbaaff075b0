"""vLLM's small endpoints on live servers in both modes: `/version` says which optional features are on, and the
model card is one object whether listed or retrieved by id (the openai SDK's `models.list` and `models.retrieve`)."""

from __future__ import annotations

import importlib.metadata
import logging
import sys

import httpx
import openai
import pytest

from api.endpoints.state import ServerState
from api.structured.grammars import INSTALL_HINT
from tests.server_harness import RunningServer, mode_config, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _http(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


def test_models_list_and_retrieve_give_the_same_card(server: RunningServer, client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert len(listed) == 1
    card = client.models.retrieve(listed[0].id)
    assert card == listed[0]
    assert card.id == "tiny-llama" and card.object == "model" and card.owned_by == "batchserve"
    assert card.created == ServerState.of(server.app).started > 0  # type: ignore[arg-type]
    assert card.model_extra == {"root": server.runtime.source, "parent": None, "max_model_len": 256}


def test_an_unknown_model_id_is_a_404_naming_it(client: openai.OpenAI) -> None:
    for unknown in ("gpt-4", "org/tiny-llama", "tiny-llama/x"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(unknown)
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert f"'{unknown}'" in error["message"]


def test_version_is_the_package_version_with_its_optional_features(server: RunningServer) -> None:
    with _http(server) as http:
        answer = http.get("/version").json()
    assert answer == {
        "version": importlib.metadata.version("batchserve"),
        "features": {"structured_outputs": server.runtime.grammars is not None},
    }


def test_without_xgrammar_the_server_warns_once_and_version_says_structured_outputs_are_off(
    monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "api.structured.xgrammar_backend", None)  # its import now fails
    with running_server(mode_config("continuous")) as srv, _http(srv) as http:
        assert http.get("/version").json()["features"] == {"structured_outputs": False}
        structured = http.post("/v1/completions", json={"prompt": "hi", "guided_choice": ["a", "b"]})
        assert structured.status_code == 400 and INSTALL_HINT in structured.json()["error"]["message"]
    warnings = [r for r in logs.records if r.levelno == logging.WARNING and "xgrammar is not installed" in r.message]
    assert len(warnings) == 1 and INSTALL_HINT in warnings[0].message
