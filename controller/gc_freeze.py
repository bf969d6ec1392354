"""Keep Python's cyclic garbage collector off the step loop's critical path.

After start-up a serving process holds a few hundred thousand long-lived objects (torch,
transformers, Ray, the model's modules), and a full collection walks all of them, landing
on whichever step happens to allocate past the threshold (such a step runs well over its
predicted time in the policies benchmark). `gc.freeze()` moves everything
alive now to a permanent generation that collections skip; garbage made later, per
request and per step, is still collected, and cheaply.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_long_lived(what: str) -> float:
    """Collect once, then freeze what survives; call at the end of a process's start-up
    (again after a later start-up phase: each call freezes what was added since).
    Returns the seconds it took."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    elapsed = time.perf_counter() - started
    logger.debug("%s: %d objects frozen out of the collector in %.3f s", what,
                 gc.get_freeze_count(), elapsed)
    return elapsed
