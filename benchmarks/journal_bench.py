"""The journal's cost on the step loop: journal on vs off at 64 running requests.

A step loop of 64 decoding requests with a 3 ms device step (slept, as a GPU step would be
awaited) feeds the journal exactly what the controller feeds it per step (the step's outputs
in one `record_outputs` call, then `end_step`), against a real `redis-server` this benchmark
starts. The figure is the controller process's CPU time per step, journal on minus off, as a
share of the 3 ms step (goal <= 5 %): the writer thread competes with the event loop for the
interpreter, so CPU time, not wall time, is what the step loop loses. Round trips per step
are reported too: token progress is written at most once per `journal.write_interval_s`
(admissions at once); the same loop with a round trip after every step is measured beside
it. """

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from controller.journal import Journal, JournalConfig, JournalStats
from controller.messages import RequestOutput, SamplingParams
from controller.request import Request

STEP_S = 3e-3
NUM_REQUESTS = 64
REPEATS = 3


def _requests() -> list[Request]:
    params = SamplingParams(max_tokens=10_000, temperature=0.0, seed=1)
    return [Request(f"bench-{i}", list(range(1, 129)), params) for i in range(NUM_REQUESTS)]


def _loop(journal: Journal | None, num_steps: int) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of `num_steps` steps."""
    requests = _requests()
    if journal is not None:
        for request in requests:
            journal.admit(request)
        journal.flush(10.0)
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(num_steps):
        time.sleep(STEP_S)  # the device step the loop awaits
        # The step's outputs exist either way; only handing them to the journal differs.
        outputs = [RequestOutput(r.request_id, [(step + i) % 500], None, 128, step + 1)
                   for i, r in enumerate(requests)]
        if journal is None:
            continue
        journal.record_outputs(outputs)
        journal.end_step()
    if journal is not None:
        journal.flush(10.0)
    return time.process_time() - cpu, time.perf_counter() - wall


def _journal_on(url: str, config: JournalConfig, num_steps: int
                ) -> tuple[float, float, float, JournalStats]:
    """(CPU s, wall s, round trips per step, stats) of the loop with the journal on."""
    journal = Journal(url, config)
    try:
        trips_before = journal.num_round_trips
        cpu, wall = _loop(journal, num_steps)
        return cpu, wall, (journal.num_round_trips - trips_before) / num_steps, journal.stats()
    finally:
        journal.close(5.0)


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from tests.redis_server import RedisServer

    num_steps = 100 if quick else 1000
    config = JournalConfig()  # the default write interval
    every_step = dataclasses.replace(config, write_interval_s=0.0)
    runs: dict[str, list[tuple[float, ...]]] = {"off": [], "on": [], "every_step": []}
    server = RedisServer().start()
    try:
        # Interleaved repetitions, medians reported: the machine's noise hits all three.
        for _ in range(REPEATS):
            runs["off"].append(_loop(None, num_steps))
            on = _journal_on(server.url, config, num_steps)
            runs["on"].append(on[:3])
            stats = on[3]
            # The same with a round trip after every step, to show what the interval buys.
            runs["every_step"].append(_journal_on(server.url, every_step, num_steps)[:3])
    finally:
        server.kill()

    def median(name: str, i: int) -> float:
        return statistics.median(run[i] for run in runs[name])

    off_cpu, off_wall = median("off", 0), median("off", 1)
    on_cpu, on_wall, trips = median("on", 0), median("on", 1), median("on", 2)
    each_cpu, each_trips = median("every_step", 0), median("every_step", 2)
    overhead_s = (on_cpu - off_cpu) / num_steps
    share = overhead_s / STEP_S
    return {
        "benchmark": "journal", "num_requests": NUM_REQUESTS, "num_steps": num_steps,
        "step_s": STEP_S, "write_interval_s": config.write_interval_s, "repeats": REPEATS,
        "overhead_share_of_step_per_repeat": [
            (on[0] - off[0]) / num_steps / STEP_S
            for on, off in zip(runs["on"], runs["off"], strict=True)],
        "cpu_per_step_ms": {"journal_off": 1e3 * off_cpu / num_steps,
                            "journal_on": 1e3 * on_cpu / num_steps,
                            "journal_on_write_every_step": 1e3 * each_cpu / num_steps},
        "wall_per_step_ms": {"journal_off": 1e3 * off_wall / num_steps,
                             "journal_on": 1e3 * on_wall / num_steps},
        "overhead_ms_per_step": 1e3 * overhead_s,
        "overhead_share_of_step": share,
        "overhead_share_of_step_write_every_step": (each_cpu - off_cpu) / num_steps / STEP_S,
        "round_trips_per_step": trips,
        "round_trips_per_step_write_every_step": each_trips,
        "journal": {"num_pauses": stats.num_pauses, "num_write_errors": stats.num_write_errors},
        "target": {"overhead_share_of_step": 0.05, "met": share <= 0.05},
    }
