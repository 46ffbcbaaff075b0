"""`batchserve compare --modes ...`: any line-up of built-in modes and plug-in policies, each under its own prefix
with its own policy, on the tiny model; a mode named `static` beside the page's own `/static/` files."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from api.apps.compare import mode_config
from api.cli import build_parser, compare_config, compare_lineup, main
from scheduler.lineup import parse_lineup
from tests.server_harness import lineup_server

SPF = "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"
KEY = "three-panes"


@pytest.fixture(scope="module")
def static_and_plug_in() -> Iterator[str]:
    with lineup_server(f"static,spf={SPF}") as base_url:
        yield base_url


def test_each_pane_is_listed_with_its_prefix_its_settings_and_its_policy(static_and_plug_in: str) -> None:
    listed = httpx.get(f"{static_and_plug_in}/v1/compare/modes").json()["data"]
    assert [(e["mode"], e["prefix"], e["seats"]) for e in listed] == [("static", "/static", 3), ("spf", "/spf", 3)]
    assert listed[0]["batch_window_ms"] == 20.0 and "policy" not in listed[0]
    assert (listed[1]["policy"], listed[1]["policy_mode"], listed[1]["max_num_seqs"]) == (SPF, "continuous", 3)
    health = httpx.get(f"{static_and_plug_in}/health")
    assert health.status_code == 200 and health.json()["modes"] == {"static": "ok", "spf": "ok"}


@pytest.mark.parametrize(("name", "mode"), [("static", "static"), ("spf", "continuous")])
def test_each_prefix_serves_under_its_own_policy(static_and_plug_in: str, name: str, mode: str) -> None:
    api = openai.OpenAI(base_url=f"{static_and_plug_in}/{name}/v1", api_key="unused", max_retries=0, timeout=60)
    model = api.models.list().data[0].id
    reply = api.completions.create(model=model, prompt=["one", "two words"], max_tokens=3, temperature=0)
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert reply.model_extra is not None and reply.model_extra["timings"]["mode"] == mode
    metrics = httpx.get(f"{static_and_plug_in}/{name}/metrics")  # not the page's /static/ file route
    assert metrics.status_code == 200 and f'mode="{name}"' in metrics.text


def test_the_root_metrics_label_every_pane_by_its_name_and_the_page_files_still_load(static_and_plug_in: str) -> None:
    body = httpx.get(f"{static_and_plug_in}/metrics").text
    assert 'mode="static"' in body and 'mode="spf"' in body and 'mode="continuous"' not in body
    script = httpx.get(f"{static_and_plug_in}/static/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")


def test_the_key_guards_a_mode_named_static_though_the_page_files_are_open() -> None:
    with lineup_server("static,continuous", api_key=KEY) as base_url:
        assert httpx.get(f"{base_url}/static/v1/models").status_code == 401
        assert httpx.get(f"{base_url}/static/metrics").status_code == 401
        keyed = httpx.get(f"{base_url}/static/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200
        assert httpx.get(f"{base_url}/static/style.css").status_code == 200


def test_the_command_reads_modes_and_a_policy_pane() -> None:
    args = build_parser().parse_args(["compare", "--modes", "static,dynamic,continuous", "--policy", SPF])
    assert [e.name for e in compare_lineup(args)] == ["static", "dynamic", "continuous", "shortest-prompt-first"]
    assert [e.name for e in compare_lineup(build_parser().parse_args(["compare"]))] == ["dynamic", "continuous"]
    with pytest.raises(SystemExit, match="'stat' is neither a mode"):
        main(["compare", "--modes", "stat,dynamic"])
    with pytest.raises(SystemExit, match="appear"):
        main(["compare", "--modes", "dynamic,dynamic"])


SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_a_spec_pane_is_its_mode_with_the_speculative_config_and_the_others_go_without() -> None:
    args = build_parser().parse_args(["compare", "--modes", "dynamic,continuous,continuous-spec", "--seats", "2"])
    args.speculative_config = SPEC
    lineup = compare_lineup(args)
    assert [(e.name, e.mode.value, e.speculative) for e in lineup] == [
        ("dynamic", "dynamic", False),
        ("continuous", "continuous", False),
        ("continuous-spec", "continuous", True),
    ]
    config = compare_config(args)
    split = [mode_config(config, entry, split=True) for entry in lineup]
    assert [c.speculative_config for c in split] == [None, None, SPEC]
    assert [c.mode for c in split] == ["dynamic", "continuous", "continuous"]
    # Without a -spec pane the flag is every pane's, as before.
    assert all(mode_config(config, entry).speculative_config == SPEC for entry in lineup)
    # A plug-in named NAME-spec speculates too.
    assert compare_lineup(build_parser().parse_args(["compare", "--modes", f"spf-spec={SPF}", *FLAG]))[0].speculative
    with pytest.raises(SystemExit, match="continuous-spec speculates: give --speculative-config"):
        main(["compare", "--modes", "continuous,continuous-spec"])
    with pytest.raises(ValueError, match="neither a mode"):
        parse_lineup("continuous-spec")  # ab and simulate take speculation as --speculation both instead
    with pytest.raises(ValueError, match="appear"):
        parse_lineup("continuous-spec,continuous-spec", speculation=True)


FLAG = ("--speculative-config", SPEC)


def test_only_the_spec_pane_drafts() -> None:
    with lineup_server("continuous,continuous-spec", speculative_config=SPEC) as base_url:
        listed = {e["mode"]: e for e in httpx.get(f"{base_url}/v1/compare/modes").json()["data"]}
        assert listed["continuous-spec"]["speculative_tokens"] == 4 and listed["continuous-spec"]["draft_length"]
        assert "speculative_tokens" not in listed["continuous"]
        drafted = {}
        for name in ("continuous", "continuous-spec"):
            model = httpx.get(f"{base_url}/{name}/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "one two one two one two", "max_tokens": 24, "temperature": 0}
            reply = httpx.post(f"{base_url}/{name}/v1/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["finish_reason"] == "length", reply
            drafted[name] = reply["timings"]["draft_tokens"]
        assert drafted["continuous"] == 0 and drafted["continuous-spec"] > 0
