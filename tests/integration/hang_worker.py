"""A worker actor with a scripted hang, for the chaos tests: the first step that carries a
request whose id starts with `hang` sleeps far past any deadline, once per marker file (the
restarted process finds no marker and runs normally)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from controller.messages import StepPlan, StepResult
from workers.actor import WorkerActor

MARKER = Path(tempfile.gettempdir()) / "tokenflow-test-hang-once"
HANG_S = 600.0


class HangOnceWorker(WorkerActor):
    def execute(self, plan: StepPlan, incarnation: str | None = None) -> StepResult:
        if any(rid.startswith("hang") for rid in plan.num_scheduled_tokens):
            try:
                MARKER.unlink()  # only one process may take the marker
            except FileNotFoundError:
                pass
            else:
                time.sleep(HANG_S)  # the controller's deadline kills this process first
        return super().execute(plan, incarnation)
