"""The settings of worker recovery (`recovery:`), read by the worker loop
(controller/worker_loop.py)."""

from __future__ import annotations

from dataclasses import dataclass

from controller.settings import FORBID_EXTRA, check_settings, setting


@dataclass(frozen=True)
class RecoveryConfig:
    """How the controller notices a dead or hung worker and brings it back (`recovery:`)."""

    __pydantic_config__ = FORBID_EXTRA

    step_deadline_factor: float = setting(20.0, gt=0, description=(
        "A step running longer than this many times the cost model's prediction (and "
        "step_deadline_min_s) counts as a hang: the worker is killed and handled as dead."))
    step_deadline_min_s: float = setting(30.0, gt=0, description=(
        "Floor of the step deadline (first steps compile kernels and capture graphs)."))
    ready_timeout_s: float = setting(60.0, gt=0, description=(
        "How long one 'are you back?' call to a failed worker may take."))
    restart_backoff_s: float = setting(0.2, gt=0, description=(
        "First wait between tries to reach a failed worker; doubles up to the maximum."))
    restart_backoff_max_s: float = setting(5.0, gt=0, description=(
        "Longest wait between tries to reach a failed worker."))
    max_worker_failures_per_request: int = setting(3, ge=1, description=(
        "A request that was on this many failing workers is aborted with an error: it may "
        "be what kills them."))

    def __post_init__(self) -> None:
        check_settings(self)
