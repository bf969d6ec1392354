"""A batch job's engine in one Ray task (cluster/task_batch.py), on the session's cluster.

The task runs `run_local` on the driver's node, on the paths it is given. When its process
is SIGKILLed mid-run, Ray runs it again and the run resumes after the answered lines: every
line is answered exactly once, with the greedy tokens of an undisturbed run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import psutil

from cluster.task_batch import run_in_task, should_run_in_task
from tests.integration.conftest import Cluster

NUM_LINES = 24


def write_input(path: Path) -> None:
    """Lines of growing length: answers come one after another, so the kill lands mid-run."""
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "builtin:tiny", "prompt": f"line {i} of the batch, {i * 13}",
                      "max_tokens": 16 + 12 * i, "temperature": 0, "ignore_eos": True,
                      "return_token_ids": True}} for i in range(NUM_LINES)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def answers(path: Path) -> list[tuple[str, list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["custom_id"], r["response"]["body"]["choices"][0]["token_ids"]) for r in rows]


def engine_task_pids() -> list[int]:
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("ray::_engine_task"):
            pids.append(proc.pid)
    return pids


def test_the_decision(cluster: Cluster) -> None:
    config = cluster.config
    one = config.model_copy(update={"worker": dataclasses.replace(config.worker,
                                                                  num_workers=1)})
    assert config.worker.num_workers == 2 and not should_run_in_task(config, False)
    assert should_run_in_task(one, False)  # no controller, one worker, resources free
    assert not should_run_in_task(one, True)  # a running controller serves the job


def test_a_killed_engine_task_runs_again_and_resumes(cluster: Cluster, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    write_input(inp)
    reference_out = tmp_path / "reference.jsonl"
    counts, num_retried = run_in_task(str(inp), str(reference_out), cluster.config,
                                      progress=False)
    assert counts["completed"] == NUM_LINES and num_retried == 0
    reference = dict(answers(reference_out))

    out = tmp_path / "out.jsonl"
    result: dict[str, object] = {}
    runner = threading.Thread(target=lambda: result.update(
        run=run_in_task(str(inp), str(out), cluster.config, progress=False)))
    runner.start()
    killed: list[int] = []
    stop = threading.Event()
    # A condition polled (bounded): some lines answered, not all, and the task's process
    # found; then it is SIGKILLed.
    for _ in range(2400):
        lines = out.read_text().count("\n") if out.exists() else 0
        pids = engine_task_pids()
        if 3 <= lines < NUM_LINES and pids:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed = pids
            break
        if not runner.is_alive() or stop.wait(0.05):
            break
    runner.join(timeout=300)
    assert killed, "the task finished before it could be killed"
    assert not runner.is_alive()
    counts, _ = result["run"]  # type: ignore[misc]
    got = answers(out)
    # Every line exactly once, each with the undisturbed run's tokens; the rerun answered
    # only the lines the killed run had not.
    assert sorted(custom_id for custom_id, _ in got) == sorted(reference)
    assert dict(got) == reference
    assert 0 < counts["completed"] < NUM_LINES and counts["skipped"] == NUM_LINES - \
        counts["completed"]
