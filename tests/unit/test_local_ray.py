"""`make serve`'s `ray.init` of its local cluster (cluster/local_ray.py): Ray's own wait for
the new node is preceded by a poll of the GCS, restored after, and any failure of the poll
leaves the wait to Ray. The fakes stand in for Ray's private module and GCS; one test starts a
real local Ray."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest

import cluster.local_ray as local_ray


class FakeServices:
    """Ray's `services` module as `ray.init` uses it: `get_node` answers once asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def get_node(self, gcs_address: str, node_id: str) -> dict[str, str]:
        self.calls.append((gcs_address, node_id))
        return {"node_id": node_id}


class FakeGcs:
    """A node table whose node registers after `num_misses` looks; or one that raises."""

    def __init__(self, num_misses: int, error: Exception | None = None) -> None:
        self.num_misses, self.error = num_misses, error
        self.clients: list[str] = []  # the GCS addresses a client was made for
        self.looks: list[str] = []

    def table(self, gcs_address: str) -> Callable[[str], bool]:
        self.clients.append(gcs_address)
        return self.is_alive

    def is_alive(self, node_id: str) -> bool:
        self.looks.append(node_id)
        if self.error is not None:
            raise self.error
        return len(self.looks) > self.num_misses


def test_rays_wait_runs_once_the_poll_saw_the_node_and_is_restored_after() -> None:
    services, gcs = FakeServices(), FakeGcs(num_misses=2)
    original = services.get_node
    with local_ray.node_wait_polled(services, gcs.table):
        assert services.get_node != original
        assert services.get_node("127.0.0.1:1", "ab") == {"node_id": "ab"}
        assert gcs.clients == ["127.0.0.1:1"]  # one client for every look
        assert gcs.looks == ["ab"] * 3  # two misses, then alive
        assert services.calls == [("127.0.0.1:1", "ab")]
    assert services.get_node == original


def test_a_failing_poll_leaves_the_wait_to_ray() -> None:
    services, gcs = FakeServices(), FakeGcs(num_misses=0, error=AttributeError("other Ray"))
    with local_ray.node_wait_polled(services, gcs.table):
        assert services.get_node("a", "b") == {"node_id": "b"}
    assert gcs.looks == ["b"] and services.calls == [("a", "b")]


def test_the_poll_gives_up_at_its_limit() -> None:
    gcs = FakeGcs(num_misses=10**9)
    assert not local_ray.wait_until_alive("a", "b", gcs.table, poll_s=0.0, wait_s=0.0)
    assert gcs.looks == []


def test_an_error_inside_the_block_still_restores_rays_call() -> None:
    services = FakeServices()
    original = services.get_node
    with pytest.raises(RuntimeError), local_ray.node_wait_polled(services, FakeGcs(0).table):
        raise RuntimeError("ray.init failed")
    assert services.get_node == original


def test_a_services_module_without_the_call_is_left_as_is() -> None:
    services = SimpleNamespace()
    with local_ray.node_wait_polled(services, FakeGcs(0).table):
        assert not hasattr(services, "get_node")


# Run in a process of its own: other tests of this session may hold a Ray of theirs.
REAL_RAY = """
import ray
import cluster.local_ray as local_ray
answers = []
node_table = local_ray.node_table
def spy(gcs_address):
    is_alive = node_table(gcs_address)
    def look(node_id):
        answers.append(is_alive(node_id))
        return answers[-1]
    return look
local_ray.node_table = spy
local_ray.init_local(num_cpus=1, _node_ip_address="127.0.0.1", include_dashboard=False)
print("answers", answers[-3:], "cpus", ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


def test_a_real_local_ray_is_seen_alive_by_the_poll() -> None:
    # This Ray's private client must answer (else every start falls back to Ray's wait).
    out = subprocess.run([sys.executable, "-c", REAL_RAY], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("answers")]
    assert line.endswith("True] cpus 1.0"), line


def test_make_serves_module_imports_no_ray_before_its_main_runs() -> None:
    # cluster/serve.py sets environment that Ray reads on its first import (the node address
    # stays loopback) before importing it; a module-level `import ray` here broke that.
    code = "import sys, cluster.serve, cluster.local_ray; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
