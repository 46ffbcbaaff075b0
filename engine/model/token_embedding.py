"""Token ids to the first layer's input rows: the model's embedding table, or a tied LM head's Q6_K values.

A tied Q6_K head (llama.cpp's 4-bit files of Llama-3.2-1B) holds the embedding too: looking tokens up in its
values, as gguf's dequantizer gives them, is the dense table's function bit for bit (the table is those values in
the activations' dtype), so the dense table is not needed at all: 525 MB of bfloat16 for a 128k-token vocabulary,
and the 1 GB of float32 the load would read to make it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.weights.quantization import Int6Weight, QuantizedWeight, tied_q6_k_embedding


@dataclass(frozen=True)
class Int6Embedding:
    """Rows of an Int6Weight, dequantised per lookup into the activations' dtype."""

    weight: Int6Weight
    dtype: torch.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize(ids).to(self.dtype)


TokenEmbedding = nn.Embedding | Int6Embedding


def build_embedding(
    module: nn.Embedding, config: Any, quantized: dict[str, QuantizedWeight], dtype: torch.dtype
) -> TokenEmbedding:
    """The tied head's Q6_K values where the model has them (engine.weights.quantization.tied_q6_k_embedding),
    else the model's own table."""
    values = tied_q6_k_embedding(config, quantized)
    return module if values is None else Int6Embedding(values, dtype)
