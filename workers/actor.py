"""`WorkerActor`: a thin Ray actor around `Worker` (model, paged KV tensors, sampler).

The controller wraps this class with `ray.remote` (found through
`ControllerOptions.worker_cls`) and creates one per GPU (`num_gpus=1`) or `num_workers` of
them on CPU with a fractional CPU reservation (`worker_num_cpus`), then drives each with its
own step loop: one `execute` call per step. A GPU worker takes two calls at once
(`WORKER_MAX_CONCURRENCY`), so that Ray receives the next step while one runs; a CPU worker
one (`cluster.worker_overlap_calls`). Its `StepGate` runs steps strictly one at a time and
in the order sent (each plan is a diff on the previous one); every other call that touches
the worker's state waits its turn too.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller.budget import AutoBudget, AutoBudgetResult
from controller.gc_freeze import freeze_long_lived
from controller.messages import StepPlan, StepResult, decode_plan, encode_message
from workers.step_gate import WORKER_MAX_CONCURRENCY, StepGate

if TYPE_CHECKING:
    from workers.worker import CacheSection, WorkerSection


@dataclass(frozen=True)
class WorkerInfo:
    """What the controller needs to build the worker's scheduler and the edge's checks."""

    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    model_path: str
    device: str
    pid: int
    torch_threads: int  # intra-op threads: Ray sets OMP_NUM_THREADS from num_cpus
    # New for every start of the actor's process: a restarted worker has empty KV tensors,
    # and a plan built against its predecessor's blocks must not run on it.
    incarnation: str = ""
    node_id: str = ""  # the Ray node the process runs on ("" outside Ray)
    node_ip: str = ""


def _ray_node() -> tuple[str, str]:
    """(node id, node IP) of this process's Ray node, or empty strings outside Ray."""
    import ray

    if not ray.is_initialized():
        return "", ""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class WorkerRestartedError(RuntimeError):
    """A plan addressed to an earlier incarnation of this worker (its KV is gone)."""


class WorkerActor:
    # Read by whoever starts the actor (Ray's `max_concurrency`): the controller names
    # the class by an import path and imports nothing of the workers.
    MAX_CONCURRENCY = WORKER_MAX_CONCURRENCY

    def __init__(self, section: WorkerSection, cache: CacheSection) -> None:
        """`section`, `cache`: the validated `worker:` and `cache:` sections, whole (the
        controller sets `section.device` to where this actor runs)."""
        from workers.worker import build_worker  # torch is imported in the actor process only

        section = dataclasses.replace(  # type: ignore[type-var]
            section, device=_resolve_device(section.device))
        self.worker = build_worker(section, cache)
        self.bound_cores: list[int] = []  # the cores torch's threads are pinned to, if any
        if self.worker.device.type == "cpu" and section.cpu_bind_threads:
            from workers.cpu_setup import bind_threads_to_cores

            self.bound_cores = bind_threads_to_cores()
        self.num_steps = 0
        self.gate = StepGate()
        self.incarnation = uuid.uuid4().hex
        # As configured: the budget cache's spec.
        self.model, self.dtype = section.model, section.dtype
        freeze_long_lived("worker")  # no full collection of torch's objects mid-step

    def info(self) -> WorkerInfo:
        import torch

        w = self.worker
        return WorkerInfo(w.num_kv_blocks, w.block_size, w.vocab_size,
                          tuple(w.eos_token_ids), w.model_config.max_model_len,
                          str(w.model_path), str(w.device), os.getpid(),
                          torch.get_num_threads(), self.incarnation, *_ray_node())

    def execute(self, plan: StepPlan | bytes, incarnation: str | None = None,
                sender: str | None = None, seq: int | None = None) -> StepResult | bytes:
        """Run one step, in its turn (`sender`, `seq`: workers/step_gate.py); a plan sent
        as bytes is answered in bytes, decoded and encoded outside the turn, beside the
        step before or after. `incarnation` names the process the plan was built for; a
        plan for an earlier one is refused before it touches any state."""
        step = decode_plan(plan)
        with self.gate.turn(sender, seq):
            if incarnation is not None and incarnation != self.incarnation:
                raise WorkerRestartedError(
                    f"plan for worker incarnation {incarnation}, this is {self.incarnation}")
            self.num_steps += 1
            result = self.worker.execute(step)
        return encode_message(result) if isinstance(plan, bytes) else result

    def budget_table(self, request: AutoBudget) -> AutoBudgetResult:
        """The budget table of this worker's model, device, dtype and threads: cached, or
        measured here on this worker before it serves (the controller asks worker 0 once,
        before its first plan). Leaves no request behind."""
        from workers.auto_budget import worker_budget_table

        with self.gate.turn():
            try:
                return worker_budget_table(self.worker, self.model, self.dtype, request)
            finally:
                self.worker.reset()

    def held_block_ids(self) -> set[int]:
        with self.gate.turn():
            return self.worker.held_block_ids()

    def reset(self) -> int:
        """Forget every request; returns how many there were. A (restarted) controller
        calls it before its first plan: this process outlived the one that planned them."""
        with self.gate.turn():
            num_requests = self.worker.num_active_requests
            self.worker.reset()
            self.gate.retire()  # steps the gone controller queued must not run now
            return num_requests

    def num_active_requests(self) -> int:
        with self.gate.turn():
            return self.worker.num_active_requests


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
