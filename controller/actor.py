"""The controller as an async Ray actor: `ControllerCore` plus one step loop per worker actor.

Each worker has its own asyncio task: drain events, `schedule(w)`, await the worker's
`execute`, `apply(w, plan, result)`, hand the deltas to the subscribers. The tasks share
nothing but the core, which is only touched between awaits, so the single-threaded event loop
is the lock; a slow worker only delays its own loop. A loop with nothing to do parks on an
`asyncio.Event` that `submit`, `abort` and event producers set: no polling.

One streaming protocol toward the edge, multiplexed: a consumer (an ingress replica, a batch
runner) opens one `subscribe` stream that carries the `Delta`s of all its requests (a
`DeltaBatch` per step), and admits each request with a plain `submit` call, which answers
with an `Ack` or raises (ValueError: never runnable; QueueFullError: 429). Deltas that pile
up while a consumer is slow are merged, never dropped (controller/streams.py). The worker
actor class is named by an import path (`ControllerOptions.worker_cls`) so the controller
has no static dependency on torch code; tests inject a `worker_factory` instead.

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
import importlib
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import ray

from controller.budget import AutoBudgetResult, BudgetTable
from controller.core import ControllerCore
from controller.gc_freeze import freeze_long_lived
from controller.journal import Journal, JournalRecord
from controller.messages import (
    Ack,
    DeltaBatch,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepResult,
)
from controller.options import ControllerOptions
from controller.request import Request, RequestStatus
from controller.request_metrics import QUEUE_FULL, MetricsSnapshot, RequestMetrics
from controller.routing import NoWorkerUpError, QueueFullError
from controller.streams import Subscriber
from controller.transport import make_transport
from controller.worker_loop import WorkerSlot

logger = logging.getLogger(__name__)
CONTROLLER_NAME = "tokenflow-controller"


def start_worker_actors(opts: ControllerOptions) -> list[Any]:
    """The default `WorkerFactory`: one worker actor per GPU, else `num_workers` on CPU."""
    module, _, name = opts.worker_cls.partition(":")
    actor_cls = getattr(importlib.import_module(module), name)
    worker_cls = ray.remote(actor_cls)
    wcfg, cache = opts.worker, opts.cache
    use_gpu = wcfg.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    num_workers = int(ray.cluster_resources()["GPU"]) if use_gpu else wcfg.num_workers
    resources = {"num_gpus": 1 if use_gpu else 0, "num_cpus": opts.cluster.worker_num_cpus}
    # Named and detached: a worker outlives the controller, and a restarted controller gets
    # the running one back (get_if_exists) instead of loading the model again.
    return [worker_cls.options(name=worker_name(i), namespace=opts.cluster.namespace,
                               get_if_exists=True, lifetime="detached",
                               max_restarts=opts.cluster.worker_max_restarts,
                               max_concurrency=actor_cls.MAX_CONCURRENCY, **resources).remote(
        wcfg.model, cache.num_kv_blocks, cache.block_size, wcfg.dtype, wcfg.seed,
        "cuda" if use_gpu else "cpu", wcfg.telemetry, wcfg.peak_bandwidth_bytes_s,
        attention_backend=wcfg.attention_backend, cuda_graphs=wcfg.cuda_graphs,
        max_graph_batch=wcfg.max_graph_batch,
        # Only when set: a worker class of a test or benchmark need not take it.
        **({} if wcfg.num_threads is None else {"num_threads": wcfg.num_threads}))
        for i in range(num_workers)]


def worker_name(index: int) -> str:
    return f"{CONTROLLER_NAME}-worker-{index}"


# While workers start, how often the controller says what it is waiting for.
_STARTUP_LOG_EVERY_S = 10.0
_BUDGET_WAIT = ("worker 0 loads or measures the step budget table ({:.0f} s so far; the "
                "table is cached for later starts)")


def _pending_resources(opts: ControllerOptions, num_workers: int) -> str:
    """What the unstarted worker actors wait for, in words an operator can act on."""
    use_gpu = opts.worker.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    need = {"GPU": 1.0} if use_gpu else {"CPU": opts.cluster.worker_num_cpus}
    available = ray.available_resources()
    have = {k: round(available.get(k, 0.0), 3) for k in need}
    if all(have[k] >= need[k] for k in need):
        return f"{num_workers} worker actor(s) loading the model"
    return (f"{num_workers} worker actor(s) wait for resources: each needs {need}, the "
            f"cluster has {have} available (`ray status` shows the pending demand)")


def _kill_actor(handle: Any) -> None:
    """Kill a failed or hung worker actor; Ray restarts it (max_restarts permitting)."""
    try:
        ray.kill(handle, no_restart=False)
    except Exception as err:  # already dead: Ray is restarting it or gave up on it
        logger.warning("could not kill worker: %s", err)


# Starts the workers for the given options and returns their handles; each handle has
# `info.remote()`, `execute.remote(plan, incarnation)` and `held_block_ids.remote()`.
WorkerFactory = Callable[[ControllerOptions], Awaitable[list[Any]] | list[Any]]


@dataclasses.dataclass
class _Unclaimed:
    """A request resumed from the journal that no consumer has claimed yet: its tokens
    (journaled and new) wait here for `resume`."""

    num_prompt_tokens: int
    token_ids: list[int]
    last: RequestOutput | None = None


class _ActorSlotListener:
    """The step loops' `SlotListener`: the actor's delivery, journal and wake-ups."""

    def __init__(self, actor: ControllerActor) -> None:
        self.actor = actor

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self.actor._deliver(outputs)

    def on_step(self, result: StepResult) -> None:
        self.actor._on_step(result)

    def on_requests_moved(self, workers: list[int]) -> None:
        self.actor._wake_workers(workers)


class ControllerActor:
    def __init__(self, options: ControllerOptions,
                 worker_factory: WorkerFactory | None = None,
                 kill_worker: Callable[[Any], None] | None = None) -> None:
        self.options = options
        self.worker_factory = worker_factory or start_worker_actors
        self.kill_worker = kill_worker or _kill_actor
        self.core: ControllerCore | None = None
        self.slots: list[WorkerSlot] = []
        self.vocab_size = 0
        self.max_model_len = options.worker.max_model_len
        self._subscribers: dict[str, Subscriber] = {}
        self._subscriber_of: dict[str, Subscriber] = {}  # request id -> its subscriber
        self.num_aborted = 0  # requests that were still unfinished when aborted
        self._start_task: asyncio.Task[None] | None = None
        self.waiting_for: str | None = None  # why startup has not finished, once it is slow
        self._num_starting = 0  # worker actors created, not yet answering
        self._budget_started: float | None = None  # loop time worker 0 was asked for a table
        # Where the step budget came from: "file" (the driver loaded it), "cache" or
        # "measured" (worker 0), "fixed" (no table); see `model_info`.
        self.budget_source: dict[str, Any] = {
            "source": "fixed" if options.step_cost is None else "file",
            "max_num_batched_tokens": options.scheduler.max_num_batched_tokens}
        self.request_metrics = RequestMetrics()  # latencies measured where deltas leave
        self.journal: Journal | None = None
        self.num_resumed = 0  # requests re-queued from the journal at start
        self.num_resumed_streams = 0  # of those, claimed by a consumer's `resume`
        self._unclaimed: dict[str, _Unclaimed] = {}
        # request id -> tokens its consumer already has beyond what the journal held (the
        # recomputation produces them again; they are not sent twice)
        self._num_to_skip: dict[str, int] = {}

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
        self._num_starting = len(handles)
        infos_task = asyncio.gather(*(h.info.remote() for h in handles))
        while True:  # a worker actor that waits for resources must not wait in silence
            done, _ = await asyncio.wait({infos_task}, timeout=_STARTUP_LOG_EVERY_S)
            if done:
                break
            self.waiting_for = _pending_resources(opts, len(handles))
            logger.warning("controller still starting: %s", self.waiting_for)
        infos = infos_task.result()
        self.waiting_for = None
        # Workers that outlived an earlier controller still hold its requests.
        num_held = await asyncio.gather(*(h.reset.remote() for h in handles))
        if any(num_held):
            logger.warning("reattached to workers holding %s requests of an earlier controller",
                           num_held)
        if opts.auto_budget is not None:
            # Before any scheduler exists: the budget it runs with is worker 0's table.
            self.options = opts = await self._auto_budget(handles[0], opts)
        records = await self._open_journal()
        self.core = ControllerCore.for_workers(opts, infos, asyncio.get_running_loop().time)
        self.vocab_size = infos[0].vocab_size
        self.max_model_len = self.core.max_model_len
        cluster = opts.cluster
        listener = _ActorSlotListener(self)
        self.slots = [WorkerSlot(w, h, info, self.core, listener, kill=self.kill_worker,
                                 recovery=opts.recovery,
                                 transport=make_transport(
                                     cluster.worker_transport, h, info.incarnation,
                                     cluster.compiled_graph_probe_s,
                                     opts.recovery.ready_timeout_s, name=f"worker {w}"))
                      for w, (h, info) in enumerate(zip(handles, infos, strict=True))]
        # After `reset` and the budget table (ordinary calls): a graph would run steps
        # beside them. Compiling is sequential, the probes overlap.
        await asyncio.gather(*(s.transport.reopen(s.handle, s.info.incarnation)
                               for s in self.slots))
        self._restore(records)
        freeze_long_lived("controller")  # no full collection of Ray's objects mid-step
        for slot in self.slots:
            slot.start()
        logger.info("controller started with %d workers on %s, %d requests resumed from the "
                    "journal", len(handles), ", ".join(sorted({i.device for i in infos})),
                    len(records))

    async def _auto_budget(self, handle: Any, opts: ControllerOptions) -> ControllerOptions:
        """`opts` on worker 0's budget table: loaded from its cache or measured on its device
        (a short run, seconds to tens of seconds); fixed budgets when it fails."""
        request = opts.auto_budget
        assert request is not None
        loop = asyncio.get_running_loop()
        self._budget_started = started = loop.time()
        try:
            # Inside the guard: a worker class without the method raises here, at once.
            answer = asyncio.gather(handle.budget_table.remote(request))
            while True:  # a calibration must not run in silence either
                done, _ = await asyncio.wait({answer}, timeout=_STARTUP_LOG_EVERY_S)
                if done:
                    break
                self.waiting_for = _BUDGET_WAIT.format(loop.time() - started)
                logger.warning("controller still starting: %s", self.waiting_for)
            result: AutoBudgetResult = answer.result()[0]
        except Exception as err:  # not a reason to serve nothing: the fixed budgets serve
            logger.error("worker 0 could not load or measure the budget table, serving with "
                         "the fixed budgets: %s: %s", type(err).__name__, err)
            self.budget_source = {"source": "fixed", "error": f"{type(err).__name__}: {err}",
                                  "max_num_batched_tokens": opts.scheduler.max_num_batched_tokens}
            return dataclasses.replace(opts, auto_budget=None)
        finally:
            self.waiting_for, self._budget_started = None, None
        resolved = opts.with_budget_table(BudgetTable(result.data), request.fit)
        self.budget_source = {
            "source": "measured" if result.is_measured else "cache", "path": result.path,
            "pid": result.pid, "measure_s": result.measure_s,
            "device_name": result.data["device_name"],
            "threads": result.data["spec"]["threads"],
            "max_num_batched_tokens": resolved.scheduler.max_num_batched_tokens}
        logger.info("step budget from worker 0's table (%s, %s): max_num_batched_tokens %d",
                    self.budget_source["source"], result.path,
                    resolved.scheduler.max_num_batched_tokens)
        return resolved

    async def _open_journal(self) -> list[JournalRecord]:
        """Start the journal (when Redis is configured) and read back what an earlier
        controller left unfinished."""
        url = self.options.cluster.redis_url
        if not url:
            return []
        if self.journal is not None:  # a failed start is retried: one writer thread only
            self.journal.close()
        self.journal = Journal(url, self.options.journal)
        try:
            return await asyncio.to_thread(self.journal.load_unfinished)
        except Exception as err:  # Redis down: serve on, the earlier requests are lost
            logger.error("could not read the journal, no request resumed: %s: %s",
                         type(err).__name__, err)
            return []

    def _restore(self, records: list[JournalRecord]) -> None:
        """Re-queue journaled requests to recompute under their own ids; their tokens wait
        in `_unclaimed` until a consumer resumes them (or `resume_timeout_s` passes)."""
        core = self.core
        assert core is not None
        restored = []
        for record in records:
            request = Request(record.request_id, record.prompt_token_ids, record.params,
                              eos_token_ids=core.eos_token_ids, priority=record.priority,
                              arrival_time=core.clock(), tenant=record.tenant,
                              max_model_len=core.max_model_len,
                              output_token_ids=list(record.output_token_ids))
            unclaimed = _Unclaimed(request.num_prompt_tokens, list(record.output_token_ids))
            self._unclaimed[record.request_id] = unclaimed
            status = request.check_stop() if request.output_token_ids else None
            error = None
            if status is None:
                try:
                    worker = core.restore_request(request)
                except (ValueError, NoWorkerUpError) as err:  # the configuration changed
                    status, error = RequestStatus.FINISHED_ABORTED, f"cannot resume: {err}"
            if status is not None:  # its last token ended it (the finish was not journaled)
                unclaimed.last = RequestOutput(
                    request.request_id, [], status.finish_reason, request.num_prompt_tokens,
                    request.num_output_tokens, error=error)
                if self.journal is not None:
                    self.journal.restore([record])
                    self.journal.record_output(unclaimed.last)
                continue
            self.slots[worker].num_routed += 1
            restored.append(record)
        if self.journal is not None:
            self.journal.restore(restored)
            self.journal.end_step()
        self.num_resumed = len(records)
        if records:
            asyncio.get_running_loop().call_later(
                self.options.journal.resume_timeout_s, self._abort_unclaimed)

    def _abort_unclaimed(self) -> None:
        """Nobody resumed these after a restart: their consumers are gone too."""
        unclaimed, self._unclaimed = self._unclaimed, {}
        if unclaimed:
            logger.warning("aborting %d journaled requests nobody resumed", len(unclaimed))
        for request_id in unclaimed:
            self._abort(request_id)

    def _on_step(self, result: StepResult) -> None:
        if self.journal is not None:
            self.journal.record_chunks(result.chunk_events)
            self.journal.end_step()


    async def model_info(self) -> dict[str, Any]:
        await self._started()
        info = self.slots[0].info
        return {"vocab_size": self.vocab_size, "max_model_len": self.max_model_len,
                "eos_token_ids": list(info.eos_token_ids), "model_path": info.model_path,
                "num_workers": len(self.slots), "devices": [s.info.device for s in self.slots],
                "torch_threads": [s.info.torch_threads for s in self.slots],
                "budget": dict(self.budget_source)}

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
                     subscriber: str) -> Ack:
        """Admit a request whose deltas go to `subscribe(subscriber)`. Raises ValueError
        (never runnable) or QueueFullError (the queues are full) instead."""
        core = await self._started()
        # Get-or-create: Ray may start this call before the subscriber's `subscribe`.
        sub = self._subscribers.setdefault(subscriber, Subscriber())
        # Idempotent by request id: a client whose submit was cut by a controller crash or
        # a broken connection sends it again, not knowing whether it was admitted.
        if request_id in self._unclaimed:  # admitted and journaled before a restart
            num_prompt_tokens = self._unclaimed[request_id].num_prompt_tokens
            self._resume_one(core, sub, request_id, 0)
            return Ack(request_id, core.request_to_worker.get(request_id, -1),
                       num_prompt_tokens)
        if self._subscriber_of.get(request_id) is sub:  # admitted here already
            worker = core.request_to_worker[request_id]
            request = core.scheduler(worker).requests[request_id]
            return Ack(request_id, worker, request.num_prompt_tokens)
        try:
            request, worker = self._admit(core, prompt_token_ids, params, request_id,
                                          priority, tenant)
        except QueueFullError:
            self.request_metrics.on_reject(QUEUE_FULL)
            raise
        self.request_metrics.on_admit(request)
        sub.add(request.request_id, worker)
        self._subscriber_of[request.request_id] = sub
        return Ack(request.request_id, worker, request.num_prompt_tokens)

    async def subscribe(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        """Deltas of every request submitted for `subscriber`, a `DeltaBatch` per wake-up.
        When the subscriber goes away its unfinished requests are aborted."""
        sub = self._subscribers.setdefault(subscriber, Subscriber())
        try:
            while True:
                batch = await sub.next_batch()
                for request_id in batch.finished_ids():
                    self._subscriber_of.pop(request_id, None)
                yield batch
        finally:
            self._subscribers.pop(subscriber, None)
            for request_id in list(sub.request_to_worker):
                self._subscriber_of.pop(request_id, None)
                self._abort(request_id)

    async def resume(self, subscriber: str, request_to_num_tokens: dict[str, int]
                     ) -> dict[str, bool]:
        """Attach requests to `subscriber` after a restart: each one's tokens from
        position `request_to_num_tokens[id]` on go to `subscribe(subscriber)`, journaled
        ones at once, then new ones. A request this controller does not know (no journal,
        or admitted too shortly before the crash to be journaled) gets an error delta.
        Returns request id -> whether it was resumed."""
        core = await self._started()
        sub = self._subscribers.setdefault(subscriber, Subscriber())
        return {request_id: self._resume_one(core, sub, request_id, num_delivered)
                for request_id, num_delivered in request_to_num_tokens.items()}

    def _resume_one(self, core: ControllerCore, sub: Subscriber, request_id: str,
                    num_delivered: int) -> bool:
        """Attach one journaled request to `sub`, its tokens from `num_delivered` on."""
        unclaimed = self._unclaimed.pop(request_id, None)
        if unclaimed is None:
            sub.push(RequestOutput(
                request_id, [], FinishReason.ABORT, 0, 0,
                error="the controller restarted and cannot resume this request (no "
                      "journal, or admitted just before the crash)"))
            return False
        self.num_resumed_streams += 1
        tokens, last = unclaimed.token_ids, unclaimed.last
        out = RequestOutput(request_id, tokens[num_delivered:],
                            last.finish_reason if last else None,
                            unclaimed.num_prompt_tokens, len(tokens),
                            last.num_cached_tokens if last else 0,
                            last.error if last else None)
        sub.add(request_id, core.request_to_worker.get(request_id, -1))
        if num_delivered > len(tokens) and not out.finished:  # else nothing would pop it
            self._num_to_skip[request_id] = num_delivered - len(tokens)
        if not out.finished:
            self._subscriber_of[request_id] = sub
        if out.new_token_ids or out.finished:
            sub.push(out)
        return True

    async def abort(self, request_id: str) -> bool:
        """Abort a queued or running request; its blocks are released at once and the
        worker is told on its next step. False when the request is unknown or finished."""
        await self._started()
        return self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        assert self.core is not None
        worker = self.core.request_to_worker.get(request_id)
        out = self.core.abort(request_id)
        if out is None or worker is None:
            return False
        self.num_aborted += 1
        self.slots[worker].after_release()
        self._deliver([out])
        if self.journal is not None:
            self.journal.end_step()
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.journal is not None:
            self.journal.record_outputs(outputs)  # one lock per step, not per request
        for out in outputs:
            self._deliver_one(out)

    def _deliver_one(self, out: RequestOutput) -> None:
        request_id = out.request_id
        unclaimed = self._unclaimed.get(request_id)
        if unclaimed is not None:  # resumed from the journal, its consumer not back yet
            unclaimed.token_ids.extend(out.new_token_ids)
            unclaimed.last = out
            return
        num_to_skip = self._num_to_skip.pop(request_id, 0)
        if num_to_skip:  # recomputed tokens the consumer had before the restart
            num_skipped = min(num_to_skip, len(out.new_token_ids))
            out = dataclasses.replace(out, new_token_ids=out.new_token_ids[num_skipped:])
            if num_to_skip > num_skipped and not out.finished:
                self._num_to_skip[request_id] = num_to_skip - num_skipped
        assert self.core is not None
        self.request_metrics.on_output(out, self.core.clock())
        subscriber = self._subscriber_of.get(request_id)
        if subscriber is not None and (out.new_token_ids or out.finished):
            subscriber.push(out)

    # -- introspection -------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        await self._started()
        journal = self.journal.stats() if self.journal is not None else None
        return {"workers": [slot.stats() for slot in self.slots], "pid": os.getpid(),
                "journal": dataclasses.asdict(journal) if journal is not None else None,
                "num_resumed": self.num_resumed, "num_resumed_streams": self.num_resumed_streams,
                "num_unclaimed": len(self._unclaimed),
                "num_streams": len(self._subscriber_of),
                "num_subscribers": len(self._subscribers), "num_aborted": self.num_aborted,
                "num_unfinished": len(self.core.request_to_worker) if self.core else 0}

    async def metrics_snapshot(self) -> MetricsSnapshot:
        """What `/metrics` renders; answers at once, with no workers while they start."""
        core = self.core
        workers = [core.worker_stats(w) for w in range(core.num_workers)] if core else []
        return MetricsSnapshot(workers, self.request_metrics.snapshot())

    async def record_rejection(self, kind: str) -> None:
        """The edge refused a request before any other controller call (422): counted
        here so that every ingress replica reports the same total."""
        self.request_metrics.on_reject(kind)

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
        for slot in self.slots:
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
                failed = task is not None and task.done() and not task.cancelled() \
                    and task.exception() is not None
                if failed:
                    reason = f"startup failed: {task.exception()}"
                elif self._budget_started is not None:
                    elapsed = asyncio.get_running_loop().time() - self._budget_started
                    reason = _BUDGET_WAIT.format(elapsed)
                elif self._num_starting:
                    reason = _pending_resources(self.options, self._num_starting)
                else:
                    reason = "the workers are starting"
                return {"ok": False, "status": "starting", "reason": reason,
                        "num_workers_up": 0, "workers": []}
        core = self.core
        dead = [s.index for s in self.slots if s.task is None or s.task.done()]
        workers = [{"worker": s.index, "up": core.workers[s.index].is_up, "pid": s.info.pid,
                    "device": s.info.device, "num_failures": s.num_failures,
                    "num_running": len(core.scheduler(s.index).running),
                    "num_waiting": core.scheduler(s.index).num_waiting} for s in self.slots]
        num_up = sum(w["up"] for w in workers)
        ok = not dead and num_up > 0
        status = "ok" if ok else ("no worker up" if num_up == 0 else "step loop died")
        return {"ok": ok, "status": status, "dead_loops": dead, "num_workers_up": num_up,
                "workers": workers}

    async def wait_workers_up(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Return once every worker is up (restarted ones included), or raise TimeoutError."""
        await self._started()
        await asyncio.wait_for(asyncio.gather(*(s.up.wait() for s in self.slots)), timeout_s)
        return await self.ping()

    def _wake_workers(self, workers: list[int]) -> None:
        for w in workers:
            self.slots[w].notify()

    async def shutdown(self) -> None:
        """Kill the (detached) workers and close the journal: they outlive the controller
        otherwise. Unfinished requests stay journaled."""
        for slot in self.slots:
            if slot.task is not None:
                slot.task.cancel()
            slot.transport.close()
        for slot in self.slots:
            _kill_for_good(slot.handle)
        if not self.slots:  # not started (yet) in this incarnation: find them by name
            for i in range(self.options.worker.num_workers):
                try:
                    _kill_for_good(ray.get_actor(worker_name(i), self.options.cluster.namespace))
                except ValueError:
                    break
        if self.journal is not None:
            await asyncio.to_thread(self.journal.close, 5.0)
            self.journal = None


def _kill_for_good(handle: Any) -> None:
    if not isinstance(handle, ray.actor.ActorHandle):
        return  # a test's fake worker
    try:
        ray.kill(handle, no_restart=True)
    except Exception as err:  # already gone
        logger.warning("could not kill worker: %s", err)


def get_or_create_controller(options: ControllerOptions) -> ray.actor.ActorHandle:
    """The named singleton: created on first call, the existing actor afterwards."""
    actor_options: dict[str, Any] = dict(
        name=CONTROLLER_NAME, namespace=options.cluster.namespace, get_if_exists=True,
        max_restarts=options.cluster.controller_max_restarts,
        num_cpus=options.cluster.controller_num_cpus,
        max_concurrency=options.cluster.controller_max_concurrency)
    if options.cluster.detached_controller:
        actor_options["lifetime"] = "detached"
    return RemoteController.options(**actor_options).remote(options)


RemoteController = ray.remote(ControllerActor)
