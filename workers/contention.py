"""Other processes' CPU use on this process's cores while it measures, from `/proc/stat`.

A first start's calibration times the worker's steps while Serve, its proxy and the ingress
are starting on the same cores: on a 2-core machine that table came out 2-3x slow (every
point, the fixed step cost most), and a table is cached for every later start. So a
measurement is taken when the cores are quiet, and taken again when they were not
(`measure_quietly`); a table measured under contention anyway is used but not cached.

Contention counts only what the worker's own threads cannot avoid: the busy time of the
cores this process may run on, less its own CPU time, less the cores its threads leave
free. Linux only (elsewhere nothing is measured and every measurement counts as quiet).
Torch-free.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger("tokenflow.calibration")

T = TypeVar("T")

# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal ...; busy is
# user + nice + system + irq + softirq (guest time is inside user; steal is not a process's).
_BUSY_FIELDS = (0, 1, 2, 5, 6)
# A measurement shorter than this is not judged: /proc/stat counts in 10 ms ticks.
MIN_JUDGED_S = 1.0
# The window in which the cores are watched while waiting for them to be quiet.
QUIET_WINDOW_S = 0.25


def _own_cpus() -> set[int]:
    """The cores any of this process's threads may run on (a worker pins each of its
    threads to one core, so the calling thread's own affinity is not the process's)."""
    try:
        cpus: set[int] = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                cpus |= os.sched_getaffinity(int(tid))
            except OSError:  # a thread that ended meanwhile
                continue
        return cpus or set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy ticks of `cpus` since boot; None without /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total


@dataclass
class Probe:
    """Contention over the span from `start()` to `stop()`: other processes' CPU on this
    process's cores, in cores, beyond the `free_cores` its threads leave idle."""

    free_cores: float
    cpus: set[int]
    _ticks: int | None = None
    _own_s: float = 0.0
    _wall_s: float = 0.0

    @classmethod
    def for_threads(cls, threads: int) -> Probe:
        cpus = _own_cpus()
        return cls(free_cores=max(len(cpus) - threads, 0), cpus=cpus)

    def start(self) -> Probe:
        self._ticks = _busy_ticks(self.cpus)
        self._own_s, self._wall_s = time.process_time(), time.perf_counter()
        return self

    def stop(self) -> tuple[float, float] | None:
        """(contention in cores, seconds watched); None where nothing could be read."""
        ticks = _busy_ticks(self.cpus)
        wall_s = time.perf_counter() - self._wall_s
        if ticks is None or self._ticks is None or wall_s <= 0:
            return None
        busy_s = (ticks - self._ticks) / os.sysconf("SC_CLK_TCK")
        others = max(busy_s - (time.process_time() - self._own_s), 0.0) / wall_s
        return max(others - self.free_cores, 0.0), wall_s


def wait_until_quiet(probe: Probe, max_cores: float, deadline: float) -> float | None:
    """Watch this process's cores in short windows until one shows at most `max_cores` of
    contention or `deadline` (perf_counter) passes; the last window's contention."""
    last = None
    while True:
        probe.start()
        time.sleep(QUIET_WINDOW_S)  # the window watched, not a wait on an event
        seen = probe.stop()
        if seen is None:
            return None
        last = seen[0]
        if last <= max_cores or time.perf_counter() >= deadline:
            return last


@dataclass(frozen=True)
class QuietReport:
    contention_cores: float | None  # of the measurement kept; None: not judged
    attempts: int
    waited_s: float  # watching busy cores before measuring, in all

    def is_quiet(self, max_cores: float) -> bool:
        return self.contention_cores is None or self.contention_cores <= max_cores


def _as_cores(contention: float | None) -> float:
    return 0.0 if contention is None else contention  # not judged: counted as quiet


def measure_quietly(measure: Callable[[], T], threads: int, max_cores: float,
                    quiet_wait_s: float, max_attempts: int) -> tuple[T, QuietReport]:
    """`measure()` once the cores are quiet (waiting at most `quiet_wait_s` in all), again
    while a measurement saw more than `max_cores` of contention, up to `max_attempts`; the
    least contended measurement."""
    probe = Probe.for_threads(threads)
    deadline = time.perf_counter() + quiet_wait_s
    best: tuple[T, float | None] | None = None
    attempts, waited_s = 0, 0.0
    while attempts < max_attempts:
        started = time.perf_counter()
        waited = wait_until_quiet(probe, max_cores, deadline)
        waited_s += time.perf_counter() - started
        if waited is not None and waited > max_cores and best is not None:
            break  # still busy past the deadline: measuring again would not be quieter
        attempts += 1
        probe.start()
        result = measure()
        seen = probe.stop()
        contention = seen[0] if seen is not None and seen[1] >= MIN_JUDGED_S else None
        if best is None or _as_cores(contention) < _as_cores(best[1]):
            best = (result, contention)
        if contention is None or contention <= max_cores:
            break
        logger.warning("calibration: other processes used %.2f cores of this worker's "
                       "during the measurement; measuring again once they are quiet",
                       contention)
    assert best is not None
    return best[0], QuietReport(best[1], attempts, waited_s)
