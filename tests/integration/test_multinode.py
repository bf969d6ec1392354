"""Workers and the controller spread over several Ray nodes; nodes lost mid-stream.

A real multi-node Ray cluster on this machine (a head plus worker and controller nodes,
each its own raylet, loopback only), driven by `multinode_scenario.py` in a process of its
own. What must hold: the workers land on different nodes, not the controller's; losing a
worker node and then the controller's node mid-stream loses no stream and changes no token
(every greedy output equals the undisturbed run); a node that joins gets the lost worker
back and requests again; the controller comes back on the spare node and resumed the open
requests from Redis; no KV block leaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("multinode") / "observed.json"
    proc = subprocess.run([sys.executable, "-m", "tests.integration.multinode_scenario",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_same_as_reference(observed: dict[str, Any], phase: str) -> None:
    for j, (got, ref) in enumerate(zip(observed[phase], observed["reference"], strict=True)):
        assert got["error"] is None and got["finish_reason"] == "length", (phase, j, got)
        assert got["token_ids"] == ref["token_ids"], (phase, j)


def test_workers_are_spread_over_the_nodes_that_declare_the_resource(observed) -> None:
    start = observed["start"]
    assert start["num_workers"] == 2
    assert sorted(start["nodes"]) == sorted(observed["node_ids"]["workers"])
    assert start["controller_node"] == observed["node_ids"]["controller"]
    reference = observed["reference"]
    assert len(reference) == 16
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in reference)


def test_a_lost_worker_node_loses_no_stream_and_changes_no_token(observed) -> None:
    _assert_same_as_reference(observed, "worker_node_lost")


def test_a_node_that_joins_takes_the_lost_worker_and_new_requests(observed) -> None:
    joined = observed["joined"]
    assert joined["worker_node"] == joined["node_id"]
    assert joined["num_routed_after_join"] > 0
    for got, ref in zip(joined["streams"], observed["reference"], strict=True):
        assert got["error"] is None and got["token_ids"] == ref["token_ids"]


def test_a_lost_controller_node_moves_the_controller_and_resumes_every_stream(observed
                                                                             ) -> None:
    _assert_same_as_reference(observed, "controller_node_lost")
    after = observed["controller_after"]
    assert after["node"] == after["spare_node"] and after["pid_changed"]
    assert after["num_resumed"] >= 1
    assert all(observed["integrity_checked"])
