"""Workers and the controller spread over several Ray nodes; nodes lost mid-stream.

A real multi-node Ray cluster on this machine (a head plus worker and controller nodes,
each its own raylet, loopback only), driven by `multinode_scenario.py` in a process of its
own (its docstring has the phases). What must hold: the workers land on different nodes,
not the controller's; losing a worker node mid-stream loses no stream and changes no token
(every greedy output equals the undisturbed run), the controller having moved that
worker's requests; a node that joins gets the lost worker back and requests again; losing
the controller's node does the same, the controller restarted on a spare node resuming
from Redis; losing Redis's node loses nothing while the controller lives, and when the
controller's node dies too (no journal to read), the edge sends every open request again
and each runs to the same tokens (docs/failures.md); no KV block leaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 175  # the whole scenario, start-up and shutdown included


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("multinode") / "observed.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.multinode_scenario", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    seen = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, (seen.get("phase"), proc.stderr[-4000:])
    assert seen["phase"] == "done"
    return seen


def _assert_same_as_reference(observed: dict[str, Any], streams: list[dict[str, Any]]) -> None:
    for j, (got, ref) in enumerate(zip(streams, observed["reference"], strict=True)):
        assert got["error"] is None and got["finish_reason"] == "length", (j, got)
        assert got["token_ids"] == ref["token_ids"], j


def test_workers_are_spread_over_the_nodes_that_declare_the_resource(observed) -> None:
    start = observed["start"]
    assert start["num_workers"] == 2
    assert sorted(start["nodes"]) == sorted(observed["node_ids"]["workers"])
    assert start["controller_node"] in observed["node_ids"]["controllers"]
    reference = observed["reference"]
    assert len(reference) == 16
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in reference)
    assert {r["worker"] for r in reference} == {0, 1}


def test_a_lost_worker_node_loses_no_stream_and_changes_no_token(observed) -> None:
    lost = observed["worker_node_lost"]
    _assert_same_as_reference(observed, lost["streams"])
    # The node died under running requests, and the controller moved them.
    assert lost["num_failures"] >= 1 and lost["num_requests_moved"] > 0
    assert any(s["worker"] == lost["lost_worker"] for s in lost["streams"])


def test_a_node_that_joins_takes_the_lost_worker_and_new_requests(observed) -> None:
    joined = observed["joined"]
    assert joined["worker_node"] == joined["node_id"]
    assert joined["num_routed_after_join"] > 0
    _assert_same_as_reference(observed, joined["streams"])


def test_a_lost_controller_node_moves_the_controller_which_resumes_from_redis(observed) -> None:
    lost = observed["controller_node_lost"]
    _assert_same_as_reference(observed, lost["streams"])
    assert lost["node"] in lost["spares"] and lost["node"] != lost["lost_node"]
    assert lost["pid_changed"] and lost["num_resumed"] > 0


def test_redis_lost_with_its_node_loses_nothing_while_the_controller_lives(observed) -> None:
    _assert_same_as_reference(observed, observed["redis_lost"])
    assert observed["journal_while_redis_lost"]["num_pauses"] >= 1


def test_the_controller_node_lost_while_redis_is_lost_runs_open_streams_again(
    observed,
) -> None:
    """The restarted controller could read no journal (it resumed nothing): the edge sent
    every open request again, and each ran to the undisturbed run's tokens."""
    lost = observed["controller_and_redis_lost"]
    assert lost["pid_changed"] and lost["num_resumed"] == 0
    assert observed["journal_error"] is not None
    for got, ref in zip(lost["streams"], observed["reference"], strict=True):
        assert got["error"] is None, got["error"]
        assert got["token_ids"] == ref["token_ids"]
    # Once Redis is back, empty, the restarted controller serves as before.
    _assert_same_as_reference(observed, observed["after_redis_back"])


def test_no_block_leaks_after_the_node_losses(observed) -> None:
    assert observed["integrity_checked"] and all(observed["integrity_checked"])
