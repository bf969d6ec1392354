"""How many worker actors start and what each one takes from Ray, per node layout."""

from __future__ import annotations

import pytest

from cluster.config import TokenflowConfig
from controller.startup import worker_pool_shape


def _options(**cluster: object):
    return TokenflowConfig(worker={"num_workers": 3}, cluster=cluster).controller_options()


def test_cpu_pool_without_a_worker_resource_is_num_workers() -> None:
    num, resources = worker_pool_shape(_options(), {"CPU": 8.0}, use_gpu=False)
    assert num == 3 and resources == {"num_gpus": 0, "num_cpus": 0.5}


def test_a_worker_resource_gives_one_worker_per_unit_in_the_cluster() -> None:
    opts = _options(worker_resource="tokenflow_worker")
    num, resources = worker_pool_shape(opts, {"CPU": 8.0, "tokenflow_worker": 4.0},
                                       use_gpu=False)
    assert num == 4 and resources["resources"] == {"tokenflow_worker": 1}


def test_a_worker_resource_no_node_declares_is_refused_by_name() -> None:
    opts = _options(worker_resource="tokenflow_worker")
    with pytest.raises(RuntimeError, match="tokenflow_worker"):
        worker_pool_shape(opts, {"CPU": 8.0}, use_gpu=False)


def test_gpus_win_one_worker_per_gpu() -> None:
    opts = _options(worker_resource="tokenflow_worker")
    num, resources = worker_pool_shape(opts, {"GPU": 2.0, "tokenflow_worker": 4.0},
                                       use_gpu=True)
    assert num == 2 and resources["num_gpus"] == 1 and "resources" not in resources



class _FakeRay:
    """The `ray` that spawn_worker sees: `ray.remote(cls).options(**o).remote(*args)`
    records each actor's class and options; `cluster_resources` is the node layout."""

    def __init__(self, resources: dict[str, float]) -> None:
        self.resources = resources
        self.created: list[tuple[type, dict[str, object]]] = []

    def cluster_resources(self) -> dict[str, float]:
        return self.resources

    def remote(self, cls: type) -> _FakeRay._ActorClass:
        return self._ActorClass(self, cls)

    class _ActorClass:
        def __init__(self, fake: _FakeRay, cls: type) -> None:
            self.fake, self.cls, self.opts = fake, cls, {}

        def options(self, **options: object) -> _FakeRay._ActorClass:
            self.opts = options
            return self

        def remote(self, *args: object) -> str:
            self.fake.created.append((self.cls, self.opts))
            return f"handle-{len(self.fake.created)}"


@pytest.mark.parametrize(("resources", "overlap", "expected"), [
    ({"CPU": 2.0}, None, 1),  # CPU: one call at a time, by default
    ({"CPU": 2.0, "GPU": 1.0}, None, 2),  # GPU: the next step's call beside the running one
    ({"CPU": 2.0}, True, 2),
    ({"CPU": 2.0, "GPU": 1.0}, False, 1),
])
def test_worker_actor_overlaps_calls_on_gpu_only_unless_configured(
        monkeypatch: pytest.MonkeyPatch, resources: dict[str, float], overlap: bool | None,
        expected: int) -> None:
    from controller import startup
    from workers.actor import WorkerActor
    from workers.step_gate import WORKER_MAX_CONCURRENCY

    fake = _FakeRay(resources)
    monkeypatch.setattr(startup, "ray", fake)
    opts = TokenflowConfig(cluster={"worker_overlap_calls": overlap}).controller_options()
    assert startup.spawn_worker(opts, 0) == "handle-1"
    [(cls, options)] = fake.created
    assert cls is WorkerActor and options["num_gpus"] == ("GPU" in resources)
    assert options["max_concurrency"] == (WORKER_MAX_CONCURRENCY if expected == 2 else 1)
