"""An A/B's batchserve servers on one weight format (benchmarks/online/format_pin.py): the first server's `auto`
choice, read from its log, is passed explicitly to every later one, for what the user left open."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.online import ab
from benchmarks.online.format_pin import is_batchserve, pin_from, pinned, served_format
from benchmarks.peers.targets import ServerSettings, Target, mode_targets
from scheduler.lineup import parse_lineup

# A busy start's log, as in benchmarks/results/busy-start: the choice provisional, so the next start may differ.
LOG = """batchserve.loader: weights: the previous start's choice (int4/bfloat16, quantised at every size) was
provisional: measuring again
batchserve.loader: weights: int4/float32, quantised up to 16 rows, 3% ahead of float32 (noise 9%), chosen by auto
provisionally: the lead is inside the noise measured (ms at 1/16 rows/128-token prefill: float32 41.5/69.3/212.0)
"""


def _modes(settings: ServerSettings) -> list[Target]:
    targets = mode_targets(settings, parse_lineup("dynamic,continuous"))
    assert all(isinstance(target, Target) and is_batchserve(target) for target in targets)
    return [target for target in targets if isinstance(target, Target)]


def _flag(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, part in enumerate(argv) if part == flag]


def test_the_first_servers_format_is_read_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "dynamic.server.log"
    log.write_text(LOG)
    assert served_format(log) == ("float32", "int4")
    log.write_text("batchserve.loader: weights: bfloat16 (0 quantised matmuls)\n")
    assert served_format(log) == ("bfloat16", "none")
    assert served_format(tmp_path / "missing.log") is None


def test_every_later_mode_starts_on_the_first_ones_format(tmp_path: Path) -> None:
    first, later = _modes(ServerSettings(dtype="auto"))
    log = tmp_path / "dynamic.server.log"
    log.write_text(LOG)
    served = served_format(log)
    assert served is not None
    pin = pin_from(served, first.name, None, "auto")  # the user's flags: none, and --quantization auto
    assert pin is not None and pin.source == "dynamic"
    argv = pinned(later, pin).argv
    assert _flag(argv, "--dtype") == ["float32"] and _flag(argv, "--quantization") == ["int4"]
    assert [part for part in argv if part not in ("--dtype", "float32", "--quantization", "int4", "auto")] == [
        part for part in later.argv if part not in ("--dtype", "auto")
    ]  # otherwise the same command


def test_a_format_the_user_fixed_stays_theirs() -> None:
    _, later = _modes(ServerSettings(dtype="bfloat16"))
    pin = pin_from(("float32", "int4"), "dynamic", "bfloat16", None)
    assert pin is not None
    argv = pinned(later, pin).argv
    assert _flag(argv, "--dtype") == ["bfloat16"] and _flag(argv, "--quantization") == ["int4"]
    assert pin_from(("float32", "int4"), "dynamic", "float32", "none") is None  # nothing left to `auto`


def test_ab_pins_the_modes_to_one_format_and_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver's wiring, with each server start played by a function that logs what a busy machine's `auto` would
    pick: a different format at each start, unless the command names one."""
    flips = iter(["int4/float32", "int4/bfloat16"])
    commands: list[tuple[str, ...]] = []

    def start(target: Target, specs: object, make: object, sweep: object, log: Path, launch: object) -> object:
        commands.append(target.argv)
        dtype, quantization = _flag(target.argv, "--dtype"), _flag(target.argv, "--quantization")
        served = f"{quantization[0]}/{dtype[0]}" if dtype and quantization else next(flips)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"batchserve.loader: weights: {served}, chosen by auto provisionally\n")
        return ab.TargetOutcome(target, " ".join(target.argv), None, (), None)

    monkeypatch.setattr(ab, "run_target", start)
    ab.main(["--out", str(tmp_path), "--modes", "dynamic,continuous", "--baselines", "none", "--num-prompts", "1"])
    assert "--dtype" not in commands[0]  # the first resolves auto itself
    assert _flag(commands[1], "--dtype") == ["float32"] and _flag(commands[1], "--quantization") == ["int4"]
    assert "int4/float32, as dynamic resolved auto: pinned" in capsys.readouterr().err
    settings = json.loads((tmp_path / "result.json").read_text())["settings"]
    assert settings["weights"] == {"dynamic": "int4/float32", "continuous": "int4/float32"}
    assert settings["weights_pinned_from"] == "dynamic"


def test_a_settled_choice_is_not_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A settled choice is what every later start reads from the cache, row switch included: explicit flags would
    replace its measured switch with the default, so the later servers start as the first did."""
    commands: list[tuple[str, ...]] = []

    def start(target: Target, specs: object, make: object, sweep: object, log: Path, launch: object) -> object:
        commands.append(target.argv)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("batchserve.loader: weights: int4/bfloat16, chosen by auto, measured here 2026-12-04\n")
        return ab.TargetOutcome(target, " ".join(target.argv), None, (), None)

    monkeypatch.setattr(ab, "run_target", start)
    ab.main(["--out", str(tmp_path), "--modes", "dynamic,continuous", "--baselines", "none", "--num-prompts", "1"])
    assert all("--dtype" not in command and "--quantization" not in command for command in commands)
    settings = json.loads((tmp_path / "result.json").read_text())["settings"]
    assert settings["weights"] == {"dynamic": "int4/bfloat16", "continuous": "int4/bfloat16"}
    assert settings["weights_pinned_from"] is None
