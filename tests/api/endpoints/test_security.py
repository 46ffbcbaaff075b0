"""The API key guards every endpoint but /health, is compared in constant time and never shows up in a response
or a log line; CORS is off unless origins are configured; the server binds to loopback by default."""

from __future__ import annotations

import hmac
from collections.abc import Iterator

import httpx
import pytest

import api.endpoints.middleware
from api.config import ServerConfig
from tests.server_harness import RunningServer, running_server

KEY = "sk-batchserve-Zq8v3Kp1Lm9w"
ORIGIN = "https://app.example"
GOOD_BODIES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}
# (method, path, JSON body): every route the app serves, plus one it does not.
GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny-llama", None),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/tokenize", {"messages": GOOD_BODIES["/v1/chat/completions"]["messages"]}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", GOOD_BODIES["/v1/completions"]),
    ("POST", "/v1/chat/completions", GOOD_BODIES["/v1/chat/completions"]),
    ("POST", "/v1/completions", {**GOOD_BODIES["/v1/completions"], "stream": True}),
]
WRONG_AUTH = [
    None,
    "",
    "Bearer",
    "Bearer wrong",
    f"Bearer {KEY[:-1]}",
    f"Bearer {KEY}x",
    f"Basic {KEY}",
    KEY,
    f"Bearer  {KEY}",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningServer]:
    with running_server(ServerConfig(port=0, api_key=KEY, max_num_seqs=2)) as srv:
        yield srv


def _request(client: httpx.Client, method: str, path: str, body: object, auth: str | None) -> httpx.Response:
    headers = {} if auth is None else {"Authorization": auth}
    return client.request(method, path, json=body, headers=headers)


def _assert_no_key(response: httpx.Response) -> None:
    assert KEY not in response.text
    assert all(KEY not in value for value in response.headers.values())


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
def test_every_endpoint_but_health_needs_the_key(
    keyed: RunningServer, logs: pytest.LogCaptureFixture, method: str, path: str, body: object
) -> None:
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        for auth in WRONG_AUTH:
            response = _request(client, method, path, body, auth)
            assert response.status_code == 401, (auth, response.text)
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            _assert_no_key(response)
        response = _request(client, method, path, body, f"Bearer {KEY}")
        assert response.status_code == 200, response.text
        _assert_no_key(response)
    assert KEY not in logs.text


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(keyed: RunningServer, scheme: str) -> None:
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        assert client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY.lower()}"}).status_code == 401


@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer wrong"], ids=["same", "different"])
def test_two_authorization_headers_are_refused(
    keyed: RunningServer, logs: pytest.LogCaptureFixture, second: str
) -> None:
    """Whichever one counted, a proxy in front may have checked the other: refuse instead of picking one."""
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        for first in (f"Bearer {KEY}", "Bearer wrong"):
            response = client.get("/v1/models", headers=[("Authorization", first), ("Authorization", second)])
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and "2 Authorization headers" in error["message"]
            _assert_no_key(response)
    assert KEY not in logs.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"])
def test_x_api_key_is_a_key_too_and_every_key_sent_must_be_the_one(
    keyed: RunningServer, logs: pytest.LogCaptureFixture, path: str
) -> None:
    """Anthropic's clients send `x-api-key`; the Messages API's paths refuse in Anthropic's shape."""
    body = {**GOOD_BODIES["/v1/chat/completions"], "model": "tiny-llama"}
    anthropic = path.startswith("/v1/messages")
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        for headers in (
            {},
            {"x-api-key": ""},
            {"x-api-key": "wrong"},
            {"x-api-key": KEY[:-1]},
            {"x-api-key": f"Bearer {KEY}"},
            {"x-api-key": KEY, "Authorization": "Bearer wrong"},
            {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"},
        ):
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 401, (headers, response.text)
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and "x-api-key" in error["message"]
            assert set(response.json()) == ({"type", "error"} if anthropic else {"error"})
            _assert_no_key(response)
        for headers in ({"x-api-key": KEY}, {"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}):
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 200, response.text
        twice = client.post(path, json=body, headers=[("x-api-key", KEY), ("x-api-key", KEY)])
        assert twice.status_code == 400 and "2 x-api-key headers" in twice.json()["error"]["message"]
    assert KEY not in logs.text


def test_two_api_key_query_parameters_are_refused_by_their_own_name(keyed: RunningServer) -> None:
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        response = client.get("/v1/events", params=[("api_key", KEY), ("api_key", KEY)])
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "2 api_key query parameters" in message and "Authorization" not in message
        _assert_no_key(response)


def test_health_needs_no_key_and_unknown_routes_still_do(keyed: RunningServer) -> None:
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/nowhere").status_code == 401
        assert client.get("/nowhere", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_the_key_never_appears_in_error_responses_or_logs(
    keyed: RunningServer, logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that carry the key (and wrong ones that nearly match it) end in every kind of error."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        responses = [
            client.post("/v1/completions", content=b"{not json", headers={**auth, "content-type": "application/json"}),
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}, headers=auth),
            client.post("/v1/completions", json={"prompt": "hi", "user": KEY, "n": KEY, "bogus": KEY}, headers=auth),
            client.post("/v1/completions", content=KEY.encode(), headers={**auth, "content-type": "text/plain"}),
            client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"}, headers=auth),
            client.get("/v1/completions", headers=auth),
            client.get("/v1/nowhere", headers=auth),
            client.post(
                "/v1/completions", json=GOOD_BODIES["/v1/completions"], headers={"Authorization": f"Bearer {KEY}x"}
            ),
        ]
        monkeypatch.setattr(keyed.runtime.service, "start", _explode)
        responses.append(client.post("/v1/completions", json=GOOD_BODIES["/v1/completions"], headers=auth))
    assert [r.status_code for r in responses] == [400, 400, 400, 400, 404, 405, 404, 401, 500]
    for response in responses:
        _assert_no_key(response)
    assert "unhandled error" in logs.text  # the 500 was logged, without the key
    assert KEY not in logs.text


def _explode(*args: object, **kwargs: object) -> object:
    raise RuntimeError("the service broke")


def test_the_key_is_compared_with_compare_digest(keyed: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, object]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api.endpoints.middleware.hmac, "compare_digest", recording)
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        assert client.get("/health").status_code == 200
    expected = f"Bearer {KEY}".encode()
    assert calls == [(expected, expected), (b"Bearer nope", expected), (b"", expected)]


def test_the_config_repr_hides_the_key() -> None:
    config = ServerConfig(api_key=KEY)
    assert KEY not in repr(config) and KEY not in str(config)


def test_cors_is_off_by_default() -> None:
    with (
        running_server(ServerConfig(port=0, max_num_seqs=2)) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as client,
    ):
        response = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert response.status_code == 200
        assert not [h for h in response.headers if h.lower().startswith("access-control-")]
        preflight = client.options(
            "/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        )
        assert not [h for h in preflight.headers if h.lower().startswith("access-control-")]


def test_cors_answers_only_the_configured_origins() -> None:
    config = ServerConfig(port=0, max_num_seqs=2, cors_origins=(ORIGIN,), api_key=KEY)
    with running_server(config) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        auth = {"Authorization": f"Bearer {KEY}"}
        allowed = client.get("/v1/models", headers={"Origin": ORIGIN, **auth})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        denied = client.get("/v1/models", headers={"Origin": "https://evil.example", **auth})
        assert "access-control-allow-origin" not in denied.headers
        # A browser's preflight carries no credentials; it is answered without the key.
        preflight = client.options(
            "/v1/completions",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        # A 401 carries CORS headers too, so a browser client can read why it was refused.
        refused = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == ORIGIN


def test_the_server_binds_to_loopback_by_default() -> None:
    with running_server(ServerConfig(port=0)) as server:  # the default host, as `batchserve serve` uses it
        bound = [sock.getsockname()[0] for listener in server.server.servers for sock in listener.sockets]
    assert bound == ["127.0.0.1"]
