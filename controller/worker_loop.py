"""`WorkerSlot`: one worker actor as the controller sees it, with its async step loop.

One step is the core's `StepLoop` (controller/step_loop.py) over the slot's transport:
`begin` (flow control sees every `chunk_complete` and `cache_evict` before it plans, the
plan is sent), `plan_ahead` (with async scheduling), await the result under the step
deadline, `finish`, hand the outputs to the slot's `SlotListener`. How the plan reaches the
actor (a Ray actor call, or a compiled graph) is the slot's `transport`
(controller/transport.py).
The loop parks on `wake` when there is nothing to send the worker; everything that can
create work (a new request, an abort) calls `notify()`. `parked` is set only while the
loop waits and nobody has notified it since, which is what the integrity check needs to
know that the worker has been told about every finished request.

Only a failed worker call (the actor died, raised, or outlived the step deadline) sends
the worker to recovery (kill, move its requests, wait for a new incarnation). An
exception in the controller's own part of a step is a controller bug: the worker is
healthy and stays. If the worker ran the plan, the step's requests fail with an error;
if the plan never reached it, what it holds is unknown, so every request here fails and
the worker drops its state (`reset`). Either way their blocks are released, the error is
logged and counted (`num_controller_errors`), and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from controller.backoff import Backoff
from controller.core import ControllerCore
from controller.messages import FinishReason, RequestOutput, StepPlan, StepResult
from controller.recovery import RecoveryConfig
from controller.step_loop import StepLoop
from controller.transport import ActorCallTransport, WorkerTransport, make_transport

logger = logging.getLogger(__name__)
# Step records kept for stats and the overhead benchmark; older ones are dropped.
_MAX_RECORDS = 4096
_RATIO_WEIGHT = 0.2  # of the newest step in the measured / predicted step time
T = TypeVar("T")


def slot_transport(options: Any, index: int, handle: Any, info: Any) -> WorkerTransport:
    """How plans reach worker `index` (`cluster.worker_transport`), not yet opened."""
    cluster = options.cluster
    return make_transport(cluster.worker_transport, handle, info.incarnation,
                          cluster.compiled_graph_probe_s, options.recovery.ready_timeout_s,
                          name=f"worker {index}")


class WorkerCallError(RuntimeError):
    """A call to the worker actor failed (Ray actor or task error, an error the worker
    raised): the only kind of failure that sends a worker to recovery."""


class WorkerHungError(WorkerCallError):
    """A call to the worker outlived its deadline."""


def is_process_gone(err: WorkerCallError) -> bool:
    """Whether Ray said the worker's process died or is restarting (a `RayActorError`:
    Ray restarts it by itself), not that it hung or raised. By the class's name: this
    module imports no Ray."""
    cause = err.__cause__
    return cause is not None and any(c.__name__ == "RayActorError"
                                     for c in type(cause).__mro__)


class SlotListener(Protocol):
    """Who hears of a slot's steps (the controller actor), given to it when it is built."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their consumers."""

    def on_step(self, result: StepResult) -> None:
        """A step's outputs were delivered (the journal's step boundary)."""

    def on_requests_moved(self, workers: list[int]) -> None:
        """These workers received a failed worker's requests."""


class WorkerSlot:
    def __init__(self, index: int, handle: Any, info: Any, core: ControllerCore,
                 listener: SlotListener, kill: Callable[[Any], None] | None = None,
                 recovery: RecoveryConfig | None = None,
                 transport: WorkerTransport | None = None) -> None:
        self.index = index
        self.handle = handle  # the worker actor
        self.info = info  # its WorkerInfo
        # How plans reach it (controller/transport.py); the caller `reopen`s it first.
        self.transport = transport or ActorCallTransport(handle, info.incarnation)
        self.core = core
        self.listener = listener
        # Kills the worker's process so that it restarts (Ray: `ray.kill(h, no_restart=False)`).
        self.kill = kill or (lambda handle: None)
        self.recovery = recovery or RecoveryConfig()
        self.num_hangs = 0
        self.up = asyncio.Event()  # cleared from a failure until the worker is back
        self.up.set()
        self.wake = asyncio.Event()
        self.telemetry_poll_s = 0.1  # empty steps while paused, for telemetry samples
        self.parked = asyncio.Event()
        self.stepped = asyncio.Event()  # set after every step: a drain waits on it
        self.task: asyncio.Task[None] | None = None
        self.is_stopped = False  # set by `stop`: the loop ends at its next turn
        self.num_routed = 0
        self.num_steps = 0
        self.num_failures = 0
        self.num_requests_moved = 0  # unfinished requests its failures moved to others
        # Exceptions in the controller's own part of a step (a bug, not the worker's fault).
        self.num_controller_errors = 0
        self.wall_s = 0.0  # controller wall time per step, summed
        self.compute_s = 0.0  # worker-reported compute time, summed
        # Recent steps: (requests, tokens, wall s, worker compute s, actor call s). Wall
        # minus call is the controller's own work; call minus compute is Ray's transport.
        self.records: deque[tuple[int, int, float, float, float]] = deque(maxlen=_MAX_RECORDS)
        # (step id, request id -> tokens) of recent non-empty steps: who advanced when.
        self.plan_log: deque[tuple[int, dict[str, int]]] = deque(maxlen=_MAX_RECORDS)
        # The worker actor runs calls one at a time, in order: a step sent ahead (async
        # scheduling) runs after the one before it.
        self.loop = StepLoop(core, index, self._send,
                             is_ahead=core.scheduler(index).config.is_async(is_actor=True))
        self._last_received = float("-inf")
        # Measured / predicted step time (wall, as the controller sees it), smoothed.
        self._step_time_ratio = 1.0

    def start(self) -> None:
        # A fresh context, so no Ray call's cancellation can reach the loop (see actor.py).
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"step-{self.index}", context=contextvars.Context())

    async def stop(self) -> None:
        """End the step loop for good (a drained worker) and return once it has ended.
        A cancel alone is not enough: one that lands as an awaited call completes may be
        lost (Python 3.11's `asyncio.wait_for` returns the result instead), and the loop
        would then park for ever; so the loop also ends on `is_stopped`, woken here."""
        self.request_stop()
        if self.task is None:
            return
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task

    def request_stop(self) -> None:
        """`stop` without waiting for the loop to end (a shutdown that cannot await it)."""
        self.is_stopped = True
        if self.task is not None:
            self.task.cancel()
            self.notify()

    def notify(self) -> None:
        self.parked.clear()
        self.wake.set()

    def after_release(self) -> None:
        """Blocks were released outside a step (abort): the loop must tell flow control
        and the worker."""
        self.notify()

    # -- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        force = False
        while not self.is_stopped:
            # Cleared before looking at the state: a notify during the step below re-arms it.
            self.wake.clear()
            try:
                stepped = await self._step(force)
                force = False
                self.stepped.set()
            except WorkerCallError as err:  # a dead or failing worker must not kill the loop
                if isinstance(err, WorkerHungError):
                    self.num_hangs += 1
                logger.warning("worker %d failed: %s", self.index, err)
                await self._recover(kill=not is_process_gone(err))
                continue
            if not stepped:
                self.parked.set()
                if self._needs_telemetry():
                    # PREFILL_PAUSED is left on telemetry alone, and telemetry comes with
                    # steps: with only prefill waiting, sample on an empty step now and then.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.telemetry_poll_s):
                            await self.wake.wait()
                    force = not self.wake.is_set()
                    continue
                await self.wake.wait()

    def _needs_telemetry(self) -> bool:
        return self.core.workers[self.index].flow.paused and self.core.has_work(self.index)

    async def _step(self, force: bool = False) -> bool:
        """One step; False when there was nothing to do (unless `force`: an empty step for
        telemetry). A failed worker call raises WorkerCallError; an exception in the
        controller's own part is handled here. With async scheduling the next step is
        planned and sent before this one's result is awaited."""
        try:
            launched = self.loop.begin(force)
            if launched is None:
                return False  # nothing can advance until a notify (flow control holds)
            sent = time.perf_counter()
            deadline = self._deadline_s(launched.plan)
            pending = launched.pending
            # It runs from when it was sent, or, sent ahead, from the end of the one before.
            started = max(launched.planned_at, self._last_received)
            predicted = self.core.scheduler(self.index).predicted_step_s(launched.plan.step_id)
            wait_s = self._plan_ahead_wait_s(predicted, started)
        except Exception as err:
            await self._planning_failed(err)
            return True
        if wait_s > 0:  # a request arriving meanwhile rides in the next step
            pending = asyncio.ensure_future(pending)
            await asyncio.wait([pending], timeout=wait_s)
        try:
            if not (isinstance(pending, asyncio.Future) and pending.done()):
                self.loop.plan_ahead()  # else the next step is planned knowing this one
        except Exception as err:
            await self._planning_failed(err)
            return True
        plan, start = launched.plan, launched.planned_at
        result = await self._call_worker(lambda: pending, deadline, f"step {plan.step_id}")
        received = time.perf_counter()
        outputs: list[RequestOutput] | None = None
        is_delivered = False
        try:
            outputs = self.loop.finish(launched, result)
            self.listener.deliver(outputs)
            is_delivered = True
            self.listener.on_step(result)
        except Exception as err:
            self._finishing_failed(err, plan, outputs, is_delivered)
            return True
        if any(out.error for out in outputs):
            self.notify()  # a protection aborted a request: the worker must hear of it
        # A step sent ahead starts when the one before it ends.
        previous, self._last_received = self._last_received, received
        wall = time.perf_counter() - max(start, previous)
        self.num_steps += 1
        self.wall_s += wall
        self.compute_s += result.elapsed_s
        self.plan_log.append((plan.step_id, dict(plan.num_scheduled_tokens)))
        self.records.append((len(plan.num_scheduled_tokens), plan.total_num_scheduled_tokens,
                             wall, result.elapsed_s, received - max(sent, previous)))
        if predicted:  # how much longer than the model's, steps really take here
            self._step_time_ratio += _RATIO_WEIGHT * ((received - started) / predicted
                                                      - self._step_time_ratio)
        return True

    def _plan_ahead_wait_s(self, predicted: float | None, started: float) -> float:
        """How long to wait before planning the next step while one predicted to take
        `predicted` s by the cost model runs (since `started`): until it is
        `scheduler.plan_ahead_at` done at the pace measured here, and no earlier than
        `scheduler.plan_ahead_lead_ms` before its expected end."""
        if not self.loop.is_ahead or not predicted:
            return 0.0
        config = self.core.scheduler(self.index).config  # plan_ahead_at 0: at once
        return started + config.plan_ahead_s(predicted * self._step_time_ratio) \
            - time.perf_counter()

    async def _call_worker(self, call: Callable[[], Awaitable[T]], timeout_s: float,
                           what: str) -> T:
        """Await one call to the worker actor; any failure of it is the worker's, raised as
        WorkerCallError (WorkerHungError past `timeout_s`). `call` makes the call inside
        the guard: Ray may raise when the call is submitted, too."""
        # asyncio.timeout, not wait_for: wait_for can swallow a cancel (see `stop`).
        try:
            async with asyncio.timeout(timeout_s):
                return await call()
        except TimeoutError:
            raise WorkerHungError(f"{what} took over {timeout_s:.1f}s") from None
        except Exception as err:  # CancelledError is no Exception: it passes
            raise WorkerCallError(f"{what}: {type(err).__name__}: {err}") from err

    def _controller_error(self, err: Exception, where: str) -> str:
        """Log (with the traceback) and count an exception in the controller's part of a
        step; returns the error the failed requests end with."""
        self.num_controller_errors += 1
        logger.error("worker %d: controller error while %s; its requests fail, the worker "
                     "stays", self.index, where, exc_info=err)
        return f"internal controller error while {where} ({type(err).__name__}: {err})"

    def _finishing_failed(self, err: Exception, plan: StepPlan,
                          outputs: list[RequestOutput] | None, is_delivered: bool) -> None:
        """The worker ran `plan`, then the controller failed to apply or hand out its
        result. The worker and the controller still agree on what was sent, so only the
        step's requests fail: aborted (blocks released now, the worker told on the next
        plan), each with an error output. A request the step had already finished gets one
        too unless its last output was delivered: it may be lost with the exception."""
        error = self._controller_error(err, f"finishing step {plan.step_id}")
        step_outputs = outputs or []
        finished_ids = {out.request_id for out in step_outputs if out.finished}
        request_ids = dict.fromkeys([*plan.num_scheduled_tokens,
                                     *(out.request_id for out in step_outputs)])
        failed = []
        for request_id in request_ids:
            if is_delivered and request_id in finished_ids:
                continue  # its end reached the client
            out = self.core.abort(request_id)
            if out is None:  # finished before, or inside the failed step
                if is_delivered:
                    continue  # before: its end was delivered then
                out = RequestOutput(request_id, [], FinishReason.ABORT, 0, 0)
            out.error = error
            failed.append(out)
        self.listener.deliver(failed)
        self.notify()  # the worker must hear of the aborted ids and free their blocks

    async def _planning_failed(self, err: Exception) -> None:
        """The controller failed before the plan reached the worker. A plan may have been
        built and lost (finished ids the worker never heard of, block moves it never made,
        blocks it was never sent), so the two sides no longer agree on what the worker
        holds. Every request here fails (the planner had all of them in view), the worker
        drops its state, and the pool forgets its prefix hashes (a lost move leaves them
        naming KV that was never copied). The worker is not restarted."""
        error = self._controller_error(err, "planning a step")
        self.listener.deliver(self.core.fail_worker_requests(self.index, error))
        # A step sent before the failure may still run, on another thread of the worker
        # with a compiled graph: the reset must come after it.
        await self.transport.drain(self.recovery.ready_timeout_s)
        await self._call_worker(self.handle.reset.remote, self.recovery.ready_timeout_s,
                                "reset after a controller error")
        self.transport.after_reset()  # the reset retired the steps' numbering

    def _send(self, plan: StepPlan) -> Awaitable[StepResult]:
        """Submit `plan` to the worker. A failure to submit is the worker's failure too,
        raised where the call is awaited (`_call_worker`)."""
        return self.transport.send(plan)

    def _deadline_s(self, plan: Any) -> float:
        cfg = self.recovery
        context = self.core.scheduler(self.index).step_context_len(plan.step_id)
        predicted = plan.num_steps * self.core.workers[self.index].protections.step_cost.chunk_s(
            plan.total_num_scheduled_tokens, context)
        return max(cfg.step_deadline_min_s, cfg.step_deadline_factor * predicted)

    async def _recover(self, kill: bool = True) -> None:
        """The worker died, hung or raised. Its requests move to the workers that are up
        (the core re-queues them to recompute), it is killed so Ray restarts it with
        clean state (not when Ray said its process is gone: Ray is restarting it, and a
        kill then could land on the new incarnation once it answered, failing the worker
        a second time), and it rejoins routing once a fresh incarnation answers; an answer
        from the failed one gets it killed."""
        self.num_failures += 1
        self.up.clear()
        self.loop.forget_in_flight()  # its result is lost with the worker's state
        dead_incarnation = self.info.incarnation
        held = list(self.core.scheduler(self.index).requests)
        moved_to, aborted = self.core.worker_failed(
            self.index, self.recovery.max_worker_failures_per_request)
        self.num_requests_moved += sum(
            self.core.request_to_worker.get(r, self.index) != self.index for r in held)
        self.listener.deliver(aborted)
        self.listener.on_requests_moved(moved_to)
        self.stepped.set()  # its requests left: a drain waiting on them is done
        if kill:
            self.kill(self.handle)
        self.transport.close()  # a compiled graph dies with the worker's process
        backoff = Backoff(self.recovery.restart_backoff_s, self.recovery.restart_backoff_max_s)
        while True:
            try:
                async with asyncio.timeout(self.recovery.ready_timeout_s):
                    info = await self.handle.info.remote()
                if info.incarnation != dead_incarnation:
                    break
                self.kill(self.handle)  # still the failed process: restart it
            except asyncio.CancelledError:
                raise
            except Exception as err:
                logger.warning("worker %d not back yet: %s: %s", self.index,
                               type(err).__name__, err)
            await asyncio.sleep(backoff.next_s())  # a retry interval, not synchronisation
        self.info = info
        await self.transport.reopen(self.handle, info.incarnation)
        self.core.worker_ready(self.index)
        self.up.set()
        logger.warning("worker %d is back (pid %s)", self.index, info.pid)
        self.notify()

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        steps = max(self.num_steps, 1)
        return {
            "worker": self.index, "device": self.info.device, "pid": self.info.pid,
            "node": getattr(self.info, "node_id", ""),
            "incarnation": self.info.incarnation, "is_up": self.core.workers[self.index].is_up,
            "transport": self.transport.kind,
            "transport_fallback": self.transport.fallback_reason,
            "num_hangs": self.num_hangs,
            **dataclasses.asdict(self.core.worker_stats(self.index)),
            "num_routed": self.num_routed, "num_loop_steps": self.num_steps,
            "num_failures": self.num_failures, "parked": self.parked.is_set(),
            "num_requests_moved": self.num_requests_moved,
            "num_controller_errors": self.num_controller_errors,
            "step_wall_ms_avg": 1e3 * self.wall_s / steps,
            "worker_compute_ms_avg": 1e3 * self.compute_s / steps,
            "controller_overhead_ms_avg": 1e3 * (self.wall_s - self.compute_s) / steps,
        }

    async def check_idle_integrity(self, timeout_s: float) -> dict[str, Any]:
        """With no unfinished request here, wait until the loop parks (the worker has had
        every finished id), then neither side may hold a block."""
        sched = self.core.scheduler(self.index)
        if sched.has_unfinished():
            return {"worker": self.index, "checked": False, "reason": "requests in flight"}
        await asyncio.wait_for(self.parked.wait(), timeout_s)
        held = await self.handle.held_block_ids.remote()
        pool = sched.kv.pool.stats()
        if sched.has_unfinished() or not self.parked.is_set():
            # New work arrived while we asked the worker: its blocks are legitimately held.
            return {"worker": self.index, "checked": False, "reason": "requests in flight"}
        if held:
            raise AssertionError(f"worker {self.index} still holds blocks {sorted(held)[:8]}")
        if pool.num_used:
            raise AssertionError(f"worker {self.index}'s pool has {pool.num_used} used blocks "
                                 "with no request in flight")
        return {"worker": self.index, "checked": True, "num_free": pool.num_free,
                "num_cached": pool.num_cached, "num_blocks": pool.num_blocks}
