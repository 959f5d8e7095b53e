"""The chained block hash shared by the engine and the gateway: a block's hash names its whole
prefix, partial blocks get none."""

from __future__ import annotations

from common.block_hash import ROOT_HASH, hash_block, prefix_block_hashes


def test_a_block_hash_names_its_whole_prefix():
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # the partial last block has none
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    # Same second block, another first one: another hash for both.
    assert a[0] != b[0] and a[1] != b[1]
    assert prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, max_blocks=1) == a[:1]
