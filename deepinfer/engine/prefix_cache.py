"""Which KV blocks hold a known token prefix (docs/prefix_caching.md).

A full block of a prompt is named by a chained hash: h_j = sha256(h_{j-1} | tokens of block j), with
h_{-1} naming the data-parallel group whose ranks hold the sequence's KV (executor/step_fanout.py:
a sequence's rows run on group state_slot % dp, so only that group's ranks hold its blocks). Nothing
else changes a block's KV: the forward is a function of the token ids and positions alone (Engram's
n-gram ids included, and a block's positions follow from its index in the chain).

The cache maps hashes to blocks and keeps the blocks no sequence holds (reference count 0) in
least-recently-released order; those count as free and are reclaimed, oldest first, only when the
free list is empty. A block a sequence holds is never reclaimed nor written: a sequence only writes
positions past its computed length, and a cached block lies wholly before it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_hashes(token_ids, block_size: int, num_blocks: int, group: int = 0,
                 known: list[bytes] | None = None) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks of `token_ids` (extends `known`, a prefix of them)."""
    out = list(known or ())
    parent = out[-1] if out else b"group:%d" % group
    for j in range(len(out), num_blocks):
        tokens = array("q", token_ids[j * block_size:(j + 1) * block_size])
        assert len(tokens) == block_size, "only full blocks are hashed"
        parent = hashlib.sha256(parent + tokens.tobytes()).digest()
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self):
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, held by no sequence; oldest first
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0

    def __contains__(self, block: int) -> bool:
        return block in self.hash_of

    @property
    def num_idle(self) -> int:
        return len(self.idle)

    def match(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes`."""
        blocks = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert(self, h: bytes, block: int) -> bool:
        """Name `block` by `h` unless another block already holds that prefix (it stays unnamed then)."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h] = block
        self.hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """A cached block no sequence holds any more: reclaimable, most recently released last."""
        self.idle[block] = None

    def unpark(self, block: int) -> None:
        del self.idle[block]

    def evict(self) -> int:
        """Forget the least recently released idle block and return it."""
        block, _ = self.idle.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        self.num_evicted_blocks += 1
        return block

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit
