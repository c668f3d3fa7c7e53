"""Rank 0's bookkeeping of one rank's KV blocks: free list, reference counts and the prefix cache.

A rank's KV pool is ``num_blocks`` blocks of ``block_size`` token slots; this class decides who
uses which block, and the rank only writes and reads where the plan says. A full block is
identified by a hash of its tokens and of every token before it (a chain: block i's key covers
block i-1's), so two sequences with the same first N*block_size tokens share the same first N
blocks. Blocks no sequence references stay cached, evicted least recently used when a block is
needed. Nothing here runs a collective or touches a tensor.
"""

from __future__ import annotations

import collections
import hashlib
from array import array


def chain_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The prefix key of every full block of ``tokens`` (16-byte BLAKE2b over the parent's key and
    the block's token ids): equal keys mean equal tokens up to the end of that block."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[start:start + block_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # cached full block -> its prefix key
        self._block_of: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; LRU first
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    # -- counts ------------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks a sequence could get now: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    # -- allocation ---------------------------------------------------------------------------------
    def allocate(self) -> int | None:
        """A block for one sequence (reference count 1), evicting the least recently used cached
        block when none is free; None when every block is referenced."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        else:
            return None
        self._refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks stay, the rest are free."""
        for block in reversed(blocks):  # a sequence's tail is evicted before its head
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} released more often than taken"
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------------------
    def match_prefix(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (not yet taken)."""
        blocks = []
        if self.prefix_caching:
            for key in keys:
                block = self._block_of.get(key)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def count_unreferenced(self, blocks: list[int]) -> int:
        """How many of these (cached) blocks no sequence references: counted as available now."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def take(self, blocks: list[int]) -> None:
        """One more reference to each of these cached blocks (a sequence reuses them)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """``block`` now holds the keys and values of a full block whose prefix key is ``key``."""
        if not self.prefix_caching or block in self._key_of or key in self._block_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (new weights: what the blocks hold was computed by the old ones);
        blocks nobody references become free, referenced ones stay their sequences'."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()

    def count_lookup(self, tokens: int, hit: int) -> None:
        self.queries += tokens
        self.hits += hit
