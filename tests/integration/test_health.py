"""Health tells the truth on a real Ray cluster: a controller whose worker actor cannot
get its resources answers `ping` at once, not ok, naming the missing resource."""

from __future__ import annotations

import pytest

from cluster.config import TokenflowConfig


@pytest.fixture(scope="module")
def starved_controller(cluster):
    import ray

    from controller.actor import get_or_create_controller

    # The session cluster has 4 CPUs: a worker asking for 64 waits forever.
    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 1, "device": "cpu"},
        cache={"num_kv_blocks": 64},
        cluster={"namespace": "tokenflow-starved", "worker_num_cpus": 64.0,
                 "controller_num_cpus": 0.1})
    controller = get_or_create_controller(config.controller_options())
    yield controller
    ray.kill(controller)


def test_ping_answers_while_a_worker_waits_for_resources(starved_controller):
    import ray

    first = ray.get(starved_controller.ping.remote(), timeout=30)
    assert first["ok"] is False and first["status"] == "starting"
    again = ray.get(starved_controller.ping.remote(), timeout=30)  # startup still running
    assert again["ok"] is False
    assert "wait for resources" in again["reason"] and "'CPU': 64.0" in again["reason"]
