"""The KV-cache manager: the scheduler's one door to the pool. It asks for room in positions and gets block ids.

Each request has a `RequestBlocks`: its block table (the block ids its K/V live in, handed to the steps) and,
with prefix caching, what the manager knows about its full blocks (their digests, how many are in the cache).
The scheduler calls, in a request's life:

- `cached_positions(blocks, tokens)` at admission: how many leading positions of the prompt the cache already
  holds (0 without prefix caching); then `can_admit(blocks, positions, reserve)` and `admit(blocks, positions)`:
  the cached blocks held and fresh ones taken for the first `positions`;
- `grow(blocks, positions)` before a step computes up to `positions` (False, nothing taken, when the pool is
  short: the scheduler preempts and asks again);
- `cache_computed(blocks, tokens, computed)` after a step: its full blocks whose K/V are computed go into the
  prefix cache;
- `slide(blocks, computed)` after a step, for a model whose every layer has a sliding window (`window`): the
  blocks wholly older than the window of the next position go back to the pool (their table entries stay, stale:
  no attention reads them, `paged_attention`'s kernel not even the table entries; the torch paths gather them
  masked). The request's row key (its first block of its own, which names its row of the decode steps' tables,
  `cuda_graphs`) is kept until the end;
- `release(blocks)` when it finishes, is cancelled or preempted.

How blocks are shared, digested, looked up and evicted (`prefix_cache`) stays behind this boundary.

Not thread-safe (the scheduler's thread owns it). Imports: stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.engine.kv_cache import BlockAllocator, blocks_for
from serving.engine.prefix_cache import (
    ROOT,
    BlockTable,
    PrefixCachingAllocator,
    block_digests,
    reusable_blocks,
)


@dataclass(eq=False)
class RequestBlocks:
    """One request's blocks: its table, and with prefix caching its known digests and cached leading blocks."""

    table: list[int] = field(default_factory=list)  # block ids, position p in table[p // block_size]
    digests: list[bytes] = field(default_factory=list)  # its full blocks' digests known so far
    registered: int = 0  # its leading blocks in the prefix cache (held: `table[:registered]`)
    cached: list[int] = field(default_factory=list)  # at admission: the cached blocks it will start from
    slid: int = 0  # its leading table entries out of the sliding window, given back (`slide`) but its row key


class KVCacheManager:
    """Block ids for requests, over one pool's allocator (see the module doc)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, *, window: int | None = None) -> None:
        """`window`: every layer's sliding window (`ModelArgs.kv_window`): positions older than it go back to the
        pool as a request advances (`slide`); None: blocks are held until the request ends."""
        self.allocator, self.block_size, self.window = allocator, block_size, window
        self.prefix_caching = isinstance(allocator, PrefixCachingAllocator)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def free(self) -> int:
        """Blocks a request could take now (with prefix caching, cached ones no request holds included)."""
        return self.allocator.free

    @property
    def used(self) -> int:
        return self.allocator.used

    def blocks_needed(self, blocks: RequestBlocks, positions: int) -> int:
        """Blocks `blocks` lacks to hold `positions` positions."""
        return max(0, blocks_for(positions, self.block_size) - len(blocks.table))

    # -- admission ------------------------------------------------------------------------------
    def cached_positions(self, blocks: RequestBlocks, tokens: Sequence[int]) -> int:
        """Leading positions of a waiting request's `tokens` whose K/V the prefix cache holds (its leading full
        blocks before its last token's); remembered for `admit`."""
        blocks.cached = []
        if self.prefix_caching:
            reusable = reusable_blocks(len(tokens), self.block_size)
            self._know_digests(blocks, tokens, reusable)
            blocks.cached = self.allocator.lookup(blocks.digests[:reusable])
        return len(blocks.cached) * self.block_size

    def can_admit(self, blocks: RequestBlocks, positions: int, *, reserve: int) -> bool:
        """Whether the pool can give a waiting request its first `positions` positions and keep `reserve` blocks
        free (one per live request: its next decode may open a block)."""
        need = blocks_for(positions, self.block_size) - len(blocks.cached)
        held_back = self.allocator.evictable_among(blocks.cached) if blocks.cached else 0  # cached, free until taken
        return self.allocator.free - held_back >= need + reserve

    def admit(self, blocks: RequestBlocks, positions: int) -> None:
        """Hold the request's cached blocks and take fresh ones up to `positions` (`can_admit` said yes)."""
        cached = blocks.cached
        if cached:  # held first: taking the fresh blocks may evict cached ones no request holds
            self.allocator.acquire(cached)
        fresh = self.allocator.take(blocks_for(positions, self.block_size) - len(cached)) or []
        blocks.table = BlockTable(cached + fresh, row_key=fresh[0]) if cached else fresh
        blocks.registered, blocks.cached = len(cached), []

    # -- a live request --------------------------------------------------------------------------
    def grow(self, blocks: RequestBlocks, positions: int) -> bool:
        """Take the blocks for `positions`; False (nothing taken) when fewer are free."""
        need = self.blocks_needed(blocks, positions)
        if need > self.allocator.free:
            return False
        if need:
            blocks.table += self.allocator.take(need) or []
        return True

    def cache_computed(self, blocks: RequestBlocks, tokens: Sequence[int], computed: int) -> None:
        """Put the request's full blocks whose K/V are computed (`computed` positions) and whose tokens are known
        into the prefix cache (nothing without prefix caching)."""
        if not self.prefix_caching:
            return
        full = min(computed, len(tokens)) // self.block_size
        if full <= blocks.registered:
            return
        self._know_digests(blocks, tokens, full)
        for i in range(blocks.registered, full):
            self.allocator.register(blocks.table[i], blocks.digests[i])
        blocks.registered = full

    def slide(self, blocks: RequestBlocks, computed: int) -> None:
        """Give back the blocks no query from position `computed` on can see (every key older than the window of
        `computed`: keys at positions < computed - window + 1), but the row key; nothing without a window."""
        if self.window is None:
            return
        out = min(max(0, computed - self.window + 1) // self.block_size, len(blocks.table))
        if out > blocks.slid:
            key = _row_key(blocks.table)
            self.allocator.give_back([b for b in blocks.table[blocks.slid:out] if b != key])
            blocks.slid = out

    def release(self, blocks: RequestBlocks) -> None:
        """Give the request's blocks back (cached ones stay cached until needed): those `slide` has not."""
        table, slid = blocks.table, blocks.slid
        key = _row_key(table) if table else None
        self.allocator.give_back(([key] if key in table[:slid] else []) + table[slid:])
        blocks.table, blocks.registered, blocks.slid = [], 0, 0

    def _know_digests(self, blocks: RequestBlocks, tokens: Sequence[int], count: int) -> None:
        """Extend `blocks.digests` to the first `count` full blocks of `tokens`."""
        known = len(blocks.digests)
        if count > known:
            blocks.digests += block_digests(tokens[:count * self.block_size], self.block_size, start=known,
                                            parent=blocks.digests[-1] if known else ROOT)


def _row_key(table: list[int]) -> int:
    """The block that names a table's row in the decode steps' tables (`cuda_graphs.DecodeGraphs`): a prefix-cached
    table's first block of its own, else its first."""
    return table.row_key if isinstance(table, BlockTable) else table[0]
