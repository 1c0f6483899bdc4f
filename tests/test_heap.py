"""heap.py: what is alive at start-up leaves the collector's generations, what comes later stays."""

import gc

from tailrace.heap import freeze_startup_objects


def test_startup_objects_are_frozen_and_later_ones_are_not():
    startup = [[]]  # a container, so the collector tracks it
    try:
        freeze_startup_objects()
        later = [[]]
        in_generations = {id(o) for o in gc.get_objects()}  # the permanent generation is not listed
        assert id(later) in in_generations and id(startup) not in in_generations
        assert gc.get_freeze_count() > 1000  # this test process's modules and objects
    finally:
        gc.unfreeze()
