"""Prefix caching for the paged KV cache: full blocks of computed K/V shared by the requests whose tokens
start the same way (a system prompt, a chat's earlier turns), as vLLM's automatic prefix caching does.

A block is known by the digest of its tokens and of every block before it (`block_digests`: sha256 over the
parent's digest and the block's token ids, so a request can never be handed another prompt's K/V through a
hash collision). Once a request has computed a full block and knows its tokens, the scheduler `register`s it
under that digest. A later request's prompt is looked up block by block (`lookup`), its longest cached run
of leading blocks taken (`acquire`) instead of computed, and its prefill starts after them.

`PrefixCachingAllocator` is the pool's allocator with that cache in it. A block has a reference count (the
live requests holding it); a cached block whose count falls to 0 is kept, evictable, until a block is needed
and none is free: then the least recently released cached block is evicted (its digest forgotten) and reused.
So `free` counts free and evictable blocks alike, and a preempted or finished request leaves its prefix for
the next one. Only full blocks are shared; a request writes only blocks it holds alone (the block its
prompt's last token falls in is never taken from the cache: `reusable_blocks`), and its table is a `BlockTable`
named by the first of those.

Not thread-safe (the scheduler's thread owns it). Imports: stdlib only.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

from serving.engine.kv_cache import BlockAllocator

ROOT = b""  # the parent digest of a sequence's first block


def block_digests(tokens: Sequence[int], block_size: int, *, start: int = 0, parent: bytes = ROOT) -> list[bytes]:
    """The digests of the full blocks of `tokens` from block `start` on (`parent`: the digest of block
    `start - 1`)."""
    out = []
    for b in range(start, len(tokens) // block_size):
        chunk = tokens[b * block_size:(b + 1) * block_size]
        parent = hashlib.sha256(parent + b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk)).digest()
        out.append(parent)
    return out


def reusable_blocks(prompt_len: int, block_size: int) -> int:
    """Leading blocks of a prompt that may come from the cache: every full block before the one holding its last
    token, which the request computes itself (its logits start the generation)."""
    return (prompt_len - 1) // block_size


class BlockTable(list):
    """A sequence's block table that starts with shared blocks: `row_key`, the first block it took for itself,
    names the sequence where its first block would (`cuda_graphs` keeps each live sequence's table on the
    device under that name, and a shared first block would name several)."""

    def __init__(self, blocks: Sequence[int], row_key: int) -> None:
        super().__init__(blocks)
        self.row_key = row_key


class PrefixCachingAllocator(BlockAllocator):
    """A `BlockAllocator` whose released full blocks stay cached under their digests (see the module doc)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._refs = [0] * num_blocks
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest release first
        self.evicted = 0

    @property
    def free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks some request holds (cached blocks no request holds are free to take)."""
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Blocks held under a digest, in use or evictable."""
        return len(self._by_digest)

    def take(self, n: int) -> list[int] | None:
        """`n` blocks that hold nothing cached any more (free ones first, then the least recently released
        cached ones), or None (and nothing taken) when fewer are free or evictable."""
        if n > self.free:
            return None
        while len(self._free) < n:
            self._evict_oldest()
        out = super().take(n) or []
        for b in out:
            self._refs[b] = 1
        return out

    def give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._refs[b] == 0:
                raise ValueError(f"block {b} is not taken (pool of {self.num_blocks}); a double free")
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._digest_of:
                self._evictable[b] = None
            else:
                super().give_back([b])

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `digests` from the first (nothing taken)."""
        out = []
        for d in digests:
            b = self._by_digest.get(d)
            if b is None:
                break
            out.append(b)
        return out

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (cached ones) no request holds: taking them lowers `free` by as many."""
        return sum(1 for b in blocks if b in self._evictable)

    def acquire(self, blocks: Sequence[int]) -> None:
        """Hold cached `blocks` (from `lookup`) for one more request."""
        for b in blocks:
            if b not in self._digest_of:
                raise ValueError(f"block {b} is not cached")
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(self, block: int, digest: bytes) -> None:
        """`block`, held and fully computed, now holds the K/V of the tokens behind `digest`. A digest already
        cached keeps its block (another request computed the same tokens); this one stays private."""
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is not taken; only a held block can be registered")
        if digest in self._by_digest or block in self._digest_of:
            return
        self._by_digest[digest] = block
        self._digest_of[block] = digest

    def _evict_oldest(self) -> None:
        b, _ = self._evictable.popitem(last=False)
        del self._by_digest[self._digest_of.pop(b)]
        self.evicted += 1
        super().give_back([b])
