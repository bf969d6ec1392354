"""Flow-control modes: every transition both ways, with hysteresis. Scripted signals,
injected time (the samples carry it)."""

from controller.flow import FlowConfig, FlowControl, Mode
from controller.messages import CacheEvict


def feed(flow: FlowControl, value: float, start: float, end: float, dt: float = 0.5) -> float:
    t = start
    while t <= end + 1e-9:
        flow.on_bandwidth(value, t)
        t += dt
    return t


def test_cache_pressure_enters_above_85_and_leaves_only_below_79_on_evict():
    flow = FlowControl()
    flow.on_kv_usage(0.84, 0.0)
    assert flow.mode == Mode.NORMAL
    flow.on_kv_usage(0.86, 1.0)
    assert flow.mode == Mode.CACHE_PRESSURE_WAIT and flow.max_concurrent_chunks == 0
    # usage oscillating around the entry threshold: no flapping
    for i, usage in enumerate((0.84, 0.86, 0.83, 0.80)):
        flow.on_cache_evict(CacheEvict("r", 1, usage), 2.0 + i)
        assert flow.mode == Mode.CACHE_PRESSURE_WAIT
    flow.on_cache_evict(CacheEvict("r", 4, 0.78), 10.0)
    assert flow.mode == Mode.NORMAL and flow.max_concurrent_chunks == 4
    assert [(t.old, t.new) for t in flow.log] == [
        (Mode.NORMAL, Mode.CACHE_PRESSURE_WAIT), (Mode.CACHE_PRESSURE_WAIT, Mode.NORMAL)]


def test_bandwidth_throttle_levels_and_exit_hysteresis():
    flow = FlowControl()
    t = feed(flow, 0.92, 0.0, 2.5)
    assert flow.mode == Mode.NORMAL  # above 90 % for less than 3 s
    t = feed(flow, 0.92, t, 6.0)
    assert flow.mode == Mode.BANDWIDTH_THROTTLE and flow.max_concurrent_chunks == 2
    t = feed(flow, 0.99, t, t + 8.0)
    assert flow.max_concurrent_chunks == 1
    # dipping to 88 % (between exit 85 % and entry 90 %) keeps the throttle
    t = feed(flow, 0.88, t, t + 10.0)
    assert flow.mode == Mode.BANDWIDTH_THROTTLE
    t = feed(flow, 0.5, t, t + 2.0)  # below the exit threshold, but not for 3 s yet
    assert flow.mode == Mode.BANDWIDTH_THROTTLE
    feed(flow, 0.5, t, t + 8.0)
    assert flow.mode == Mode.NORMAL and flow.max_concurrent_chunks == 4


def test_oscillating_bandwidth_does_not_flap():
    flow = FlowControl()
    t = feed(flow, 0.93, 0.0, 6.0)
    assert flow.mode == Mode.BANDWIDTH_THROTTLE
    for i in range(40):  # 80 % / 95 %: average ~0.875, between exit and entry
        flow.on_bandwidth(0.80 if i % 2 else 0.95, t)
        t += 0.5
    assert flow.mode == Mode.BANDWIDTH_THROTTLE
    assert flow.stats.transitions == 1


def test_prefill_paused_after_10s_above_98_and_recovers_below_90():
    flow = FlowControl(FlowConfig())
    t = feed(flow, 0.99, 0.0, 9.0)
    assert flow.mode == Mode.BANDWIDTH_THROTTLE
    t = feed(flow, 0.99, t, 12.0)
    assert flow.mode == Mode.PREFILL_PAUSED and not flow.allow_new_prefill
    t = feed(flow, 0.93, t, t + 10.0)  # below 98 % but above 90 %: still paused
    assert flow.mode == Mode.PREFILL_PAUSED
    feed(flow, 0.6, t, t + 6.0)
    assert flow.mode != Mode.PREFILL_PAUSED and flow.allow_new_prefill
