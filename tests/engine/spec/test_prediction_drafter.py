"""Predicted Outputs' drafts (engine/spec/prediction_drafter.py): the prediction read forward from where the answer so
far aligns with it, re-aligned after the answer leaves it."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.spec.prediction_drafter import propose_from_prediction


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def test_an_answer_that_follows_the_prediction_gets_its_next_tokens() -> None:
    prediction = t([5, 6, 7, 8, 9, 10])
    assert propose_from_prediction(prediction, t([]), 3) == ([5, 6, 7], 0)
    assert propose_from_prediction(prediction, t([5, 6]), 3) == ([7, 8, 9], 0)
    assert propose_from_prediction(prediction, t([5, 6, 7, 8, 9, 10]), 3) == ([], 0)  # the prediction is used up


def test_a_run_of_one_token_is_read_where_the_answer_stands() -> None:
    prediction = t([3, 4, 4, 4, 4, 4, 4, 5, 6])
    # the suffix "4 4" ends at 3, 4, 5, 6 and 7 in the prediction: the answer's own position (5) wins
    assert propose_from_prediction(prediction, t([3, 4, 4, 4, 4]), 4) == ([4, 4, 5, 6], 0)


def test_after_an_insertion_drafting_resumes_where_the_answer_meets_the_prediction_again() -> None:
    prediction = t([1, 2, 3, 4, 5, 6, 7])
    # the answer inserted 40, 41 after 2: nothing aligns (a lone 3 could be chance) until "3 4 5" is written; then
    # the offset is -2
    assert propose_from_prediction(prediction, t([1, 2, 40, 41]), 4) == ([], 0)
    assert propose_from_prediction(prediction, t([1, 2, 40, 41, 3]), 4) == ([], 0)
    assert propose_from_prediction(prediction, t([1, 2, 40, 41, 3, 4, 5]), 4) == ([6, 7], -2)
    # and a deletion (the answer skipped 3 and 4) moves it the other way
    assert propose_from_prediction(prediction, t([1, 2, 5, 6]), 2) == ([], 0)
    assert propose_from_prediction(prediction, t([1, 2, 5, 6, 7]), 2) == ([], 2)  # the prediction is used up


def test_a_short_match_counts_only_where_the_answer_stands() -> None:
    prediction = t([1, 2, 3, 9, 4, 5, 9, 6])
    assert propose_from_prediction(prediction, t([7, 7, 9]), 2) == ([], 0)  # a lone 9 elsewhere: chance
    assert propose_from_prediction(prediction, t([1, 2, 3, 9]), 2) == ([4, 5], 0)  # where it stands: taken


def test_a_repeating_prediction_is_read_forward_from_the_answer() -> None:
    prediction = t([7, 8, 1, 7, 8, 2, 7, 8, 3])
    # "7 8" occurs three times: the answer (offset 2) stands after the second
    assert propose_from_prediction(prediction, t([9, 7, 8, 2]), 2, offset=2) == ([7, 8], 2)
    assert propose_from_prediction(prediction, t([1, 7, 8]), 2, offset=2) == ([2, 7], 2)
    # no occurrence at or after where the answer stands: the last one
    assert propose_from_prediction(prediction, t([1, 7, 8]), 2, offset=9) == ([2, 7], 2)


def test_no_drafts_without_room_or_prediction() -> None:
    assert propose_from_prediction(t([1, 2, 3]), t([1]), 0, offset=1) == ([], 1)
    assert propose_from_prediction(t([]), t([1]), 4) == ([], 0)
    assert propose_from_prediction(t([1, 2, 3]), t([9]), 4) == ([], 0)


@given(
    prediction=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    data=st.data(),
    k=st.integers(1, 8),
)
def test_an_answer_on_the_prediction_always_gets_the_tokens_after_it(
    prediction: list[int], data: st.DataObject, k: int
) -> None:
    """However often the prediction repeats itself (an alphabet of 4), an answer that is a prefix of it, aligned
    at offset 0, is drafted exactly the prediction's next k tokens, and keeps offset 0."""
    length = data.draw(st.integers(0, len(prediction)), label="length")
    drafts, offset = propose_from_prediction(t(prediction), t(prediction[:length]), k)
    assert drafts == prediction[length : length + k]
    assert offset == 0 or not drafts
