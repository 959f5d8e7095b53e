"""The vocabulary's weights: the token embedding and the output projection (lm_head), each one
[vocab rows, hidden] weight under its checkpoint name; with tensor parallelism each rank holds
a padded share of the rows (engine.layers.parallel's embed and gather_logits combine them).
A GGUF's Q8_0/Q6_K rows stay grouped int8 (engine.layers.quantization): the lookup dequantizes
only the rows it reads, and a tied vocabulary projection multiplies by the same copy.
This module only creates the parameters and looks rows up: the loader fills them, the model
projects.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import empty_parameter
from engine.layers.parallel import CheckpointSlice, TensorParallel, embed, vocab_slice
from engine.layers.quantization import QuantizedWeight


class VocabRows(nn.Module):
    """One [vocab rows, hidden] weight under the checkpoint's name (model.embed_tokens.weight,
    lm_head.weight); with several ranks, this rank's rows (checkpoint_rows tells the loader)."""

    def __init__(self, weight: torch.Tensor, checkpoint_rows: list[CheckpointSlice] | None):
        super().__init__()
        self.weight = weight
        self.checkpoint_rows = checkpoint_rows
        # The rows as a GGUF's grouped int8 (on one rank), `weight` then empty.
        self.quantized: QuantizedWeight | None = None

    def lookup(self, input_ids: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """The embeddings of `input_ids`: [*ids.shape, hidden]."""
        if self.quantized is not None:
            return self.quantized.rows(input_ids).to(self.weight.dtype)
        return embed(input_ids, self.weight, tp)


def vocab_rows(
    vocab_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel,
) -> VocabRows:
    rows, padded = vocab_slice(vocab_size, tp)
    weight = empty_parameter(padded, hidden_size, dtype=dtype, device=device)
    return VocabRows(weight, [rows] if tp.size > 1 else None)
