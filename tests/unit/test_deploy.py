"""deploy/: the Serve config is valid for Serve and for TokenflowConfig, the KubeRay
RayService embeds exactly that config, and the cluster launcher config validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from cluster.config import TokenflowConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> Any:
    """The file's first (or only) YAML document."""
    return load_all(name)[0]


def load_all(name: str) -> list[Any]:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var["value"] for var in container.get("env", []) if "value" in var}


def test_serve_config_is_valid() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = load("serve.yaml")
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "cluster.ingress:build_app"
    settings = TokenflowConfig(**config["applications"][0]["args"])
    assert settings.cluster.detached_controller and Path(settings.worker.model).is_absolute()


def test_rayservice_embeds_the_serve_config() -> None:
    service = load("kuberay-rayservice.yaml")
    assert service["kind"] == "RayService"
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == load("serve.yaml")
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"


def test_cluster_launcher_config_validates() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("ray-cluster.yaml")
    validate_config(prepare_config(config))
    # Redis (request persistence) owns 6379 on the head; Ray's GCS must not take it.
    assert any("--port=6380" in cmd for cmd in config["head_start_ray_commands"])


def test_rayservice_defines_the_journal_redis_it_points_at() -> None:
    docs = load_all("kuberay-rayservice.yaml")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    cluster = docs[0]["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        url = _env(container)["TOKENFLOW_CLUSTER__REDIS_URL"]
        host = url.split("//")[1].split(":")[0]
        assert host in services, f"{url} names no Service of this file"
        selector = services[host]["spec"]["selector"]
        assert any(d["spec"]["template"]["metadata"]["labels"] == selector
                   for d in deployments.values())
        TokenflowConfig(cluster={"redis_url": url})


def test_cluster_launcher_points_every_node_at_the_heads_redis() -> None:
    config = load("ray-cluster.yaml")
    assert any("redis-server" in cmd for cmd in config["setup_commands"])
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = next(cmd for cmd in commands if "ray start" in cmd)
        assert "TOKENFLOW_CLUSTER__REDIS_URL=redis://" in start and ":6379/0" in start


def test_the_ingress_autoscales_and_the_worker_pool_fits_the_node_groups() -> None:
    """Serve scales the ingress deployment (the name the code gives it) by autoscaling_config;
    the controller's scaling bounds fit the GPU worker group's in both cluster files (one
    worker per GPU node), and the controller is pinned to the head, the only node that
    declares its resource (no scale-down removes it)."""
    from ray.serve.schema import ServeDeploySchema

    from cluster.ingress import TokenflowIngress

    config = load("serve.yaml")
    (app,) = ServeDeploySchema.model_validate(config).applications
    (deployment,) = app.deployments
    assert deployment.name == TokenflowIngress.name
    scaling = deployment.autoscaling_config
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"]
    settings = TokenflowConfig(**config["applications"][0]["args"])
    assert settings.scaling.enabled and settings.scaling.wait_for_nodes
    resource = settings.cluster.controller_resource
    assert resource is not None

    launcher = load("ray-cluster.yaml")
    nodes = launcher["available_node_types"]
    assert nodes[launcher["head_node_type"]]["resources"] == {resource: 1}
    gpu = nodes["gpu_worker"]
    assert gpu["min_workers"] <= settings.scaling.min_workers
    assert gpu["max_workers"] == settings.scaling.max_workers <= launcher["max_workers"]

    cluster = load("kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head_resources = json.loads(yaml.safe_load(cluster["headGroupSpec"]["rayStartParams"]
                                               ["resources"]))
    assert head_resources == {resource: 1}
    (group,) = cluster["workerGroupSpecs"]
    assert "resources" not in group["rayStartParams"]  # the controller never lands there
    assert group["minReplicas"] <= settings.scaling.min_workers
    assert group["maxReplicas"] == settings.scaling.max_workers
