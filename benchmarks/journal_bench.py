"""The journal's cost on the step loop: journal on vs off at 64 running requests.

A step loop of 64 decoding requests with a 3 ms device step (slept, as a GPU step would be
awaited) feeds the journal exactly what the controller feeds it per step (one output per
request, then `end_step`), against a real `redis-server` this benchmark starts. The figure
is the controller process's CPU time per step, journal on minus off, as a share of the 3 ms
step (goal <= 5 %): the writer thread competes with the event loop for the interpreter, so
CPU time, not wall time, is what the step loop loses. Round trips per step are reported too
(goal: one per step).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from controller.journal import Journal
from controller.messages import SamplingParams
from controller.request import Request, RequestOutput

STEP_S = 3e-3
NUM_REQUESTS = 64


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
        for out in outputs:
            journal.record_output(out)
        journal.end_step()
    if journal is not None:
        journal.flush(10.0)
    return time.process_time() - cpu, time.perf_counter() - wall


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from tests.redis_server import RedisServer

    num_steps = 100 if quick else 1000
    server = RedisServer().start()
    try:
        off_cpu, off_wall = _loop(None, num_steps)
        journal = Journal(server.url)
        try:
            trips_before = journal.num_round_trips
            on_cpu, on_wall = _loop(journal, num_steps)
            stats = journal.stats()
            num_trips = journal.num_round_trips - trips_before
        finally:
            journal.close(5.0)
    finally:
        server.kill()
    overhead_s = (on_cpu - off_cpu) / num_steps
    share = overhead_s / STEP_S
    return {
        "benchmark": "journal", "num_requests": NUM_REQUESTS, "num_steps": num_steps,
        "step_s": STEP_S,
        "cpu_per_step_ms": {"journal_off": 1e3 * off_cpu / num_steps,
                            "journal_on": 1e3 * on_cpu / num_steps},
        "wall_per_step_ms": {"journal_off": 1e3 * off_wall / num_steps,
                             "journal_on": 1e3 * on_wall / num_steps},
        "overhead_ms_per_step": 1e3 * overhead_s,
        "overhead_share_of_step": share,
        "round_trips_per_step": num_trips / num_steps,
        "journal": {"num_pauses": stats.num_pauses, "num_write_errors": stats.num_write_errors},
        "target": {"overhead_share_of_step": 0.05, "met": share <= 0.05},
    }
