"""A calibration measures on quiet cores: it waits for other processes' CPU use on its
cores to fall, measures again when a measurement was disturbed, and a table measured under
contention anyway serves the run without being cached. Real processes burn real CPU here
(a busy child Python), read back through /proc/stat."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.calibrator.test_auto_budget import BASE_IDENTITY, BASE_SPEC, SLO_MS, cal, fake_measure
from workers.auto_budget import cache_path, load_or_calibrate
from workers.contention import MIN_JUDGED_S, measure_quietly

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")

# Every core of this process busy with the worker's threads: none is left free, so another
# process's busy core counts whole.
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
MAX_CORES = 0.3


def busy_child(cpu_s: float | None = None) -> subprocess.Popen[str]:
    """A process spinning one core (for `cpu_s` of CPU, else until killed), started: it has
    said so before this returns."""
    limit = "float('inf')" if cpu_s is None else repr(cpu_s)
    code = ("import time\nprint('busy', flush=True)\n"
            f"while time.process_time() < {limit}: pass\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "busy\n"
    return child


def spin(seconds: float) -> None:
    """This process busy for `seconds` (its own CPU is not contention)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


def test_a_disturbed_measurement_is_taken_again_once_the_cores_are_quiet(
        children: list[subprocess.Popen[str]]) -> None:
    calls: list[str] = []

    def measure() -> str:
        if not calls:  # the first measurement shares the cores with a busy process
            children.append(busy_child())
            spin(MIN_JUDGED_S + 0.2)
            children[-1].kill()
            children[-1].wait()
            calls.append("disturbed")
        else:
            spin(MIN_JUDGED_S + 0.2)
            calls.append("quiet")
        return calls[-1]

    result, report = measure_quietly(measure, THREADS, MAX_CORES, quiet_wait_s=30,
                                     max_attempts=3)
    assert calls[0] == "disturbed" and result == "quiet"
    assert report.attempts == len(calls) >= 2
    assert report.contention_cores is not None and report.contention_cores <= MAX_CORES


def test_a_measurement_waits_for_busy_cores_to_fall_quiet(
        children: list[subprocess.Popen[str]]) -> None:
    children.append(busy_child(cpu_s=1.0))
    seen: list[int | None] = []

    def measure() -> str:
        seen.append(children[0].poll())  # still spinning would be a disturbed measurement
        return "done"

    result, report = measure_quietly(measure, THREADS, MAX_CORES, quiet_wait_s=30,
                                     max_attempts=3)
    assert result == "done" and seen == [0] and report.attempts == 1


def test_a_table_measured_under_contention_serves_but_is_not_cached(
        tmp_path: Path, table_path: Path, children: list[subprocess.Popen[str]]) -> None:
    calls, quiet_measure = fake_measure(table_path)

    def disturbed(spec: Any) -> dict[str, Any]:
        children.append(busy_child())
        spin(MIN_JUDGED_S + 0.2)
        children[-1].kill()
        children[-1].wait()
        return quiet_measure(spec)

    # Time to see the cores quiet between the tries: a stray busy window on a shared VM
    # past a zero wait would end the tries after the first.
    section = cal(tmp_path, quiet_wait_s=30.0, max_measure_attempts=2)
    spec = dataclasses.replace(BASE_SPEC, threads=THREADS)  # no core left free
    first = load_or_calibrate(spec, BASE_IDENTITY, section, SLO_MS, disturbed)
    assert first.is_measured and not first.is_cached and len(calls) == 2
    assert first.contention_cores is not None and first.contention_cores > MAX_CORES
    assert first.data["recommendation"]["max_num_batched_tokens"] > 0  # it serves
    path = cache_path(tmp_path, spec, BASE_IDENTITY)
    assert not path.exists()
    # The next start measures again, on quiet cores this time, and caches that table.
    again = load_or_calibrate(spec, BASE_IDENTITY, section, SLO_MS, quiet_measure)
    assert again.is_measured and again.is_cached and len(calls) == 3 and path.exists()


@pytest.mark.skipif(THREADS < 2, reason="needs two cores")
def test_the_cores_watched_are_every_thread_s_not_the_pinned_caller_s() -> None:
    """A worker pins each of its threads to one core; the calling thread's affinity alone
    would hide the other cores' busy time."""
    import threading

    from workers.contention import _own_cpus

    every = os.sched_getaffinity(0)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        os.sched_setaffinity(0, {min(every)})  # this thread only, as a pinned worker thread
        assert _own_cpus() == every
    finally:
        os.sched_setaffinity(0, every)
        stop.set()
        other.join()
