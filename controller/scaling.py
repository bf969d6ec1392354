"""Load-driven scaling: the controller's queues and TTFT fed to the pool-size policy
(controller/autoscale.py), its decisions carried out on the elastic pool
(controller/pool.py).

Every `scaling.sample_interval_s` the controller samples the workers that take new
requests (serving or loading; draining ones are leaving), the requests waiting on them,
the P90 time to first token over the last `window_s` and the idle workers. A scale-up
adds a worker where Ray has its resources free (with `wait_for_nodes`, also where none
has, for Ray's autoscaler to add a node); a scale-down drains the idle worker the policy
names. After each decision the pool's target size goes to Ray with `request_resources`, so
that an autoscaler keeps (or adds) the nodes for it and may release the rest. Every
decision is logged with its reason and counted (`tokenflow_scale_events_total`).

Ray-free: the actor hands in the clock, the resource check and `request_resources`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from controller.autoscale import LoadSample, ScaleDecision, ScalingConfig, ScalingPolicy
from controller.core import ControllerCore
from controller.histogram import Histogram
from controller.pool import ElasticPool

logger = logging.getLogger(__name__)


class WindowQuantile:
    """A quantile of a cumulative histogram over its last `window_s`: the difference of
    its bucket counts now and at the oldest sample inside the window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def observe(self, now: float, hist: Histogram, q: float) -> float | None:
        """The upper bound of the bucket that holds quantile `q` of the observations made
        in the window (None without any)."""
        counts = tuple(hist.counts)
        self.samples.append((now, counts))
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
        base = self.samples[0][1]
        diff = [a - b for a, b in zip(counts, base, strict=True)]
        total = sum(diff)
        if total == 0:
            return None
        cumulative, running = [], 0
        for n in diff:
            running += n
            cumulative.append(running)
        bucket = bisect.bisect_left(cumulative, q * total)
        bounds = (*hist.bounds, float("inf"))
        return bounds[min(bucket, len(bounds) - 1)]


class Autoscaler:
    def __init__(self, config: ScalingConfig, pool: ElasticPool, ttft_s: Histogram,
                 clock: Callable[[], float], can_place: Callable[[], bool],
                 request_resources: Callable[[int], None],
                 load: Callable[[LoadSample], LoadSample] | None = None) -> None:
        self.config = config
        self.policy = ScalingPolicy(config)
        self.pool = pool
        self.ttft_s = ttft_s  # the controller's TTFT histogram (cumulative)
        self.clock = clock
        self.can_place = can_place  # whether a worker's resources are free somewhere now
        self.request_resources = request_resources  # the pool's target size, to Ray
        self.load = load or (lambda sample: sample)  # tests script the load through it
        self.ttft_window = WindowQuantile(config.window_s)
        self.task: asyncio.Task[None] | None = None
        self.decisions: list[tuple[float, ScaleDecision]] = []

    def sample(self) -> LoadSample:
        now = self.clock()
        core = self.pool.host.core
        assert core is not None
        serving = self.pool.serving()
        num_loading = self.pool.state_counts()["loading"]
        return LoadSample(
            now, len(serving) + num_loading,
            sum(core.scheduler(w).num_waiting for w in serving),
            self.ttft_window.observe(now, self.ttft_s, 0.9),
            tuple(w for w in serving if _is_idle(core, w)))

    def tick(self) -> ScaleDecision | None:
        """One sample, and the decision it calls for carried out."""
        sample = self.load(self.sample())
        decision = self.policy.observe(sample)
        if decision is None:
            return None
        self.decisions.append((sample.now, decision))
        target = sample.num_workers + (1 if decision.direction == "up" else -1)
        if decision.direction == "up":
            if self.config.wait_for_nodes or self.can_place():
                loading = self.pool.add(decision.reason)
                logger.info("scaling up to %d workers (%s: %s): adding %s", target,
                            decision.reason, decision.detail, loading.name)
            else:
                target -= 1
                logger.warning("scaling up wanted (%s: %s) but no node has a worker's "
                               "resources free (scaling.wait_for_nodes is off)",
                               decision.reason, decision.detail)
        else:
            assert decision.worker is not None
            self.pool.drain(decision.worker, self.config.drain_timeout_s, decision.reason)
            logger.info("scaling down to %d workers (%s: %s): draining worker %d", target,
                        decision.reason, decision.detail, decision.worker)
        try:
            self.request_resources(target)
        except Exception as err:  # Ray's autoscaler API is advisory: never stop scaling
            logger.warning("request_resources(%d workers) failed: %s", target, err)
        return decision

    def start(self) -> None:
        # A fresh context, as the step loops' (see actor.py).
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name="autoscaler", context=contextvars.Context())

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bad sample must not end scaling for good
                logger.exception("autoscaler tick failed")
            await asyncio.sleep(self.config.sample_interval_s)  # the sampling period

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


def _is_idle(core: ControllerCore, worker: int) -> bool:
    return core.workers[worker].is_up and not core.scheduler(worker).has_unfinished()


def bundles(resources: dict[str, Any], num_workers: int) -> list[dict[str, float]]:
    """Ray actor options of one worker (`num_cpus`, `num_gpus`, `resources`) as the
    resource bundles `request_resources` takes, one per worker."""
    bundle = {"CPU": float(resources.get("num_cpus", 0))}
    if resources.get("num_gpus"):
        bundle["GPU"] = float(resources["num_gpus"])
    bundle.update({k: float(v) for k, v in resources.get("resources", {}).items()})
    return [dict(bundle) for _ in range(num_workers)]
