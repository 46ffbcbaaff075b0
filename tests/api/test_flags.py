"""api.flags: the ServerConfig <-> flags bridge, and docs/flags.md's table, which must match the code."""

from __future__ import annotations

import argparse
import re

import pytest

from api.cli import build_parser
from api.config import API_KEY_ENV, ServerConfig
from api.flags import FLAGS_DOC, add_config_flags, config_from_args, flags_argv, markdown_table, with_table


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_docs_flags_table_matches_the_code() -> None:
    doc = FLAGS_DOC.read_text()
    assert with_table(doc) == doc, "docs/flags.md is out of date: run `python -m api.flags --write`"


def test_the_table_lists_every_serve_flag_once() -> None:
    listed = re.findall(r"^\| `(--[a-z0-9-]+)`", markdown_table(), flags=re.MULTILINE)
    flags = {s for a in _serve_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    plain = {f for f in flags if not (f.startswith("--no-") and "--" + f[5:] in flags)}
    assert sorted(listed) == sorted(plain)


def test_flags_argv_round_trips_through_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    values = {"mode": "dynamic", "max_batch_size": "3", "cpu_kernels": False, "cors_origins": ["http://a", "http://b"]}
    config = config_from_args(parser.parse_args(flags_argv(values)))
    expected = ServerConfig(mode="dynamic", max_batch_size=3, cpu_kernels=False, cors_origins=("http://a", "http://b"))
    assert config == expected
