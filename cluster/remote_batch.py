"""Batch inference on a running tokenflow Ray cluster: the remote twin of `batch.run_local`.

    ray job submit --address http://HEAD:8265 -- python -m cluster.batch -i IN -o OUT
    python -m cluster.batch -i IN -o OUT          # on a node of the cluster

Connects with `ray.init(address="auto")` to the cluster and its named controller, then
streams every request of the file through the same client the HTTP ingress uses (`submit`
per request, one `subscribe` stream for all of them), with at most `batch.max_in_flight`
requests outstanding (the controller's queue stays bounded for online traffic). Output
lines are written and flushed as requests finish, so an interrupted run resumes from OUT.
A full queue (429 over HTTP) is retried after `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from cluster import protocol as p
from cluster.batch_config import OWN_CONTROLLER_SECTIONS
from cluster.batch_io import (
    Progress,
    count_answer,
    count_error,
    error_line,
    new_counts,
    prepare_line,
    take_lines,
    write_line,
)
from cluster.config import TokenflowConfig
from cluster.frontend import Frontend, Prepared
from controller.routing import NoWorkerUpError, QueueFullError

logger = logging.getLogger(__name__)


def find_controller(config: TokenflowConfig) -> Any:
    """The running cluster's controller in the configured namespace, or None (connects to
    the cluster first)."""
    import ray

    from controller.actor import CONTROLLER_NAME

    if not ray.is_initialized():
        ray.init(address="auto", namespace=config.cluster.namespace)
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=config.cluster.namespace)
    except ValueError:
        return None


def connect_controller(config: TokenflowConfig) -> Any:
    """The running cluster's controller; one is created (owned by this job, so it lives
    only as long as the job) when the cluster has none yet."""
    from controller.actor import CONTROLLER_NAME, get_or_create_controller

    controller = find_controller(config)
    if controller is not None:
        return controller
    logger.warning("no %s in namespace %s: starting one for this job", CONTROLLER_NAME,
                   config.cluster.namespace)
    return get_or_create_controller(own_controller_config(config).controller_options())


def own_controller_config(config: TokenflowConfig) -> TokenflowConfig:
    """The configuration of a controller this job starts for itself: the batch profile's
    worker overrides (its CPU worker's threads) on each setting not given (a serving
    cluster's controller keeps its own)."""
    return config.with_batch_profile(OWN_CONTROLLER_SECTIONS)


def run_remote(lines: Iterable[str], out: TextIO, config: TokenflowConfig,
               done_ids: set[str], progress: bool = True,
               controller: Any = None) -> dict[str, int]:
    from cluster.controller_client import RayControllerClient
    from cluster.ingress import OpenAIServer

    started = time.perf_counter()
    if controller is None:
        controller = connect_controller(config)
    server = OpenAIServer(config, RayControllerClient(controller, config.edge))
    try:
        return asyncio.run(_run(server, iter(lines), out, done_ids, progress, started))
    finally:
        server.executor.shutdown(wait=False, cancel_futures=True)


async def _run(server: Any, lines: Iterator[str], out: TextIO, done_ids: set[str],
               progress: bool, started: float) -> dict[str, int]:
    """The event loop here also dispatches the controller's delta stream to every request
    in flight: reading the input, preparing requests and writing answers run on threads."""
    # A controller the job just started is loading its model: wait longer than the
    # online edge would before giving up.
    await asyncio.wait_for(server.client.model_info(), server.config.batch.start_timeout_s)
    frontend: Frontend = await server.frontend()
    counts = new_counts()
    counts["startup_ms"] = round(1e3 * (time.perf_counter() - started))
    max_in_flight = server.config.batch.max_in_flight
    slots = asyncio.Semaphore(max_in_flight)
    bar = Progress(progress)
    tasks: set[asyncio.Task[None]] = set()
    # `out` is written on one thread of its own: a line is a small append to a local file,
    # but a shard on an object store uploads a part, or the whole shard and the manifest, on
    # a flush. One thread keeps the lines whole and in the order the loop hands them over;
    # `counts` and the bar are touched on the loop only.
    writer = ThreadPoolExecutor(1, thread_name_prefix="tokenflow-batch-out")
    loop = asyncio.get_running_loop()
    first_request_at: float | None = None

    async def write(record: dict[str, Any]) -> None:
        await loop.run_in_executor(writer, write_line, out, record)

    async def fail(custom_id: str | None, err: p.ProtocolError, line: str | None = None
                   ) -> None:
        await write(error_line(custom_id, err, line))
        count_error(err, counts)

    async def run_one(custom_id: str, prepared: Prepared) -> None:
        try:
            body = await _generate(server, frontend, prepared)
        except p.ProtocolError as err:
            await fail(custom_id, err)
            bar.finished(0)
        except Exception as err:  # e.g. the controller restarting: retryable on resume
            logger.warning("batch line %s failed: %s: %s", custom_id, type(err).__name__, err)
            await fail(custom_id, p.ProtocolError(503, f"{type(err).__name__}: {err}"))
            bar.finished(0)
        else:
            await write(p.batch_output_line(custom_id, body, None, 200))
            count_answer(body, counts, bar)
        finally:
            slots.release()

    try:
        while True:
            # As many lines as slots are free (one ahead while all are busy): lines read
            # and not answered stay under max_in_flight + 1, however long the input.
            max_lines = max(1, max_in_flight - len(tasks))
            # Reading blocks (a file, Ray Data's blocks) and preparing is CPU-bound
            # (parsing, templating, tokenizing): both run on the server's text pool.
            taken, num_skipped = await server.in_pool(take_lines, lines, done_ids, max_lines)
            counts["skipped"] += num_skipped
            # Prepared in parallel, handled in input order: error lines keep their order.
            results = await asyncio.gather(*(server.in_pool(prepare_line, line, frontend)
                                             for line in taken))
            for line, (custom_id, result) in zip(taken, results, strict=True):
                if isinstance(result, p.ProtocolError):
                    await fail(custom_id, result, line)
                    continue
                assert custom_id is not None  # a line that parsed names its custom_id
                await slots.acquire()  # bounded in flight: the next read waits for capacity
                if first_request_at is None:
                    first_request_at = time.perf_counter()
                bar.add_total(1)
                task = asyncio.create_task(run_one(custom_id, result))
                tasks.add(task)  # finished tasks leave the set: memory stays bounded too
                task.add_done_callback(tasks.discard)
            if len(taken) < max_lines:  # the end of the input
                break
        await asyncio.gather(*tasks)
    finally:
        writer.shutdown(wait=True)  # every answer handed over is in `out`
    if first_request_at is not None:
        counts["generation_ms"] = round(1e3 * (time.perf_counter() - first_request_at))
    bar.close()
    return counts


async def _generate(server: Any, frontend: Frontend, prepared: Prepared) -> dict[str, Any]:
    """One request to its OpenAI response body; ProtocolError for a refused or failed one."""
    from cluster.choices import choices_body, collect_choices, submit_choices

    client = server.client
    request_id = p.new_chat_completion_id() if prepared.is_chat else p.new_completion_id()
    while True:
        try:  # every choice (`n`, `best_of`), or none: a refusal aborts those admitted
            choices = await submit_choices(client, prepared, request_id, "batch")
            break
        except (QueueFullError, NoWorkerUpError):  # 429 / 503: retry after the advised wait
            await asyncio.sleep(max(server.config.cluster.retry_after_s, 0.1))
        except ValueError as err:
            raise p.ProtocolError(400, str(err)) from None
    results, error = await collect_choices(frontend, prepared, choices, client.abort)
    if error is not None:
        raise p.ProtocolError(503, error)
    if len(results) == 1:
        return frontend.response(prepared, request_id, *results[0])
    return choices_body(frontend, prepared, request_id, results)
