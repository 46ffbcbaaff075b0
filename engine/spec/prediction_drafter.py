"""Predicted Outputs as drafts: the text a client expects the answer to be (OpenAI's `prediction`, as editors send
the file they are asking to change) proposes the next tokens of the answer.

The answer is aligned with the prediction by an `offset`: its token i stands for the prediction's token i + offset
(0 while the answer follows the prediction; an insertion of m tokens makes it -m, a deletion +m). Each step looks
the answer's last tokens up in the prediction, the longest suffix first (up to PREDICTION_MATCH_TOKENS tokens); of
the places it occurs, the one the offset expects wins, else the first after it, else the last; a suffix shorter than
PREDICTION_REALIGN_TOKENS counts only where the offset expects it. So a prediction that repeats itself (code does)
is read forward from where the answer stands, and an answer that leaves the prediction gets no drafts until its
last few tokens occur in the prediction again, where drafting resumes."""

from __future__ import annotations

import torch

PREDICTION_MATCH_TOKENS = 8  # the longest output suffix looked up in the prediction
# A suffix shorter than this re-aligns only where the offset expects it: one or two common tokens ("the", ",")
# occur all over a prediction, and drafts from a chance match are rejected drafts, which cost a wider step.
PREDICTION_REALIGN_TOKENS = 3


def propose_from_prediction(
    prediction: torch.Tensor, output: torch.Tensor, k: int, offset: int = 0
) -> tuple[list[int], int]:
    """Up to `k` drafts from `prediction` ([P] long) for an answer whose tokens so far are `output` ([L] long), and
    the alignment they follow (the next call's `offset`); ([], offset) where nothing aligns."""
    length, size = int(output.shape[0]), int(prediction.shape[0])
    if k <= 0 or size == 0:
        return [], offset
    expected = length + offset  # where the answer's next token stands in the prediction, if nothing changed
    if length == 0:
        return prediction[max(expected, 0) : max(expected, 0) + k].tolist(), offset
    for n in range(min(PREDICTION_MATCH_TOKENS, length, size), 0, -1):
        ends = (prediction.unfold(0, n, 1) == output[length - n :]).all(dim=1).nonzero()[:, 0] + n
        if n < PREDICTION_REALIGN_TOKENS:
            ends = ends[ends == expected]
        if len(ends):
            ahead = ends[ends >= expected]
            end = int(ahead[0] if len(ahead) else ends[-1])
            return prediction[end : end + k].tolist(), end - length
    return [], offset
