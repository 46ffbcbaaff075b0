"""Token ids to the first layer's input rows: the model's embedding table, or a tied Q6_K head's own rows.

A tied Q6_K head (llama.cpp's 4-bit files of Llama-3.2-1B) holds the embedding too. Its rows read back from the
layout the head runs in (or from its dense values, where it runs dense) are the dense table's values bit for bit (the
table is gguf's dequantisation of the same blocks, in the activations' dtype), so no table is held at all: 525 MB
of bfloat16 for a 128k-token vocabulary, and the 1 GB of float32 the load would have read to make it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.head_linear import Int6DotLinear
from engine.model.linear import AnyLinear, Linear, RowSwitchedLinear
from engine.weights.quantization import QuantizedWeight, embedding_in_q6_k_head


@dataclass(frozen=True)
class HeadRows:
    """Rows of a tied head's weight, looked up per step in the activations' dtype."""

    head: Int6DotLinear | Linear
    dtype: torch.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head, Int6DotLinear):
            return self.head.rows(ids).to(self.dtype)
        return F.embedding(ids, self.head.weight)


TokenEmbedding = nn.Embedding | HeadRows


def build_embedding(
    table: nn.Embedding, config: Any, quantized: dict[str, QuantizedWeight], head: AnyLinear, dtype: torch.dtype
) -> TokenEmbedding:
    """The built `head`'s rows where the model ties its embedding to a Q6_K head
    (engine.weights.quantization.embedding_in_q6_k_head; a serving load keeps no `table` then), else the `table`."""
    if not embedding_in_q6_k_head(config, quantized):
        return table
    source = head.quantized if isinstance(head, RowSwitchedLinear) else head
    if isinstance(source, Int6DotLinear) or (isinstance(source, Linear) and not source.weight.is_meta):
        return HeadRows(source, dtype)
    raise ValueError(f"the tied Q6_K head runs as {type(source).__name__}, which holds no rows to look up")
