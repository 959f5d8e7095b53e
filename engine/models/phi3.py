"""Phi-3 (Phi3ForCausalLM): the Llama family's decoder layers (engine.models.llama) over a
checkpoint whose projections come fused already: self_attn.qkv_proj holds q, k and v stacked,
mlp.gate_up_proj the gate and up rows, under the names our fused layers carry. The loader reads
each stacked tensor shard by shard (engine.models.loader), so tensor parallelism splits them as
it splits Llama's. Its 128k variants' LongRoPE is a rope type of engine.layers.rotary. This
module only states that layout; it never computes anything of its own.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # No per-projection checkpoint names: a q_proj in a Phi-3 checkpoint is refused as
    # unexpected instead of being loaded into a shard.
    packed_modules = {}  # noqa: RUF012 (the base class declares it a ClassVar)
