"""Long-lived objects kept out of the garbage collector's way once a serving process has started."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now (modules, the app and its routes, the model's
    modules, the tokenizer) into the permanent generation, so that a full collection walks only
    what serving allocates. Unfrozen, the API process at c=128 on the embedded model ran 3 full
    collections of about 0.2 s each in a 20 s run, each a stall of every open stream, and an
    in-process engine at 256 sequences one of 92 ms (timed with `gc.callbacks`)."""
    gc.collect()
    gc.freeze()
