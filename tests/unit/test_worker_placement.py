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
