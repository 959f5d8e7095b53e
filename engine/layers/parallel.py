"""Tensor-parallel building blocks: which slice of each weight a rank holds, and the layers
that combine the ranks' partial results (all-reduce after row-parallel layers and the
vocabulary-parallel embedding, a gather of the vocabulary-parallel logits on rank 0).

Column-parallel layers split their output features (q/k/v heads, gate/up rows), row-parallel
ones their input features; each records the rows or columns of the checkpoint tensor it holds
(`CheckpointSlice`) so the loader reads only those. The layers themselves are this package's
linear and vocab modules; with one rank they run exactly as without this module: no
collective, no extra copy. This module never starts processes nor reads files; the process
group comes from engine.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (size 1: no group at all)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1
    # Mixtures of experts: whole experts per rank instead of a slice of each (engine.layers.moe).
    expert_parallel: bool = False


SINGLE = TensorParallel()


@dataclass(frozen=True)
class CheckpointSlice:
    """Along one dimension of a checkpoint tensor of `full` entries, this rank holds
    [start, start + count)."""

    start: int
    count: int
    full: int


def check_tensor_parallel_size(num_heads: int, num_kv_heads: int, size: int) -> None:
    """N must divide the query heads; KV heads are split when N divides them and replicated
    when they divide N (as vLLM does)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if num_heads % size or (num_kv_heads % size and size % num_kv_heads):
        allowed = [n for n in range(1, num_heads + 1) if _shardable(num_heads, num_kv_heads, n)]
        raise ValueError(
            f"tensor_parallel_size {size} does not fit this model's {num_heads} attention "
            f"heads and {num_kv_heads} KV heads: it must divide the attention "
            "heads, and either divide the KV heads or be a multiple of them; "
            f"possible sizes: {', '.join(map(str, allowed))}"
        )


def _shardable(num_heads: int, num_kv_heads: int, size: int) -> bool:
    return num_heads % size == 0 and (num_kv_heads % size == 0 or size % num_kv_heads == 0)


def split_evenly(full: int, tp: TensorParallel) -> CheckpointSlice:
    """This rank's contiguous share of `full` entries; the first `full % size` ranks get one
    more (so an intermediate size that N does not divide still shards)."""
    base, extra = divmod(full, tp.size)
    start = tp.rank * base + min(tp.rank, extra)
    return CheckpointSlice(start, base + (tp.rank < extra), full)


def kv_heads_slice(num_kv_heads: int, tp: TensorParallel) -> CheckpointSlice:
    """The KV heads this rank holds: its share when N divides them, otherwise the one head its
    query heads read (replicated on N / num_kv_heads ranks)."""
    if num_kv_heads % tp.size == 0:
        return split_evenly(num_kv_heads, tp)
    return CheckpointSlice(tp.rank * num_kv_heads // tp.size, 1, num_kv_heads)


def scaled(heads: CheckpointSlice, head_dim: int) -> CheckpointSlice:
    """A slice of heads as a slice of rows."""
    return CheckpointSlice(heads.start * head_dim, heads.count * head_dim, heads.full * head_dim)


def vocab_slice(vocab_size: int, tp: TensorParallel) -> tuple[CheckpointSlice, int]:
    """(the checkpoint rows this rank reads, its padded row count). Every rank holds
    ceil(V / N) rows so the gathered logits line up; rows past the vocabulary stay zero."""
    padded = -(-vocab_size // tp.size)
    start = min(tp.rank * padded, vocab_size)
    return CheckpointSlice(start, min(padded, vocab_size - start), vocab_size), padded


def all_reduce_(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    dist.all_reduce(x, group=tp.group)
    return x


def embed(input_ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embedding lookup; with N ranks each looks up the ids in its vocabulary rows (zeros for
    the others) and an all-reduce sums the ranks' rows into the full embeddings."""
    if tp.size == 1:
        return F.embedding(input_ids, weight)
    start = tp.rank * weight.shape[0]
    local = input_ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    x = F.embedding(local.masked_fill_(outside, 0), weight)
    x.masked_fill_(outside.unsqueeze(1), 0)
    return all_reduce_(x, tp)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor | None:
    """Rank 0 gets the full [rows, vocab_size] logits from every rank's vocabulary columns;
    the other ranks get None (only rank 0 samples)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(local, parts, dst=dist.get_global_rank(tp.group, 0), group=tp.group)
    if parts is None:
        return None
    return torch.cat(parts, dim=1)[:, :vocab_size]
