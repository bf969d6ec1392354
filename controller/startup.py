"""The controller's start-up: spawning the worker actors, waiting for them (saying what
they wait for while it is slow), and the step budget worker 0 loads or measures.

The worker actor class is named by an import path (`ControllerOptions.worker_cls`) so the
controller has no static dependency on torch code; tests inject a `WorkerFactory` instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from controller.budget import AutoBudgetResult, BudgetTable
from controller.histogram import Histogram
from controller.options import ControllerOptions
from controller.pool import ElasticPool
from controller.scaling import Autoscaler, bundles

logger = logging.getLogger(__name__)
CONTROLLER_NAME = "tokenflow-controller"


def start_worker_actors(opts: ControllerOptions) -> list[Any]:
    """The default `WorkerFactory`: one worker actor per GPU, else `num_workers` on CPU."""
    use_gpu = uses_gpu(opts)
    num_workers, _ = worker_pool_shape(opts, ray.cluster_resources(), use_gpu)
    return [spawn_worker(opts, i) for i in range(num_workers)]


def uses_gpu(opts: ControllerOptions) -> bool:
    return opts.worker.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1


def worker_resources(opts: ControllerOptions, use_gpu: bool) -> dict[str, Any]:
    """The Ray resources one worker actor takes (what `request_resources` asks for too)."""
    resources: dict[str, Any] = {"num_gpus": 1 if use_gpu else 0,
                                 "num_cpus": opts.cluster.worker_num_cpus}
    name = opts.cluster.worker_resource
    if name is not None and not use_gpu:
        resources["resources"] = {name: 1}
    return resources


def worker_max_concurrency(opts: ControllerOptions, use_gpu: bool, class_max: int) -> int:
    """A worker actor's Ray `max_concurrency`: its class's own (`MAX_CONCURRENCY`, the running
    step and the next call) where it overlaps calls (`cluster.worker_overlap_calls`; None: GPU
    workers only), else one call at a time. Steps keep their order either way (StepGate)."""
    overlap = opts.cluster.worker_overlap_calls
    return class_max if (use_gpu if overlap is None else overlap) else 1


def spawn_worker(opts: ControllerOptions, index: int, is_detached: bool = True) -> Any:
    """The worker actor named `worker_name(index)`: created, or the running one."""
    module, _, name = opts.worker_cls.partition(":")
    actor_cls = getattr(importlib.import_module(module), name)
    use_gpu = uses_gpu(opts)
    # Named and detached: a worker outlives the controller, and a restarted controller gets
    # the running one back (get_if_exists) instead of loading the model again.
    return ray.remote(actor_cls).options(
        name=worker_name(index), namespace=opts.cluster.namespace, get_if_exists=True,
        lifetime="detached" if is_detached else None, max_restarts=opts.cluster.worker_max_restarts,
        max_concurrency=worker_max_concurrency(opts, use_gpu, actor_cls.MAX_CONCURRENCY),
        # Spread: a lost node takes the fewest workers with it.
        scheduling_strategy="SPREAD", **worker_resources(opts, use_gpu)).remote(
        dataclasses.replace(opts.worker, device="cuda" if use_gpu else "cpu"), opts.cache)


def worker_pool_shape(opts: ControllerOptions, cluster_resources: dict[str, float],
                      use_gpu: bool) -> tuple[int, dict[str, Any]]:
    """How many worker actors to start and the Ray resources each one takes: one per GPU,
    else one per unit of `cluster.worker_resource` when set, else `worker.num_workers`."""
    resources = worker_resources(opts, use_gpu)
    if use_gpu:
        return int(cluster_resources["GPU"]), resources
    name = opts.cluster.worker_resource
    if name is None:
        return opts.worker.num_workers, resources
    num_units = int(cluster_resources.get(name, 0))
    if num_units < 1:
        raise RuntimeError(f"cluster.worker_resource is {name!r} but no node of the Ray "
                           f"cluster declares it (its resources: "
                           f"{sorted(cluster_resources)})")
    return num_units, resources


def node_of(info: Any) -> str:
    """The Ray node id a worker reported ("" from a worker class that does not say)."""
    return getattr(info, "node_id", "")


def worker_name(index: int) -> str:
    return f"{CONTROLLER_NAME}-worker-{index}"


# While workers start, how often the controller says what it is waiting for.
_STARTUP_LOG_EVERY_S = 10.0
_BUDGET_WAIT = ("worker 0 loads or measures the step budget table ({:.0f} s so far; the "
                "table is cached for later starts)")


def pending_resources(opts: ControllerOptions, num_workers: int) -> str:
    """What the unstarted worker actors wait for, in words an operator can act on."""
    use_gpu = opts.worker.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    need = {"GPU": 1.0} if use_gpu else {"CPU": opts.cluster.worker_num_cpus}
    if not use_gpu and opts.cluster.worker_resource is not None:
        need[opts.cluster.worker_resource] = 1.0
    available = ray.available_resources()
    have = {k: round(available.get(k, 0.0), 3) for k in need}
    if all(have[k] >= need[k] for k in need):
        return f"{num_workers} worker actor(s) loading the model"
    return (f"{num_workers} worker actor(s) wait for resources: each needs {need}, the "
            f"cluster has {have} available (`ray status` shows the pending demand)")


def kill_actor(handle: Any) -> None:
    """Kill a failed or hung worker actor; Ray restarts it (max_restarts permitting)."""
    try:
        ray.kill(handle, no_restart=False)
    except Exception as err:  # already dead: Ray is restarting it or gave up on it
        logger.warning("could not kill worker: %s", err)


# Starts the workers for the given options and returns their handles; each handle has
# `info.remote()`, `execute.remote(plan, incarnation)` and `held_block_ids.remote()`.
WorkerFactory = Callable[[ControllerOptions], Awaitable[list[Any]] | list[Any]]
# Starts one more worker (named by its index) for a running pool and returns its handle.
WorkerSpawner = Callable[[ControllerOptions, int], Any]


def spawn_added_worker(opts: ControllerOptions, index: int) -> Any:
    """The default `WorkerSpawner`. Owned by the controller, not detached: a restarted
    controller reattaches the pool it starts with, so a worker added later goes with the
    controller that added it (its requests resume from the journal) instead of holding
    its resources unused."""
    return spawn_worker(opts, index, is_detached=False)


def kill_for_good(handle: Any) -> None:
    if not isinstance(handle, ray.actor.ActorHandle):
        return  # a test's fake worker
    try:
        ray.kill(handle, no_restart=True)
    except Exception as err:  # already gone
        logger.warning("could not kill worker: %s", err)


class Startup:
    """What start-up has done so far: why it has not finished, where the budget came from."""

    def __init__(self, options: ControllerOptions) -> None:
        self.waiting_for: str | None = None  # why startup has not finished, once it is slow
        self.num_starting = 0  # worker actors created, not yet answering
        self.budget_started: float | None = None  # loop time worker 0 was asked for a table
        # Where the step budget came from: "file" (the driver loaded it), "cache" or
        # "measured" (worker 0), "fixed" (no table); see `model_info`.
        self.budget_source: dict[str, Any] = {
            "source": "fixed" if options.step_cost is None else "file",
            "max_num_batched_tokens": options.scheduler.max_num_batched_tokens}

    async def workers_ready(self, handles: list[Any], opts: ControllerOptions) -> list[Any]:
        """Every worker's `WorkerInfo`, once each answers and has dropped what an earlier
        controller left it."""
        self.num_starting = len(handles)
        infos_task = asyncio.gather(*(h.info.remote() for h in handles))
        while True:  # a worker actor that waits for resources must not wait in silence
            done, _ = await asyncio.wait({infos_task}, timeout=_STARTUP_LOG_EVERY_S)
            if done:
                break
            self.waiting_for = pending_resources(opts, len(handles))
            logger.warning("controller still starting: %s", self.waiting_for)
        infos = infos_task.result()
        self.waiting_for = None
        # Workers that outlived an earlier controller still hold its requests.
        num_held = await asyncio.gather(*(h.reset.remote() for h in handles))
        if any(num_held):
            logger.warning("reattached to workers holding %s requests of an earlier controller",
                           num_held)
        return infos

    async def auto_budget(self, handle: Any, opts: ControllerOptions) -> ControllerOptions:
        """`opts` on worker 0's budget table: loaded from its cache or measured on its device
        (a short run, seconds to tens of seconds); fixed budgets when it fails."""
        request = opts.auto_budget
        assert request is not None
        loop = asyncio.get_running_loop()
        self.budget_started = started = loop.time()
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
            self.waiting_for, self.budget_started = None, None
        resolved = opts.with_budget_table(BudgetTable(result.data), request.calibration)
        self.budget_source = {
            "source": "measured" if result.is_measured else "cache", "path": result.path,
            "pid": result.pid, "measure_s": result.measure_s, "is_cached": result.is_cached,
            "contention_cores": result.contention_cores,
            "device_name": result.data["device_name"],
            "threads": result.data["spec"]["threads"],
            "max_num_batched_tokens": resolved.scheduler.max_num_batched_tokens}
        logger.info("step budget from worker 0's table (%s, %s): max_num_batched_tokens %d",
                    self.budget_source["source"], result.path,
                    resolved.scheduler.max_num_batched_tokens)
        return resolved

    def starting_reason(self, task: asyncio.Task[None] | None, options: ControllerOptions
                        ) -> str:
        """Why the controller does not serve yet, in words an operator can act on."""
        failed = task is not None and task.done() and not task.cancelled() \
            and task.exception() is not None
        if failed:
            return f"startup failed: {task.exception()}"
        elif self.budget_started is not None:
            elapsed = asyncio.get_running_loop().time() - self.budget_started
            return _BUDGET_WAIT.format(elapsed)
        elif self.num_starting:
            return pending_resources(options, self.num_starting)
        else:
            return "the workers are starting"


def can_place_worker(opts: ControllerOptions) -> bool:
    """Whether some live node has one more worker's resources free now (per node: an
    actor does not span nodes)."""
    from ray._private.state import available_resources_per_node  # a DeveloperAPI

    need = bundles(worker_resources(opts, uses_gpu(opts)), 1)[0]
    return any(all(free.get(k, 0.0) >= v for k, v in need.items() if v > 0)
               for free in available_resources_per_node().values())


def request_worker_resources(opts: ControllerOptions, num_workers: int) -> None:
    """Tell Ray's autoscaler the pool's target size (it keeps, adds or releases nodes)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles(worker_resources(opts, uses_gpu(opts)), num_workers))


def make_autoscaler(options_of: Callable[[], ControllerOptions], pool: ElasticPool,
                    ttft_s: Histogram) -> Autoscaler:
    """The started autoscaler of a running controller (`scaling.enabled`), on the event
    loop's clock, Ray's free resources and Ray's autoscaler."""
    autoscaler = Autoscaler(options_of().scaling, pool, ttft_s,
                            asyncio.get_running_loop().time,
                            lambda: can_place_worker(options_of()),
                            lambda n: request_worker_resources(options_of(), n))
    autoscaler.start()
    return autoscaler
