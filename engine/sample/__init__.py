"""Sampling: a request's sampling parameters, the edits to a step's logits (bias, allowed ids, grammars, penalties),
the vectorised sampler and its compiled kernels, and the step's sampling half that records each row's token."""
