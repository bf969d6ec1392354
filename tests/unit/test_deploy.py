"""deploy/: the Serve config is valid for Serve and for TokenflowConfig, the KubeRay
RayService embeds exactly that config, and the cluster launcher config validates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cluster.config import TokenflowConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


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
