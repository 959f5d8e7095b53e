"""gpt-oss (GptOssForCausalLM): the Llama family's decoder layers (engine.models.llama) with
what gpt-oss adds, each from engine.layers: attention sinks (one learned logit per query head
in every softmax, engine.layers.attention), q/k/v and o biases, sliding-window layers between
full ones (from the config's layer_types), YaRN rope, and on every layer a mixture of experts
(engine.layers.moe) whose router and experts carry biases, whose router takes the softmax of its
top-k logits, and whose experts apply a clamped SwiGLU.

Its checkpoints stack the experts: mlp.experts.gate_up_proj [E, hidden, 2I] (gate and up
interleaved, column by column) and down_proj [E, I, hidden] with their biases, or in MXFP4 as
*_blocks and *_scales ([E, rows, cols / 32, 16] and [E, rows, cols / 32], rows the output
features). `checkpoint_tensors` turns each into the per-expert gate/up/down tensors the layers
hold, dequantizing MXFP4 to float at load (engine.models.mxfp4). This module never reads files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, MlpFactory
from engine.models.mixtral import moe_mlp
from engine.models.mxfp4 import dequantize_mxfp4

_EXPERTS = ".mlp.experts."


class GptOssAttention(LlamaAttention):
    """Llama's attention with a sink per query head (this rank's heads)."""

    attention_sinks = True


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention


class GptOssForCausalLM(LlamaForCausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, int | None]]] = {
        **LlamaForCausalLM.packed_modules,
        "router": ("gate", None),
        "sinks": ("attn.sinks", None),
    }
    make_mlp: ClassVar[MlpFactory] = staticmethod(moe_mlp)
    decoder_layer = GptOssDecoderLayer

    def checkpoint_tensors(
        self, key: str, read: Callable[[str], torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """Each expert's tensors, under Llama's per-projection names, from the stacked (or
        MXFP4) ones; None for every other tensor."""
        prefix, found, stacked = key.partition(_EXPERTS)
        if not found:
            return None
        name = stacked.removesuffix("_blocks")
        if stacked.endswith("_scales"):
            return {}  # read with its blocks
        if stacked.endswith("_blocks"):
            # Already [E, out, in]: the layout of our linears.
            weights = dequantize_mxfp4(
                read(key), read(f"{prefix}{_EXPERTS}{name}_scales"), torch.float32
            )
        elif name in ("gate_up_proj", "down_proj"):
            weights = read(key).transpose(1, 2)  # [E, in, out] -> [E, out, in]
        else:
            weights = read(key)  # the biases, [E, out]
        experts = f"{prefix}{_EXPERTS}"
        out: dict[str, torch.Tensor] = {}
        for e, tensor in enumerate(weights):
            suffix = "bias" if name.endswith("_bias") else "weight"
            if name.startswith("gate_up_proj"):
                # Gate and up interleave along the output features.
                out[f"{experts}{e}.gate_proj.{suffix}"] = tensor[0::2]
                out[f"{experts}{e}.up_proj.{suffix}"] = tensor[1::2]
            elif name.startswith("down_proj"):
                out[f"{experts}{e}.down_proj.{suffix}"] = tensor
            else:
                raise ValueError(f"unexpected gpt-oss expert tensor {key!r}")
        return out
