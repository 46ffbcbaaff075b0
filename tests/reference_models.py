"""What the engine's answers are checked against: transformers' own `generate()`, on the very weights served."""

from __future__ import annotations

import copy
from typing import Any

import torch

from engine.weights.loader import LoadedModel
from engine.weights.quantization import Int4Weight


def dequantized_model(loaded: LoadedModel) -> Any:
    """The loaded model with its projections and LM head set to the quantised weights' dequantised values (the
    model itself when nothing is quantised)."""
    if not loaded.quantized:
        return loaded.model
    dtype = next(loaded.model.parameters()).dtype
    reference = copy.deepcopy(loaded.model).float()
    modules = dict(reference.named_modules())
    for name, weight in loaded.quantized.items():
        # int4 scales and zeros are held in the activations' dtype, as the kernel reads them; the LM head's new
        # Parameter unties it from the embedding.
        dense = weight.dequantize(dtype) if isinstance(weight, Int4Weight) else weight.dequantize()
        modules[name].weight = torch.nn.Parameter(dense)
    return reference.to(dtype)


def generate_exactly(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt alone, exactly `new_tokens` long (EOS does not stop it)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
