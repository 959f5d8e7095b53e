"""The chained content hash of KV cache blocks: one function for the engine and the gateway.

A full block of `block_size` token ids is named by the hash of its parent block's hash and its
own token ids, so one hash names the whole prefix that ends with that block. The engine's prefix
cache registers blocks under these hashes and publishes them in its KV events; the gateway
hashes a prompt the same way to ask which replica holds its leading blocks. Both must agree
bit for bit, hence one module. Pure computation: it never imports torch or touches a device.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# The parent of a sequence's first block.
ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: it identifies the whole prefix ending at this block."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int | None = None
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, first block first (at most
    `max_blocks` of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for i in range(count):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
