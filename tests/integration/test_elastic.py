"""The elastic pool on a real multi-node Ray cluster (`elastic_scenario.py`, in a process of
its own): `tokenflow workers add` with no free resource leaves the worker loading until a
node with the resource joins, where it lands and takes new requests; `tokenflow workers
drain` mid-stream lets the drained worker's requests finish, removes it and frees its node's
resource; a drain with no time to finish moves them. Every greedy output equals the
undisturbed run's; no stream is lost; no KV block leaks."""

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
    out = tmp_path_factory.mktemp("elastic") / "observed.json"
    proc = subprocess.run([sys.executable, "-m", "tests.integration.elastic_scenario",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_same_as_reference(streams: list[dict[str, Any]], reference: list[Any]) -> None:
    assert len(streams) == len(reference) == 16
    for j, (got, ref) in enumerate(zip(streams, reference, strict=True)):
        assert got["error"] is None and got["finish_reason"] == "length", (j, got)
        assert got["token_ids"] == ref["token_ids"], j


def test_an_added_worker_waits_for_a_node_then_lands_there_and_takes_requests(observed
                                                                               ) -> None:
    assert observed["start"]["nodes"] == [observed["start"]["node_a"]]
    added = observed["added"]
    assert not added["could_place_before"]  # node A's one unit is taken
    assert added["state"] == "loading" and added["states_before_join"] == ["serving",
                                                                           "loading"]
    assert added["pool_states_before_join"] == {"loading": 1, "serving": 1, "draining": 0}
    assert added["worker"] == 1 and added["node"] == added["node_b"]
    assert added["num_routed_new"] > 0
    _assert_same_as_reference(added["streams"], observed["reference"])


def test_a_drained_worker_finishes_its_requests_and_frees_its_node(observed) -> None:
    drained = observed["drained"]
    report = drained["report"]
    assert report["worker"] == 1 and report["finished"] and report["num_moved"] == 0
    assert report["num_unfinished_at_drain"] > 0  # it had requests to finish
    _assert_same_as_reference(drained["streams"], observed["reference"])
    assert drained["states"] == {"0": "serving", "1": "removed"}
    assert drained["free_on_b"] >= 1  # its resource went back to Ray
    assert drained["health"]["ok"] and drained["health"]["num_workers_up"] == 1


def test_a_drain_past_its_timeout_moves_requests_with_the_same_tokens(observed) -> None:
    moved = observed["moved"]
    assert moved["added"]["worker"] == 2
    report = moved["report"]
    assert not report["finished"] and report["num_moved"] > 0 and report["moved_to"] == [0]
    _assert_same_as_reference(moved["streams"], observed["reference"])
    code, last_line = moved["refusal"]
    assert code == 1 and "worker 0 is the last serving worker" in last_line[0]
    assert all(observed["integrity_checked"])
    assert observed["metrics"]["pool_states"] == {"loading": 0, "serving": 1, "draining": 0}
    events = {(d, r): n for d, r, n in observed["metrics"]["scale_events"]}
    assert events[("up", "operator")] == 2 and events[("down", "operator")] == 2


def test_load_driven_scaling_shrinks_when_idle_and_grows_under_a_queue(observed) -> None:
    scaling = observed["scaling"]
    assert scaling["num_workers_at_start"] == 2  # one per free unit
    events = {(d, r): n for d, r, n in scaling["events"]}
    assert events[("down", "idle")] >= 1 and events[("up", "queue")] >= 1
    assert "removed" in scaling["states"] and "serving" in scaling["states"]
    reference = observed["reference"]
    assert scaling["num_waves"] >= 1  # of every prompt twice, until the pool grew
    for got, ref in zip(scaling["streams"], (reference + reference) * scaling["num_waves"],
                        strict=True):
        assert got["error"] is None and got["token_ids"] == ref["token_ids"]


def test_the_scenario_stays_bounded(observed) -> None:
    assert observed["elapsed_s"] < 180
