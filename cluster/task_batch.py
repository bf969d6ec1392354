"""A batch job's engine in one Ray task, when the job would start a controller of its own
for a single worker (`batch.engine_in_task`).

A `ray job submit -- python -m cluster.batch` job on a cluster with no tokenflow controller
used to start one, a worker actor beside it, and stream every request through both from
its driver: per step a plan and a result crossed Ray, and the controller, the driver and
the worker shared the node's cores (on 2 cores the job ran at 0.77x the same engine in one
process). With one worker nothing of that is needed: the job runs `run_local` (the
in-process engine, the controller's scheduler as a library) in one task that holds the
worker's resources, on the driver's node, where the input and output paths are the ones
the job was given. The task reads the input and appends each answer as it finishes, so
when its process dies, Ray runs it again (`batch.task_max_retries`) and it resumes after
the answered lines, as a resubmitted job does.

Not used when a controller already runs in the namespace (its workers serve the job beside
online traffic), with more than one worker (the controller spreads the requests over
them), or when the driver's node lacks one worker's resources right now.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.batch_config import OWN_CONTROLLER_SECTIONS
from cluster.config import TokenflowConfig

logger = logging.getLogger(__name__)


def task_resources(config: TokenflowConfig) -> dict[str, Any]:
    """What the engine's task holds: one worker actor's resources (`worker_resources`)."""
    import ray

    from controller.startup import worker_resources

    opts = config.controller_options()
    use_gpu = opts.worker.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    return worker_resources(opts, use_gpu)


def _fits(need: dict[str, Any], free: dict[str, float]) -> bool:
    wanted = {"CPU": need.get("num_cpus", 0), "GPU": need.get("num_gpus", 0),
              **need.get("resources", {})}
    return all(free.get(name, 0.0) >= amount for name, amount in wanted.items() if amount > 0)


def should_run_in_task(config: TokenflowConfig, has_controller: bool) -> bool:
    """Whether this job runs its engine in one task (see the module's docstring)."""
    import ray
    from ray._private.state import available_resources_per_node  # a DeveloperAPI

    if not config.batch.engine_in_task or has_controller or config.worker.num_workers != 1:
        return False
    node = ray.get_runtime_context().get_node_id()
    free = available_resources_per_node().get(node, {})
    if not _fits(task_resources(config), free):
        logger.warning("the driver's node has not one worker's resources free: the job "
                       "starts a controller and streams its requests through it")
        return False
    return True


def _engine_task(inp: str, output: str, config: TokenflowConfig,
                 progress: bool) -> tuple[dict[str, int], int]:
    """The task's body: `python -m cluster.batch --local` on the given locations."""
    from cluster.batch_io import iter_input_lines, open_output, prepare_resume
    from cluster.local_batch import run_local

    done_ids, num_retried = prepare_resume(output)
    with open_output(output) as out:
        counts = run_local(iter_input_lines(inp), out, config, done_ids, progress=progress,
                           bind_threads=True)
    return counts, num_retried


def run_in_task(inp: str, output: str, config: TokenflowConfig,
                progress: bool = True) -> tuple[dict[str, int], int]:
    """Run the job's engine in one task on this driver's node; (counts, retried lines)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The worker's batch profile (every core of its node), as a controller's worker gets.
    engine_config = config.with_batch_profile(OWN_CONTROLLER_SECTIONS)
    node = ray.get_runtime_context().get_node_id()
    task = ray.remote(_engine_task).options(
        **task_resources(config), max_retries=config.batch.task_max_retries,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    logger.warning("batch: the engine runs in one task on this node (no controller running, "
                   "one worker)")
    return ray.get(task.remote(inp, output, engine_config, progress))
