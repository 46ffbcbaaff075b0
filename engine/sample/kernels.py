"""The sampler's compiled kernels, with torch fallbacks: a one-pass greedy argmax, and each row's token logprob and
best alternatives through the prompt-scoring kernel (both engine/csrc/sampling.cpp). The caller passes the kernels
(the runner's): never whatever build this process happens to have loaded, so a runner built without them
(`--no-cpu-kernels`) samples through torch."""

from __future__ import annotations

import torch

from engine.platform import native


def argmax_rows(logits: torch.Tensor, kernels: native.Kernels | None = None) -> torch.Tensor:
    """Greedy argmax of each row of [rows, vocab] logits (lowest index on ties): [rows] int64.

    Uses the one-pass kernel of `kernels` (None: torch's argmax); rows must hold no NaN (the sampler's inputs never
    do)."""
    usable = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
    if kernels is not None and usable and logits.shape[-1] > 0:
        return kernels.ops.argmax_rows(logits)  # type: ignore[no-any-return]
    return logits.argmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, kernels: native.Kernels | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log_softmax(logits) at each row's token, and the k best (ids, logprobs) per row, best first (None when k=0).

    logits: [rows, vocab] float32, tokens: [rows]. With `kernels`, their prompt-scoring kernel does it in passes over
    each row while it sits in cache, instead of log_softmax writing a second [rows, vocab] tensor that a gather and a
    top-k then read again (engine/csrc/sampling.cpp); its logprobs agree to ~1e-6. None: torch."""
    k = min(k, logits.shape[-1])
    usable = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
    if kernels is not None and usable and logits.shape[-1] > 0:
        scored, _, best_ids, best_logprobs = kernels.prompt_scores(logits, tokens, k)
        return scored, (best_ids if k > 0 else None), (best_logprobs if k > 0 else None)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    if k == 0:
        return chosen, None, None
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return chosen, top_ids, top_logprobs
