"""Every numeric flag of `batchserve serve` and `batchserve compare`, found by walking the parser (a new flag is
covered without a change here), refuses NaN, the infinities, 1e13, a denormal, negatives and, where its range starts
above 0, zero, with one line naming the flag (exit 2); its range's ends are accepted and one past the top refused.
The frozen config dataclasses refuse the same values in `__post_init__`, naming the field.

Before: `--batch-timeout-ms 1e13` or `inf` killed the loop thread, `--batch-window-ms 1e-320` made every request
waiting for a tick a 500, `--batch-timeout-ms nan` and `--batch-window-ms inf` made requests wait forever."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, get_type_hints

import pytest

from api.cli import build_parser, compare_config
from api.config import RuntimeOptions, ServerConfig
from api.flags import NumberFlag, _base_type, config_from_args
from scheduler.config import RANGES, SchedulerConfig
from scheduler.ranges import Range

COMMANDS = ("serve", "compare")
ALWAYS_BAD = ("nan", "NaN", "inf", "-inf", "1e13", "1e-320", "-1", "-0.5", "1e400")


def subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]  # type: ignore[no-any-return]


def numeric_flags(command: str) -> list[argparse.Action]:
    """The flags whose value is parsed as something other than text: every numeric one, whoever added it."""
    return [a for a in subcommand(command)._actions if a.option_strings and a.type not in (None, str)]


FLAGS = [(command, action) for command in COMMANDS for action in numeric_flags(command)]


def bounds_of(action: argparse.Action) -> Range:
    assert isinstance(action.type, NumberFlag), f"{action.option_strings[0]} declares no range (scheduler/ranges.py)"
    return action.type.bounds


def bad_values(bounds: Range) -> list[str]:
    values = [*ALWAYS_BAD, str(bounds.high + 1), str(bounds.low - 1)]
    if bounds.low_open or bounds.low > 0:
        values += ["0", "0.0"]
    if bounds.low_open:
        values.append(str(bounds.low))
    return values


def refusal(command: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, *argv])
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_the_walk_finds_the_flags_of_the_issue() -> None:
    found = {(command, action.option_strings[0]) for command, action in FLAGS}
    for flag in ("--batch-timeout-ms", "--batch-window-ms", "--max-num-seqs", "--port", "--shutdown-grace-s"):
        assert {("serve", flag), ("compare", flag)} <= found
    assert ("serve", "--replicas") in found and ("compare", "--seats") in found


@pytest.mark.parametrize(("command", "action"), FLAGS, ids=[f"{c} {a.option_strings[0]}" for c, a in FLAGS])
def test_each_numeric_flag_refuses_what_is_out_of_range_in_one_line_naming_it(
    command: str, action: argparse.Action, capsys: pytest.CaptureFixture[str]
) -> None:
    flag, bounds = action.option_strings[0], bounds_of(action)
    for value in bad_values(bounds):
        err = refusal(command, [f"{flag}={value}"], capsys)  # `=`: argparse reads a bare "-inf" as a flag
        assert err.count("\n") == 1, err
        assert err.startswith(f"batchserve {command}: error: argument {flag}: must be {bounds.describe()}, got"), err
        assert "Traceback" not in err


@pytest.mark.parametrize(("command", "action"), FLAGS, ids=[f"{c} {a.option_strings[0]}" for c, a in FLAGS])
def test_each_numeric_flag_takes_its_range_and_the_config_agrees(command: str, action: argparse.Action) -> None:
    flag, bounds = action.option_strings[0], bounds_of(action)
    edges = [bounds.high] if bounds.low_open else [bounds.low, bounds.high]
    if not bounds.low_open and bounds.low == 0:
        edges.append(0)
    for edge in edges:
        text = str(int(edge)) if bounds.integer else str(float(edge))
        args = build_parser().parse_args([command, flag, text])
        assert getattr(args, action.dest) == edge
        if command == "serve" and action.dest != "replicas":
            assert getattr(config_from_args(args), action.dest) == edge
        elif command == "compare" and action.dest != "seats":
            assert getattr(compare_config(args), action.dest) == edge
    default = action.default
    assert default is None or bounds.refusal(default) is None, f"{flag}'s default {default!r} is out of its range"


def test_every_numeric_config_field_declares_a_range() -> None:
    hints = get_type_hints(ServerConfig)
    numeric = [f.name for f in dataclasses.fields(ServerConfig) if _base_type(hints[f.name]) in (int, float)]
    assert "batch_timeout_ms" in numeric
    assert [name for name in numeric if "range" not in ServerConfig.__dataclass_fields__[name].metadata] == []
    hints = get_type_hints(SchedulerConfig)
    numeric = [f.name for f in dataclasses.fields(SchedulerConfig) if _base_type(hints[f.name]) in (int, float)]
    assert sorted(numeric) == sorted(RANGES)


def bad_config_values(bounds: Range) -> list[Any]:
    values: list[Any] = [math.nan, math.inf, -math.inf, 1e13, 1e-320, -1, -0.5, bounds.high + 1, "1", True]
    if bounds.low_open or bounds.low > 0:
        values.append(0)
    return values


def server_fields() -> list[tuple[str, Range]]:
    return [(f.name, f.metadata["range"]) for f in dataclasses.fields(ServerConfig) if "range" in f.metadata]


@pytest.mark.parametrize(("name", "bounds"), server_fields(), ids=[name for name, _ in server_fields()])
def test_server_config_refuses_the_same_values_naming_the_field(name: str, bounds: Range) -> None:
    for value in bad_config_values(bounds):
        with pytest.raises(ValueError, match=f"^{name} must be {bounds.describe()}, got"):
            ServerConfig(**{name: value})


@pytest.mark.parametrize("name", sorted(RANGES))
def test_scheduler_config_refuses_the_same_values_naming_the_field(name: str) -> None:
    for value in bad_config_values(RANGES[name]):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            SchedulerConfig(**{name: value})


@pytest.mark.parametrize("name", ["max_model_len", "kv_cache_tokens", "max_quantized_rows"])
def test_runtime_options_refuse_out_of_range_sizes_naming_the_field(name: str) -> None:
    values: tuple[Any, ...] = (math.nan, math.inf, 1e13, -1, 2.5, 1 << 40)
    for value in values:
        with pytest.raises(ValueError, match=f"^{name} must be an integer"):
            RuntimeOptions(**{name: value})
