"""The controller as an async Ray actor: `ControllerCore` plus one step loop per worker actor.

A thin RPC facade: start-up (controller/startup.py: spawning the workers, the budget),
resume after a restart (controller/resume.py: the journal), the streams toward the edge
(controller/streams.py) and one `WorkerSlot` per worker actor (controller/worker_loop.py),
whose step loop is an asyncio task: plan (the core handles queued events first), await the
worker's step, apply, hand the outputs to the streams. The tasks share nothing but the
core, which is only touched between awaits, so the single-threaded event loop is the lock;
a slow worker only delays its own loop. A loop with nothing to do parks on an
`asyncio.Event` that `submit`, `abort` and event producers set: no polling. Workers join
and leave while it serves (`add_worker`, `drain_worker`: controller/pool.py), by an
operator's call or the load (controller/scaling.py, with `scaling.enabled`).

One streaming protocol toward the edge, multiplexed: a consumer (an ingress replica, a batch
runner) opens one `subscribe` stream that carries the `Delta`s of all its requests (a
`DeltaBatch` per step), and admits each request with a plain `submit` call, which answers
with an `Ack` or raises (ValueError: never runnable; QueueFullError: 429). Deltas that pile
up while a consumer is slow are merged, never dropped (controller/streams.py).

Controller failure: the workers are named, detached actors, so they outlive the controller;
Ray restarts the controller (`cluster.controller_max_restarts`), which reattaches to them,
`reset()`s them (its pools are fresh) and, with a journal (`cluster.redis_url`), re-queues
every unfinished request under its own id to recompute its prompt and generated tokens.
A consumer whose `subscribe` stream broke subscribes again and calls `resume` with how many
tokens of each request it already has; it gets the rest, journaled ones first, then new
ones, with no gap and no duplicate (recomputation is deterministic).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from controller.core import ControllerCore
from controller.gc_freeze import freeze_long_lived
from controller.journal import Journal
from controller.messages import Ack, DeltaBatch, FinishReason, RequestOutput, SamplingParams
from controller.options import ControllerOptions
from controller.pool import ElasticPool
from controller.request import Request
from controller.request_metrics import QUEUE_FULL, MetricsSnapshot
from controller.resume import Resume
from controller.routing import QueueFullError
from controller.scaling import Autoscaler
from controller.startup import (
    CONTROLLER_NAME,
    Startup,
    WorkerFactory,
    WorkerSpawner,
    kill_actor,
    kill_for_good,
    make_autoscaler,
    node_of,
    spawn_added_worker,
    start_worker_actors,
    worker_name,
)
from controller.streams import Streams
from controller.transport import WorkerTransport
from controller.worker_loop import WorkerSlot, slot_transport

logger = logging.getLogger(__name__)
__all__ = ["CONTROLLER_NAME", "ControllerActor", "RemoteController", "WorkerFactory",
           "get_or_create_controller", "start_worker_actors", "worker_name"]


class ControllerActor:
    def __init__(self, options: ControllerOptions,
                 worker_factory: WorkerFactory | None = None,
                 kill_worker: Callable[[Any], None] | None = None,
                 spawn_worker: WorkerSpawner | None = None,
                 remove_worker: Callable[[Any], None] | None = None) -> None:
        self.options = options
        self.worker_factory = worker_factory or start_worker_actors
        self.kill_worker = kill_worker or kill_actor
        spawn = spawn_worker or spawn_added_worker
        self.core: ControllerCore | None = None
        self.slots: list[WorkerSlot] = []
        self.vocab_size = 0
        self.max_model_len = options.worker.max_model_len
        self.num_aborted = 0  # requests that were still unfinished when aborted
        self._start_task: asyncio.Task[None] | None = None
        self.startup = Startup(options)
        self.resumer = Resume(options)
        self.streams = Streams(self.resumer, self._wake_workers)
        # Workers added and drained while serving (controller/pool.py).
        self.autoscaler: Autoscaler | None = None  # with scaling.enabled
        self.pool = ElasticPool(self, lambda i: spawn(self.options, i),
                                remove_worker or kill_for_good, 0, worker_name)

    @property
    def journal(self) -> Journal | None:
        return self.resumer.journal

    # -- startup ------------------------------------------------------------------------
    async def _started(self) -> ControllerCore:
        # Lazy: an actor's __init__ runs outside its event loop, the loops need one.
        task = self._start_task
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            # A fresh context: Ray cancels recursively, and every task created in a call's
            # context counts as that call's child. The first caller's client going away
            # must not cancel the worker startup (or, later, the step loops).
            self._start_task = task = asyncio.get_running_loop().create_task(
                self._start(), context=contextvars.Context())
        await asyncio.shield(task)
        assert self.core is not None
        return self.core

    async def _start(self) -> None:
        opts = self.options
        handles = self.worker_factory(opts)
        if inspect.isawaitable(handles):
            handles = await handles
        infos = await self.startup.workers_ready(handles, opts)
        if opts.auto_budget is not None:
            # Before any scheduler exists: the budget it runs with is worker 0's table.
            self.options = opts = await self.startup.auto_budget(handles[0], opts)
        records = await self.resumer.open_journal()
        self.core = ControllerCore.for_workers(opts, infos, asyncio.get_running_loop().time)
        self.vocab_size = infos[0].vocab_size
        self.max_model_len = self.core.max_model_len
        self.slots = [self._make_slot(w, h, info)
                      for w, (h, info) in enumerate(zip(handles, infos, strict=True))]
        self.pool.next_name_index = len(handles)
        # After `reset` and the budget table (ordinary calls): a graph would run steps
        # beside them. Compiling is sequential, the probes overlap.
        await asyncio.gather(*(s.transport.reopen(s.handle, s.info.incarnation)
                               for s in self.slots))
        self.resumer.restore(self.core, records, self.slots, self._abort)
        freeze_long_lived("controller")  # no full collection of Ray's objects mid-step
        for slot in self.slots:
            slot.start()
        if opts.scaling.enabled:
            self.autoscaler = make_autoscaler(lambda: self.options, self.pool,
                                              self.streams.request_metrics.ttft_s)
        logger.info("controller started with %d workers on %s, %d requests resumed from the "
                    "journal", len(handles), ", ".join(sorted({i.device for i in infos})),
                    len(records))

    def _make_slot(self, index: int, handle: Any, info: Any,
                   transport: WorkerTransport | None = None) -> WorkerSlot:
        assert self.core is not None
        return WorkerSlot(index, handle, info, self.core, self.streams, kill=self.kill_worker,
                          recovery=self.options.recovery,
                          transport=transport or slot_transport(self.options, index, handle,
                                                                info))

    def _active(self) -> list[WorkerSlot]:
        """The slots of workers not removed (serving or draining)."""
        return [s for s in self.slots if s.index not in self.pool.removed]

    # -- the elastic pool (controller/pool.py) -------------------------------------------
    async def attach_worker(self, handle: Any, info: Any, name: str) -> WorkerSlot:
        """A worker added while serving has loaded: its slot joins, it takes new requests."""
        core = self.core
        assert core is not None
        index = core.num_workers
        transport = slot_transport(self.options, index, handle, info)
        await transport.reopen(handle, info.incarnation)
        # From here to `start`, nothing awaits: the index is still the next one.
        assert core.add_worker(ControllerCore.pool_of(self.options, info)) == index
        slot = self._make_slot(index, handle, info, transport)
        self.slots.append(slot)
        slot.start()
        return slot

    def deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self.streams.deliver(outputs)
            if self.journal is not None:
                self.journal.end_step()

    def wake(self, workers: list[int]) -> None:
        self._wake_workers(workers)

    async def workers(self) -> list[dict[str, Any]]:
        """Every worker with its state (loading, serving, draining, removed, failed)."""
        await self._started()
        return self.pool.listing()

    async def add_worker(self, wait: bool = False, timeout_s: float = 600.0
                         ) -> dict[str, Any]:
        """Start one more worker; it takes new requests once its model has loaded (Ray
        places it where its resources are free, or when a node that has them joins).
        `wait`: answer once it serves (or raise why it could not join)."""
        await self._started()
        return await self.pool.add_answer(wait, timeout_s)

    async def drain_worker(self, worker: int, timeout_s: float | None = None,
                           wait: bool = True) -> dict[str, Any]:
        """Route no new request to `worker`; its requests finish, or after `timeout_s`
        (scaling.drain_timeout_s) move to the other workers; then it is removed and its
        resources go back to Ray. `wait`: answer once it is removed, with what happened.
        ValueError: no such serving worker, or the last one."""
        await self._started()
        return await self.pool.drain_answer(
            worker, self.options.scaling.drain_timeout_s if timeout_s is None else timeout_s,
            wait)

    async def model_info(self) -> dict[str, Any]:
        await self._started()
        info = self.slots[0].info
        return {"vocab_size": self.vocab_size, "max_model_len": self.max_model_len,
                "eos_token_ids": list(info.eos_token_ids), "model_path": info.model_path,
                "num_workers": len(self._active()),
                "devices": [s.info.device for s in self._active()],
                "torch_threads": [s.info.torch_threads for s in self._active()],
                "nodes": [node_of(s.info) for s in self._active()],
                "budget": dict(self.startup.budget_source)}

    # -- requests -----------------------------------------------------------------------
    def _admit(self, core: ControllerCore, prompt_token_ids: list[int],
               params: SamplingParams, request_id: str | None, priority: int,
               tenant: str) -> tuple[Request, int]:
        request = core.add_request(prompt_token_ids, params, request_id, priority, tenant)
        if self.journal is not None:
            self.journal.admit(request)
        worker = core.request_to_worker[request.request_id]
        self.slots[worker].num_routed += 1
        self.slots[worker].notify()
        return request, worker

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str,
                     subscriber: str, num_delivered: int = 0) -> Ack:
        """Admit a request whose deltas go to `subscribe(subscriber)`. Raises ValueError
        (never runnable) or QueueFullError (the queues are full) instead. `num_delivered`:
        sent again after a restart that could not resume it, its consumer already has
        that many tokens (recomputed, not sent twice; neither are its prompt's scores)."""
        core = await self._started()
        sub = self.streams.subscriber(subscriber)
        # Idempotent by request id: a client whose submit was cut by a controller crash or
        # a broken connection sends it again, not knowing whether it was admitted.
        unclaimed = self.resumer.unclaimed.get(request_id)
        if unclaimed is not None:  # admitted and journaled before a restart
            num_prompt_tokens = unclaimed.num_prompt_tokens
            self.streams.resume_stream(core, sub, request_id, 0)
            return Ack(request_id, core.request_to_worker.get(request_id, -1),
                       num_prompt_tokens)
        if self.streams.subscriber_of.get(request_id) is sub:  # admitted here already
            worker = core.request_to_worker[request_id]
            request = core.scheduler(worker).requests[request_id]
            return Ack(request_id, worker, request.num_prompt_tokens)
        try:
            request, worker = self._admit(core, prompt_token_ids, params, request_id,
                                          priority, tenant)
        except QueueFullError:
            self.streams.request_metrics.on_reject(QUEUE_FULL)
            raise
        self.streams.request_metrics.on_admit(request)
        self.streams.attach(request.request_id, sub, worker)
        if num_delivered > 0:
            self.resumer.num_to_skip[request.request_id] = num_delivered
            self.resumer.has_prompt_logprobs.add(request.request_id)
        return Ack(request.request_id, worker, request.num_prompt_tokens)

    async def subscribe(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        """Deltas of every request submitted for `subscriber`, a `DeltaBatch` per wake-up.
        When the subscriber goes away its unfinished requests are aborted."""
        sub = self.streams.subscriber(subscriber)
        try:
            while True:
                batch = await sub.next_batch()
                for request_id in batch.finished_ids():
                    self.streams.subscriber_of.pop(request_id, None)
                yield batch
        finally:
            for request_id in self.streams.close(subscriber, sub):
                self._abort(request_id)

    async def resume(self, subscriber: str, request_to_num_tokens: dict[str, int]
                     ) -> dict[str, bool]:
        """Attach requests to `subscriber` after a restart: each one's tokens from
        position `request_to_num_tokens[id]` on go to `subscribe(subscriber)`, journaled
        ones at once, then new ones. Returns request id -> whether it was resumed; one this
        controller does not know (no journal, one that could not be read, or admitted too
        shortly before the crash to be journaled) gets no delta: the caller `submit`s it
        again with its `num_delivered`."""
        core = await self._started()
        sub = self.streams.subscriber(subscriber)
        return {request_id: self.streams.resume_stream(core, sub, request_id, num_delivered)
                for request_id, num_delivered in request_to_num_tokens.items()}

    async def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort a queued or running request; its blocks are released at once and the
        worker is told on its next step. False when the request is unknown or finished.
        `reason` STOP: the edge matched a stop string (it finishes, and counts, as stop)."""
        await self._started()
        return self._abort(request_id, reason)

    def _abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        assert self.core is not None
        worker = self.core.request_to_worker.get(request_id)
        out = self.core.abort(request_id, reason)
        if out is None or worker is None:
            return False
        self.num_aborted += 1
        self.slots[worker].after_release()
        self.streams.deliver([out])
        if self.journal is not None:
            self.journal.end_step()
        return True

    # -- introspection -------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        await self._started()
        journal = self.journal.stats() if self.journal is not None else None
        return {"workers": [{**slot.stats(), "state": self.pool.state_of(slot.index)}
                            for slot in self.slots], "pid": os.getpid(),
                # Only inside Ray: asking outside it would start a local Ray.
                "node": ray.get_runtime_context().get_node_id() if ray.is_initialized()
                else "",
                "journal": dataclasses.asdict(journal) if journal is not None else None,
                "num_resumed": self.resumer.num_resumed,
                "journal_error": self.resumer.journal_error,  # unreadable at start
                "num_resumed_streams": self.resumer.num_resumed_streams,
                "num_unclaimed": len(self.resumer.unclaimed),
                "num_unclaimed_finished": sum(1 for u in self.resumer.unclaimed.values()
                                              if u.last is not None and u.last.finished),
                "num_streams": len(self.streams.subscriber_of),
                "num_subscribers": len(self.streams.subscribers), "num_aborted": self.num_aborted,
                "num_unfinished": len(self.core.request_to_worker) if self.core else 0}

    async def metrics_snapshot(self) -> MetricsSnapshot:
        """What `/metrics` renders; answers at once, with no workers while they start."""
        core = self.core
        active = self._active() if core else []
        return MetricsSnapshot([core.worker_stats(s.index) for s in active] if core else [],
                               self.streams.request_metrics.snapshot(),
                               core.scheduler(0).itl_slo_s if core else None,
                               [node_of(s.info) for s in active], [s.index for s in active],
                               self.pool.state_counts(), dict(self.pool.event_to_count))

    async def record_rejection(self, kind: str) -> None:
        """The edge refused a request before any other controller call (422): counted
        here so that every ingress replica reports the same total."""
        self.streams.request_metrics.on_reject(kind)

    async def step_records(self, worker: int) -> list[tuple[int, int, float, float, float]]:
        """Recent steps of one worker: (requests, tokens, wall s, worker compute s, actor
        call s)."""
        await self._started()
        return list(self.slots[worker].records)

    async def step_plans(self, worker: int) -> list[tuple[int, dict[str, int]]]:
        """Recent steps of one worker: (step id, request id -> tokens scheduled)."""
        await self._started()
        return list(self.slots[worker].plan_log)

    async def check_integrity(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Every pool partitions its blocks; each worker with no unfinished request holds no
        block once its loop has told it about every finished request. Raises on violation."""
        core = await self._started()
        core.check_integrity()
        report = []
        for slot in self._active():
            report.append(await slot.check_idle_integrity(timeout_s))
        return {"workers": report}

    async def ping(self) -> dict[str, Any]:
        """Ready to serve: every step loop alive and at least one worker up. Answers at
        once, also while the workers are still starting (then with what they wait for)."""
        if self.core is None:
            task = self._start_task
            if task is None or task.done():
                with contextlib.suppress(Exception):  # a failed start is reported below
                    await asyncio.wait_for(asyncio.shield(self._started()), 0.05)
            if self.core is None:
                reason = self.startup.starting_reason(task, self.options)
                return {"ok": False, "status": "starting", "reason": reason,
                        "num_workers_up": 0, "workers": []}
        core = self.core
        active = self._active()
        # A draining worker's loop ends on purpose just before it is removed.
        dead = [s.index for s in active if (s.task is None or s.task.done())
                and self.pool.state_of(s.index) != "draining"]
        workers = [{"worker": s.index, "up": core.workers[s.index].is_up, "pid": s.info.pid,
                    "device": s.info.device, "node": node_of(s.info),
                    "state": self.pool.state_of(s.index),
                    "num_failures": s.num_failures,
                    "num_running": len(core.scheduler(s.index).running),
                    "num_waiting": core.scheduler(s.index).num_waiting} for s in active]
        num_up = sum(w["up"] for w in workers)
        ok = not dead and num_up > 0
        status = "ok" if ok else ("no worker up" if num_up == 0 else "step loop died")
        return {"ok": ok, "status": status, "dead_loops": dead, "num_workers_up": num_up,
                "workers": workers}

    async def wait_workers_up(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Return once every worker is up (restarted ones included), or raise TimeoutError."""
        await self._started()
        await asyncio.wait_for(asyncio.gather(*(s.up.wait() for s in self._active())),
                               timeout_s)
        return await self.ping()

    def _wake_workers(self, workers: list[int]) -> None:
        for w in workers:
            self.slots[w].notify()

    async def shutdown(self) -> None:
        """Kill the (detached) workers and close the journal: they outlive the controller
        otherwise. Unfinished requests stay journaled."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        for slot in self.slots:
            slot.request_stop()  # a cancel alone can be lost (WorkerSlot.stop)
            slot.transport.close()
        for slot in self._active():
            kill_for_good(slot.handle)
        for loading in self.pool.loading.values():
            kill_for_good(loading.handle)
        if not self.slots:  # not started (yet) in this incarnation: find them by name
            for i in range(self.options.worker.num_workers):
                try:
                    kill_for_good(ray.get_actor(worker_name(i), self.options.cluster.namespace))
                except ValueError:
                    break
        if self.journal is not None:
            await asyncio.to_thread(self.journal.close, 5.0)
            self.resumer.journal = None


def get_or_create_controller(options: ControllerOptions) -> ray.actor.ActorHandle:
    """The named singleton: created on first call, the existing actor afterwards."""
    actor_options: dict[str, Any] = dict(
        name=CONTROLLER_NAME, namespace=options.cluster.namespace, get_if_exists=True,
        max_restarts=options.cluster.controller_max_restarts,
        num_cpus=options.cluster.controller_num_cpus,
        max_concurrency=options.cluster.controller_max_concurrency)
    if options.cluster.detached_controller:
        actor_options["lifetime"] = "detached"
    if options.cluster.controller_resource is not None:
        actor_options["resources"] = {options.cluster.controller_resource: 1}
    return RemoteController.options(**actor_options).remote(options)


RemoteController = ray.remote(ControllerActor)
