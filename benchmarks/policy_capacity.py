"""Capacity under an SLO, as Sarathi-Serve measures it: the highest request rate whose P99
inter-token latency stays under the ITL SLO and whose P99 time to first token stays under its
bound, found by bisection on the rate.

The bisection is geometric (rates span orders of magnitude) between a rate assumed to pass
and one assumed to fail, for a fixed number of trials; the answer is the highest rate that
passed (None when none did: then the lowest failing rate bounds it from above). Policies are
searched side by side: trial i of every policy runs interleaved step by step with the others'
trial i (`drive_together`), so a burst of load from a neighbour lands on all of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.policy_metrics import itls, summary_ms, throughput, ttft
from benchmarks.policy_workloads import MixRequest, poisson_arrivals
from benchmarks.virtual_time import Driver, VirtualClock, drive_together
from cluster.engine import LocalEngine


@dataclass
class Bisection:
    lo: float  # assumed to pass (never run)
    hi: float  # assumed to fail (never run)
    iterations: int
    trials: list[dict[str, Any]] = field(default_factory=list)

    def next_rate(self) -> float | None:
        return None if len(self.trials) >= self.iterations else math.sqrt(self.lo * self.hi)

    def record(self, trial: dict[str, Any]) -> None:
        self.trials.append(trial)
        if trial["passed"]:
            self.lo = trial["rate_req_s"]
        else:
            self.hi = trial["rate_req_s"]

    def result(self) -> dict[str, Any]:
        passed = [t["rate_req_s"] for t in self.trials if t["passed"]]
        failed = [t["rate_req_s"] for t in self.trials if not t["passed"]]
        return {"capacity_req_s": max(passed, default=None),
                "lowest_failing_req_s": min(failed, default=None),
                "trials": self.trials}


@dataclass
class TrialRunner:
    """One policy's engine and clock, run through the same requests at any rate."""

    engine: LocalEngine
    clock: VirtualClock
    requests: list[MixRequest]
    itl_slo_s: float
    ttft_bound_s: float
    count: int = 0

    def start(self, rate: float) -> Driver:
        self.count += 1
        arrivals = poisson_arrivals(self.requests, rate, self.clock.now, f"cap{self.count}")
        return Driver(self.engine, self.clock, arrivals)

    def result(self, driver: Driver, rate: float) -> dict[str, Any]:
        trace = driver.trace
        reqs = list(trace.requests.values())
        itl = summary_ms(itls(trace, list(trace.requests)))
        ttft_ms = summary_ms([ttft(r) for r in reqs if r.token_times])
        aborted = sum(r.aborted for r in reqs)
        passed = (itl["p99_ms"] <= self.itl_slo_s * 1e3
                  and ttft_ms["p99_ms"] <= self.ttft_bound_s * 1e3 and not aborted)
        return {"rate_req_s": rate, "passed": passed, "p99_itl_ms": itl["p99_ms"],
                "median_itl_ms": itl["median_ms"], "max_itl_ms": itl["max_ms"],
                "p99_ttft_s": ttft_ms["p99_ms"] / 1e3, "median_ttft_s": ttft_ms["median_ms"] / 1e3,
                "aborted": aborted, "steps": len(trace.steps),
                # What each P99 rests on: a P99 of n samples is about the (n/100)-th worst.
                "num_requests": len(reqs), "num_itl_samples": itl["n"],
                "num_ttft_samples": ttft_ms["n"],
                "total_tokens_per_s": throughput(trace)["total_tokens_per_s"]}


def search_capacity(runners: dict[str, TrialRunner], lo: float, hi: float,
                    iterations: int) -> dict[str, dict[str, Any]]:
    """Trial i of every policy runs interleaved with the others' trial i (drive_together)."""
    searches = {name: Bisection(lo, hi, iterations) for name in runners}
    for _ in range(iterations):
        rates = {name: s.next_rate() for name, s in searches.items()}
        started = time.perf_counter()
        drivers = {name: runners[name].start(rate) for name, rate in rates.items()
                   if rate is not None}
        drive_together(list(drivers.values()))
        for name, driver in drivers.items():
            trial = runners[name].result(driver, rates[name])  # type: ignore[arg-type]
            searches[name].record(trial)
        print(f"[policies] capacity trials ({time.perf_counter() - started:.0f} s): " + ", ".join(
            f"{name} {t.trials[-1]['rate_req_s']:.3g} req/s "
            f"{'pass' if t.trials[-1]['passed'] else 'fail'}" for name, t in searches.items()),
            flush=True)
    return {name: {"search_range_req_s": [lo, hi], **s.result()} for name, s in searches.items()}


def _estimate(search: dict[str, Any]) -> tuple[float, int]:
    """A policy's capacity estimate and its direction: 0 when bracketed by a passing and a
    failing rate, +1 when it may be higher (it never failed), -1 when it is lower (it never
    passed: the lowest failing rate stands in)."""
    passed, failed = search["capacity_req_s"], search["lowest_failing_req_s"]
    if passed is None:
        return failed, -1
    return passed, 0 if failed is not None else 1


def capacity_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[float, str]:
    """ours / theirs capacity and what kind of number it is: "bracketed" (both found
    within the search's resolution), "lower_bound" (the true ratio is at least this: ours
    never failed or theirs never passed), "upper_bound", or "unknown" (both directions)."""
    (mine, up), (other, down) = _estimate(ours), _estimate(theirs)
    direction = {up, -down} - {0}
    kind = "bracketed" if not direction else "unknown" if len(direction) == 2 else (
        "lower_bound" if direction == {1} else "upper_bound")
    return mine / other, kind
