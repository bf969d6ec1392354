"""Start-up objects are frozen out of the cyclic collector (controller/gc_freeze.py)."""

from __future__ import annotations

import gc

from cluster.engine import LocalEngine
from controller.gc_freeze import freeze_long_lived


def test_local_engine_freezes_its_start_up_objects():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    engine = LocalEngine(worker={"model": "builtin:tiny", "telemetry": False})
    # The model, torch and the engine itself are frozen: a full collection skips them.
    frozen = gc.get_freeze_count()
    assert frozen > 10_000
    tracked = {id(o) for o in gc.get_objects()}
    assert id(engine.worker.model) not in tracked  # in the permanent generation
    # Garbage made after start-up is still collected.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1
    assert freeze_long_lived("again") >= 0 and gc.get_freeze_count() >= frozen
    gc.unfreeze()
