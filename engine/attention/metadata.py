"""The flat description of one engine step that every attention backend reads.

Built once per step by the model runner into persistent buffers; backends must treat it as
read-only. Requests are ordered decodes first: the first `num_decodes` requests have exactly
one query token each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: flat slot (block_id * block_size + offset) where each new token's
    # K and V are written.
    slot_mapping: torch.Tensor
    # [num_reqs + 1] int32: cumulative query lengths; request i's tokens are
    # query_start_loc[i]:query_start_loc[i+1] of the flat batch.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: context length of each request after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks] int32: physical block ids, padded with 0 past each request's end.
    block_tables: torch.Tensor
    # The same lengths on the host, so backends never synchronize to read them.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # A model whose KV cache has several groups (sliding and full attention layers, each group
    # its own block table: engine.core.kv_cache_manager) gives each layer its group's
    # metadata, by layer index; None where one table serves every layer (this object's).
    layer_metas: list[AttentionMetadata] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer`'s attention reads: its KV group's slots and tables."""
        return self if self.layer_metas is None else self.layer_metas[layer]
