"""A worker actor with a scripted hang, for the chaos tests: the first step that carries a
request whose id starts with `hang` sleeps far past any deadline, once per marker file (the
restarted process finds no marker and runs normally). While `SLOW_START` exists, a process
starting up waits for the test to remove it: the test decides when the restarted worker is
back, so it can look at the service while the worker is down."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from controller.messages import StepPlan, StepResult, decode_plan
from workers.actor import WorkerActor

MARKER = Path(tempfile.gettempdir()) / "tokenflow-test-hang-once"
SLOW_START = Path(tempfile.gettempdir()) / "tokenflow-test-slow-start"
HANG_S = 600.0
START_WAIT_S = 120.0


class HangOnceWorker(WorkerActor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        deadline = time.monotonic() + START_WAIT_S
        while SLOW_START.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the scripted slow start: the test removes the file
        super().__init__(*args, **kwargs)

    def execute(self, plan: StepPlan | bytes, incarnation: str | None = None,
                sender: str | None = None, seq: int | None = None) -> StepResult | bytes:
        if any(rid.startswith("hang") for rid in decode_plan(plan).num_scheduled_tokens):
            try:
                MARKER.unlink()  # only one process may take the marker
            except FileNotFoundError:
                pass
            else:
                time.sleep(HANG_S)  # the controller's deadline kills this process first
        return super().execute(plan, incarnation, sender, seq)
