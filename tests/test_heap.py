"""heap.py: what is alive at start-up leaves the collector's generations."""

import gc

from tailrace.heap import freeze_startup_objects


def test_startup_objects_are_frozen_and_later_ones_are_not():
    try:
        freeze_startup_objects()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this test process's modules and objects
        later = [[] for _ in range(100)]
        assert gc.is_tracked(later[0]) and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
