"""Test helper: AttentionMetadata and scattered block tables from plain lists.

An independent, deliberately simple builder (the engine's real one lives in the model runner);
tests use it to drive backends and models. It must never import engine code beyond the
metadata dataclass.
"""

from __future__ import annotations

import math

import torch

from engine.attention.metadata import AttentionMetadata


class BlockPool:
    """Hands out block ids in a shuffled order, so tables are scattered and unsorted."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()

    def grow(self, table: list[int], num_tokens: int, block_size: int) -> list[int]:
        """Extends table in place until it holds num_tokens tokens; returns it."""
        while len(table) * block_size < num_tokens:
            table.append(self.free.pop())
        return table


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int | None = None,
) -> AttentionMetadata:
    """Requests in the given order; num_decodes defaults to the leading run of 1-token queries."""
    if num_decodes is None:
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
    slots = []
    for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
        assert len(table) >= math.ceil(s / block_size), "block table too short"
        slots += [
            table[pos // block_size] * block_size + pos % block_size for pos in range(s - q, s)
        ]
    width = max(len(t) for t in block_tables)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32
        ),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def outside_window(
    tables: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
    window: int,
    block_size: int,
    poison: int,
) -> list[list[int]]:
    """Copies of the tables with every block that lies wholly before what a request's first
    query token sees under a sliding window replaced by block `poison`: as the KV cache manager
    frees such blocks, and a backend must never read them."""
    out = []
    for table, q, s in zip(tables, query_lens, seq_lens, strict=True):
        first_seen = max(0, s - q - window + 1)
        out.append(
            [poison if (i + 1) * block_size <= first_seen else b for i, b in enumerate(table)]
        )
    return out
