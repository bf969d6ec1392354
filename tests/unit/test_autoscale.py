"""The pool-size policy on a virtual clock: grows under a sustained queue, stays within its
bounds, shrinks after the cool-down, never flaps under a load faster than its window."""

from __future__ import annotations

import pytest

from controller.autoscale import SCALE_REASONS, LoadSample, ScalingConfig, ScalingPolicy

CONFIG = ScalingConfig(enabled=True, min_workers=1, max_workers=3, waiting_per_worker=4,
                       window_s=30, idle_cooldown_s=120)


class Pool:
    """A fake pool that applies the policy's decisions to its own worker list and records
    them; a new worker is routable at once (the policy's quiet window covers its load)."""

    def __init__(self, policy: ScalingPolicy, num_workers: int) -> None:
        self.policy = policy
        self.workers = list(range(num_workers))
        self.next_id = num_workers
        self.decisions: list[tuple[float, str, str, int | None]] = []

    def tick(self, now: float, num_waiting: int, idle: tuple[int, ...] = (),
             ttft_p90_s: float | None = None) -> None:
        idle = tuple(w for w in idle if w in self.workers)
        decision = self.policy.observe(LoadSample(now, len(self.workers), num_waiting,
                                                  ttft_p90_s, idle))
        if decision is None:
            return
        assert (decision.direction, decision.reason) in SCALE_REASONS
        self.decisions.append((now, decision.direction, decision.reason, decision.worker))
        if decision.direction == "up":
            self.workers.append(self.next_id)
            self.next_id += 1
        else:
            assert decision.worker in idle  # only an idle worker is released
            self.workers.remove(decision.worker)


def test_a_sustained_queue_grows_the_pool_one_window_at_a_time_up_to_max() -> None:
    pool = Pool(ScalingPolicy(CONFIG), 1)
    for now in range(0, 200, 5):
        # 40 waiting: over 4 per worker at any size <= 3. The second step needs a window of
        # samples after the first decision (35..65).
        pool.tick(now, num_waiting=40)
        assert CONFIG.min_workers <= len(pool.workers) <= CONFIG.max_workers
    assert [(t, d, r) for t, d, r, _ in pool.decisions] == [(30, "up", "queue"),
                                                            (65, "up", "queue")]
    assert len(pool.workers) == 3


def test_an_idle_pool_shrinks_after_the_cool_down_to_min_and_no_further() -> None:
    pool = Pool(ScalingPolicy(CONFIG), 3)
    for now in range(0, 1000, 5):
        pool.tick(now, num_waiting=0, idle=tuple(pool.workers))
    assert [(t, d, r, w) for t, d, r, w in pool.decisions] == [
        (120, "down", "idle", 2), (150, "down", "idle", 1)]
    assert pool.workers == [0]


def test_a_load_that_oscillates_faster_than_the_window_never_scales() -> None:
    pool = Pool(ScalingPolicy(CONFIG), 2)
    for now in range(0, 600, 5):
        busy = (now // 20) % 2 == 0  # 20 s on, 20 s off: shorter than the 30 s window
        pool.tick(now, num_waiting=40 if busy else 0, idle=() if busy else (1,))
    assert pool.decisions == []  # neither up (never 30 s) nor down (never 120 s idle)


def test_a_worker_busy_again_restarts_its_cool_down() -> None:
    pool = Pool(ScalingPolicy(CONFIG), 2)
    for now in range(0, 100, 5):
        pool.tick(now, num_waiting=0, idle=(1,))
    pool.tick(100, num_waiting=1, idle=())  # worker 1 got a request
    for now in range(105, 220, 5):
        pool.tick(now, num_waiting=0, idle=(1,))
    assert pool.decisions == []  # 115 s idle since 105: not yet
    pool.tick(225, num_waiting=0, idle=(1,))
    assert pool.decisions == [(225, "down", "idle", 1)]


def test_ttft_over_its_threshold_for_a_window_scales_up() -> None:
    config = ScalingConfig(enabled=True, min_workers=1, max_workers=2, ttft_p90_s=2.0,
                           window_s=30)
    pool = Pool(ScalingPolicy(config), 1)
    for now in range(0, 60, 5):
        pool.tick(now, num_waiting=1, ttft_p90_s=3.5)
    assert [(t, r) for t, _, r, _ in pool.decisions] == [(30, "ttft")]


def test_below_min_asks_at_once_then_waits_a_window() -> None:
    pool = Pool(ScalingPolicy(ScalingConfig(enabled=True, min_workers=2, max_workers=4)), 0)
    for now in range(0, 40, 5):
        pool.tick(now, num_waiting=0)
    assert [(t, r) for t, _, r, _ in pool.decisions] == [(0, "below_min"), (30, "below_min")]


def test_min_above_max_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="min_workers"):
        ScalingConfig(min_workers=3, max_workers=2)
