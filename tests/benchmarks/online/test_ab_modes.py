"""`python -m benchmarks ab --modes ... --policy ...`: every mode and a plug-in policy as runs of one A/B, each
against its own real `batchserve serve`, in one table with a column per mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.loadgen.trace import read_exported
from benchmarks.online import ab
from benchmarks.peers.targets import ServerSettings, Target, mode_targets
from benchmarks.results_io.report import ABOutcome, columns_table, headline_table, result_document
from scheduler.lineup import parse_lineup
from tests.benchmarks.helpers import synthetic_run

SPF = "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"


def _flag(argv: tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_each_entry_of_the_line_up_is_a_server_with_its_mode_its_policy_and_the_same_seats() -> None:
    settings = ServerSettings(seats=6, batch_window_ms=40)
    found = mode_targets(settings, parse_lineup(f"static,dynamic,continuous,spf={SPF}"))
    assert all(isinstance(t, Target) for t in found)
    targets = [t for t in found if isinstance(t, Target)]
    assert [t.name for t in targets] == ["static", "dynamic", "continuous", "spf"]
    assert [_flag(t.argv, "--mode") for t in targets] == ["static", "dynamic", "continuous", "continuous"]
    assert [_flag(t.argv, "--policy") for t in targets] == [None, None, None, SPF]
    for target in targets:
        assert target.argv[:4] == (sys.executable, "-m", "api", "serve")
        assert _flag(target.argv, "--max-batch-size") == _flag(target.argv, "--max-num-seqs") == "6"
        assert _flag(target.argv, "--batch-window-ms") == "40"
    assert "ShortestPromptFirst with continuous's seats" in targets[3].note


def test_the_default_line_up_is_dynamic_and_continuous() -> None:
    args = ab.build_parser().parse_args(["--out", "x"])
    assert [e.name for e in ab.lineup(args)] == ["dynamic", "continuous"]
    args = ab.build_parser().parse_args(["--out", "x", "--modes", "all", "--policy", SPF])
    assert [e.name for e in ab.lineup(args)] == ["static", "dynamic", "continuous", "shortest-prompt-first"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--modes", "static,fast"], "'fast' is neither a mode"), (["--policy", "x.y:Z"], "cannot load the policy")],
)
def test_a_bad_line_up_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        ab.main(["--out", "x", "--baselines", "none", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_every_mode_is_divided_by_dynamic_and_printed_in_its_own_column() -> None:
    runs = {
        "static": synthetic_run("static", scale=4.0, held=0.2),
        "dynamic": synthetic_run("dynamic", scale=2.0, held=0.2),
        "continuous": synthetic_run("continuous", scale=1.0, held=0.0),
    }
    modes = ("static", "dynamic", "continuous")
    table = headline_table(runs, modes)
    assert "| **static/dynamic** |" in table and "| **continuous/dynamic** |" in table
    document = result_document(ABOutcome("cmd", {}, {}, {}, runs, modes=modes))
    assert document["ratios_over_base"]["base"] == "dynamic"
    assert document["ratios_over_base"]["modes"]["static"]["TTFT p50 ms"] == pytest.approx(2.0)
    assert document["ratios_over_base"]["modes"]["continuous"]["TTFT p50 ms"] == pytest.approx(0.5)
    assert document["ratios_continuous_over_dynamic"]["TTFT p50 ms"] == pytest.approx(0.5)
    lines = columns_table(runs).splitlines()
    assert lines[0] == "|  | static | dynamic | continuous |"
    ttft = next(line for line in lines if line.startswith("| TTFT p50 ms |"))
    cells = [cell.strip() for cell in ttft.strip("|").split("|")][1:]
    assert [float(c) for c in cells] == [pytest.approx(4 * float(cells[2])), pytest.approx(2 * float(cells[2])),
                                        pytest.approx(float(cells[2]))]  # fmt: skip


def tiny_run(checkpoint: Path, out: Path, *flags: str) -> list[str]:
    """`ab` flags for a quick run on the tiny checkpoint: float32, 2 seats, short uniform requests, no baselines."""
    return [
        "--model", str(checkpoint), "--dtype", "float32", "--quantization", "none", "--seats", "2",
        "--baselines", "none", "--workload", "uniform", "--input-len", "4", "--output-len", "3", "--warmup", "0",
        "--no-progress", "--out", str(out), *flags,
    ]  # fmt: skip


@pytest.mark.slow
def test_ab_runs_static_dynamic_continuous_and_a_plug_in_against_real_servers(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ab"
    argv = tiny_run(tiny_checkpoint, out, "--modes", "static,dynamic,continuous", "--policy", SPF, "--num-prompts", "5")
    assert ab.main([*argv, "--batch-window-ms", "30"]) == 0
    document = json.loads((out / "result.json").read_text())
    names = ["static", "dynamic", "continuous", "shortest-prompt-first"]
    assert list(document["runs"]) == names
    for name in names:
        summary = document["runs"][name]["summary"]
        assert summary["completed"] == 5 and summary["failed"] == 0 and summary["output_tokens"] == 15, name
    assert "--mode static" in document["servers"]["static"] and "--batch-window-ms 30" in document["servers"]["static"]
    assert f"--policy {SPF}" in document["servers"]["shortest-prompt-first"]
    assert set(document["ratios_over_base"]["modes"]) == {"static", "continuous", "shortest-prompt-first"}
    printed = capsys.readouterr().out
    assert "|  | static | dynamic | continuous | shortest-prompt-first |" in printed
    report = (out / "report.md").read_text()
    assert "# batchserve A/B: static vs dynamic vs continuous vs shortest-prompt-first batching" in report


SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def test_speculation_is_a_dimension_beside_the_modes() -> None:
    settings = ServerSettings(seats=4)
    both = ab.speculation_variants(settings, "both", SPEC)
    assert [(v.speculative_config, suffix) for v, suffix in both] == [(None, ""), (SPEC, ab.SPEC_SUFFIX)]
    targets = [t for v, suffix in both for t in mode_targets(v, parse_lineup("dynamic,continuous"), suffix)]
    assert [t.name for t in targets if isinstance(t, Target)] == [
        "dynamic",
        "continuous",
        "dynamic-spec",
        "continuous-spec",
    ]
    argvs = [t.argv for t in targets if isinstance(t, Target)]
    assert [_flag(a, "--speculative-config") for a in argvs] == [None, None, SPEC, SPEC]
    # A config alone turns it on; none and no flag leaves it off.
    assert [v.speculative_config for v, _ in ab.speculation_variants(settings, None, SPEC)] == [SPEC]
    assert ab.speculation_variants(settings, None, None) == [(settings, "")]


@pytest.mark.parametrize(
    ("speculation", "config", "named"),
    [
        ("on", None, "needs --speculative-config"),
        ("off", SPEC, "--speculation is off"),
        ("both", '{"method": "ngram"}', "--speculative-config num_speculative_tokens is required"),
        ("on", '{"method": "ngram", "num_speculative_tokens": 4, "draft_length": "x"}', "draft_length"),
        ("on", "[1]", "--speculative-config must be a JSON object"),
    ],
)
def test_a_missing_or_malformed_speculative_config_is_refused_naming_it(
    speculation: str, config: str | None, named: str
) -> None:
    with pytest.raises(ValueError, match=named.replace("-", "\\-")):
        ab.speculation_variants(ServerSettings(), speculation, config)


def test_ab_refuses_a_malformed_config_before_starting_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ab.main(["--speculation", "both", "--speculative-config", "{", "--out", "unused"])
    assert "--speculative-config is not valid JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_rounds_interleave_the_servers_and_pool_their_runs(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ab"
    flags = ("--modes", "dynamic,continuous", "--num-prompts", "3", "--rounds", "2", "--export-workload")
    assert ab.main(tiny_run(tiny_checkpoint, out, *flags)) == 0
    starts = [line.split(":")[0] for line in capsys.readouterr().err.splitlines() if "starting its server" in line]
    assert starts == ["dynamic", "continuous", "dynamic", "continuous"]  # round by round, not target by target
    assert (out / "raw" / "continuous.server.log").exists() and (out / "raw" / "continuous.round2.server.log").exists()
    document = json.loads((out / "result.json").read_text())
    for name in ("dynamic", "continuous"):
        summary = document["runs"][name]["summary"]
        assert summary["completed"] == 6 and summary["output_tokens"] == 18, name  # both rounds' requests
        assert len(json.loads((out / "raw" / f"{name}.json").read_text())["records"]) == 6
    rounds = document["rounds"]
    assert rounds["base"] == "dynamic"
    continuous = rounds["targets"]["continuous"]
    assert len(continuous["output_tok_s"]) == 2 and all(v > 0 for v in continuous["output_tok_s"])
    ratios = continuous["output_tok_s_over_base"]
    dynamic = rounds["targets"]["dynamic"]["output_tok_s"]
    assert ratios == pytest.approx([c / d for c, d in zip(continuous["output_tok_s"], dynamic, strict=True)])
    assert continuous["median_output_tok_s_over_base"] == pytest.approx(sum(ratios) / 2)
    assert "## Rounds, interleaved" in (out / "report.md").read_text()
    # a replay's trace is one round's requests: the rounds repeat them, hours apart on the server's clock
    assert {name: len(trace) for name, trace in read_exported(out).main.items()} == {"dynamic": 3, "continuous": 3}


def test_rounds_below_one_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ab.main(["--rounds", "0", "--baselines", "none", "--out", "unused"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
