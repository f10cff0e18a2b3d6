"""The heap frozen while an engine serves (serving/engine/heap.py): what is alive at the freeze is out of the
collector's reach for the block's length and collectable again after it."""

from __future__ import annotations

import gc
import weakref

from serving.engine.heap import frozen_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_cycle_alive_at_the_freeze_outlives_collections_inside_the_block_and_not_after():
    cycle = Cycle()
    alive = weakref.ref(cycle)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: no collection walks it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_garbage_made_inside_the_block_is_still_collected():
    with frozen_heap():
        cycle = Cycle()
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None
