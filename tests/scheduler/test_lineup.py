"""The line-up that `compare --modes`, `ab --modes` and `simulate --mode` read: built-in modes, `all`, plug-ins with
and without a name, the mode a plug-in borrows its seats from, and the errors that name what is wrong."""

from __future__ import annotations

import pytest

from scheduler.config import Mode
from scheduler.lineup import Entry, parse_entry, parse_lineup
from scheduler.static import StaticPolicy

SPF = "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"


class TickingStatic(StaticPolicy):
    """A plug-in over static batching: it borrows static's seats and settings."""


def test_built_in_modes_and_all_keep_their_order() -> None:
    assert parse_lineup("dynamic,continuous") == (Entry("dynamic", Mode.DYNAMIC), Entry("continuous", Mode.CONTINUOUS))
    assert [e.name for e in parse_lineup(" continuous , static ")] == ["continuous", "static"]
    assert [e.mode for e in parse_lineup("all")] == [Mode.STATIC, Mode.DYNAMIC, Mode.CONTINUOUS]


def test_a_plug_in_is_named_by_its_class_or_by_the_name_given_and_runs_on_its_classs_mode() -> None:
    assert parse_entry(SPF) == Entry("shortest-prompt-first", Mode.CONTINUOUS, SPF)
    assert parse_entry(f"spf={SPF}") == Entry("spf", Mode.CONTINUOUS, SPF)
    path = f"{__name__}:TickingStatic"
    assert parse_entry(path) == Entry("ticking-static", Mode.STATIC, path)
    assert parse_entry(f"spf={SPF}").description == f"spf ({SPF}, continuous's seats)"
    assert [e.name for e in parse_lineup(f"continuous,{SPF},fast={SPF}")] == [
        "continuous", "shortest-prompt-first", "fast",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no modes given"),
        ("dynamic,bus", "'bus' is neither a mode (static, dynamic, continuous) nor a policy"),
        ("static,all", "static appear(s) twice"),
        (f"{SPF},{SPF}", "shortest-prompt-first appear(s) twice"),
        ("nowhere.at_all:Policy", "cannot load the policy 'nowhere.at_all:Policy'"),
        ("scheduler.config:Mode", "is not a subclass of scheduler.policy.Policy"),
        (f"v1={SPF}", "the policy's name 'v1'"),
        (f"continuous={SPF}", "the policy's name 'continuous'"),
        (f"Fast={SPF}", "the policy's name 'Fast'"),
    ],
)
def test_a_bad_line_up_is_a_value_error_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_lineup(text)
    assert message in str(error.value)
