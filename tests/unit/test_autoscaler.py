"""The scaling policy wired to the controller: the autoscaler samples a controller over
fake workers (tests/unit/test_elastic_pool.py) on a virtual clock, with a scripted queue
where the test says so, and its decisions add and drain real slots of the pool. Shows: the
pool grows under a sustained queue one window at a time up to max_workers and asks Ray for
that size; an idle pool shrinks after the cool-down to min_workers, draining real workers;
a load that oscillates faster than the window changes nothing; with no free resources on
a fixed cluster it adds nothing; the sample reads the real queues; the TTFT quantile is
over the window only."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from controller.autoscale import LoadSample, ScalingConfig
from controller.histogram import LATENCY_BUCKETS_S, Histogram
from controller.scaling import Autoscaler, WindowQuantile, bundles
from tests.unit.test_elastic_pool import Pool, run

CONFIG = ScalingConfig(enabled=True, min_workers=1, max_workers=3, waiting_per_worker=4,
                       window_s=30, idle_cooldown_s=120, drain_timeout_s=5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scaled:
    """A pool of fake workers with its autoscaler on a virtual clock."""

    def __init__(self, num_workers: int, load: Callable[[LoadSample], LoadSample] | None = None,
                 can_place: bool = True, config: ScalingConfig = CONFIG) -> None:
        self.pool = Pool(num_workers)
        self.clock = Clock()
        self.asked: list[int] = []  # what went to request_resources
        self.scaler = Autoscaler(config, self.pool.actor.pool, Histogram(LATENCY_BUCKETS_S),
                                 self.clock, lambda: can_place, self.asked.append, load)

    async def run(self, times: range) -> None:
        await self.pool.actor._started()
        elastic = self.pool.actor.pool
        for now in times:
            self.clock.now = float(now)
            self.scaler.tick()
            while elastic.loading or elastic.draining:  # joins and drains complete
                elastic.changed.clear()
                await elastic.changed.wait()

    def decisions(self) -> list[tuple[float, str, str, int | None]]:
        return [(t, d.direction, d.reason, d.worker) for t, d in self.scaler.decisions]

    def serving(self) -> list[int]:
        return self.pool.actor.pool.serving()


def queue_of(num_waiting: Callable[[float], int]) -> Callable[[LoadSample], LoadSample]:
    """A scripted queue: busy workers are not idle."""
    def load(sample: LoadSample) -> LoadSample:
        waiting = num_waiting(sample.now)
        return dataclasses.replace(sample, num_waiting=waiting,
                                   idle_workers=() if waiting else sample.idle_workers)
    return load


def test_a_sustained_queue_grows_the_pool_up_to_max_and_asks_ray_for_it() -> None:
    async def main() -> None:
        scaled = Scaled(1, queue_of(lambda now: 40))
        await scaled.run(range(0, 200, 5))
        assert [(t, d, r) for t, d, r, _ in scaled.decisions()] == [
            (30, "up", "queue"), (65, "up", "queue")]
        assert scaled.serving() == [0, 1, 2] and scaled.pool.spawned == [1, 2]
        assert scaled.asked == [2, 3]
        snap = await scaled.pool.actor.metrics_snapshot()
        assert snap.pool_states["serving"] == 3 and snap.scale_events[("up", "queue")] == 2
        _, done = await scaled.pool.request([1, 2, 3], "after")  # the grown pool serves
        assert done.error is None

    run(main())


def test_an_idle_pool_shrinks_after_the_cool_down_to_min_by_draining() -> None:
    async def main() -> None:
        scaled = Scaled(3)  # no request: the real queues are empty, every worker idle
        await scaled.run(range(0, 1000, 5))
        assert scaled.decisions() == [(120, "down", "idle", 2), (150, "down", "idle", 1)]
        assert scaled.serving() == [0] and scaled.asked == [2, 1]
        assert scaled.pool.removed == scaled.pool.handles[2:0:-1]  # killed for good
        snap = await scaled.pool.actor.metrics_snapshot()
        assert snap.worker_ids == [0] and snap.scale_events[("down", "idle")] == 2
        assert (await scaled.pool.actor.ping())["ok"]

    run(main())


def test_a_load_oscillating_faster_than_the_window_never_scales() -> None:
    async def main() -> None:
        scaled = Scaled(2, queue_of(lambda now: 40 if (now // 20) % 2 == 0 else 0))
        await scaled.run(range(0, 600, 5))
        assert scaled.decisions() == [] and scaled.serving() == [0, 1]
        assert scaled.asked == []

    run(main())


def test_on_a_fixed_cluster_without_free_resources_nothing_is_added() -> None:
    async def main() -> None:
        scaled = Scaled(1, queue_of(lambda now: 40), can_place=False)
        await scaled.run(range(0, 100, 5))
        assert [r for _, _, r, _ in scaled.decisions()] == ["queue", "queue"]
        assert scaled.pool.spawned == [] and scaled.serving() == [0]
        assert scaled.asked == [1, 1]  # the size it has: nothing pending for Ray

    run(main())


def test_the_sample_reads_the_real_queues() -> None:
    async def main() -> None:
        scaled = Scaled(2)
        actor = scaled.pool.actor
        await actor._started()
        for handle in scaled.pool.handles:
            handle.gate.clear()
        tasks = [asyncio.create_task(scaled.pool.request([1 + i, 2, 3], f"q{i}"))
                 for i in range(24)]
        await asyncio.gather(*(h.entered.wait() for h in scaled.pool.handles))
        sample = scaled.scaler.sample()
        waiting = sum(actor.core.scheduler(w).num_waiting for w in (0, 1))
        assert sample.num_workers == 2 and sample.num_waiting == waiting > 0
        assert sample.idle_workers == ()
        for handle in scaled.pool.handles:
            handle.gate.set()
        await asyncio.gather(*tasks)
        assert scaled.scaler.sample().idle_workers == (0, 1)

    run(main())


def test_the_ttft_quantile_covers_the_window_only() -> None:
    hist = Histogram(LATENCY_BUCKETS_S)
    window = WindowQuantile(30)
    assert window.observe(0, hist, 0.9) is None
    for _ in range(10):
        hist.observe(5.0)  # slow first tokens, long ago
    assert window.observe(10, hist, 0.9) == 5.0
    assert window.observe(45, hist, 0.9) is None  # out of the window: nothing new since 10
    for _ in range(10):
        hist.observe(0.1)
    assert window.observe(50, hist, 0.9) == 0.1


def test_bundles_carry_cpu_gpu_and_the_placement_resource() -> None:
    resources = {"num_cpus": 0.5, "num_gpus": 0, "resources": {"tokenflow_worker": 1}}
    assert bundles(resources, 2) == [{"CPU": 0.5, "tokenflow_worker": 1.0}] * 2
    assert bundles({"num_cpus": 1, "num_gpus": 1}, 1) == [{"CPU": 1.0, "GPU": 1.0}]
