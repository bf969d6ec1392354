"""`tokenflow workers list|add|drain`: the worker pool of a running cluster.

    tokenflow workers list [--json]
    tokenflow workers add [--wait] [--timeout S]
    tokenflow workers drain WORKER [--timeout S] [--no-wait]

Joins the Ray cluster (`--address`, default `auto`: this node's) and reaches its named
controller, as the batch runner does; neither the controller nor the ingress restarts.
`add` starts one more worker actor (Ray places it where a worker's resources are free, or
when a node that has them joins) and, with `--wait`, answers once it serves. `drain` stops
routing to a worker, lets its requests finish (past `--timeout`, default
`scaling.drain_timeout_s`, they move to the other workers with the same tokens), then
removes it and returns its resources to Ray; it answers with what happened. A refusal
(no such worker, the last serving one) is one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from cluster.config import TokenflowConfig


def add_parser(sub: Any) -> None:
    workers = sub.add_parser("workers", help="list, add or drain the workers of a running "
                             "cluster")
    workers.add_argument("--address", default="auto", help="Ray cluster (default: auto)")
    actions = workers.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every worker with its state and node")
    listing.add_argument("--json", action="store_true", help="one JSON document")
    add = actions.add_parser("add", help="start one more worker")
    add.add_argument("--wait", action="store_true", help="answer once it serves")
    add.add_argument("--timeout", type=float, default=600.0, help="most seconds --wait waits")
    drain = actions.add_parser("drain", help="drain a worker and remove it")
    drain.add_argument("worker", type=int, help="worker index (`tokenflow workers list`)")
    drain.add_argument("--timeout", type=float, help=(
        "seconds its requests may take to finish before they move (default: "
        "scaling.drain_timeout_s)"))
    drain.add_argument("--no-wait", action="store_true", help="answer once draining starts")


def connect(address: str, namespace: str) -> Any:
    """The running cluster's controller; None when the cluster has none."""
    # Before Ray is imported: keep "127.0.0.1" as this driver's address on a loopback cluster.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from controller.actor import CONTROLLER_NAME

    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level="WARNING",
                 log_to_driver=False)
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None


def _cause(err: Exception) -> Exception:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) else err


def run_workers(args: argparse.Namespace, cfg: TokenflowConfig) -> int:
    import ray

    namespace = cfg.cluster.namespace
    controller = connect(args.address, namespace)
    if controller is None:
        print(f"tokenflow workers: no running tokenflow controller in Ray namespace "
              f"{namespace!r}", file=sys.stderr)
        return 1
    try:
        if args.action == "list":
            rows = ray.get(controller.workers.remote())
            print(json.dumps(rows) if args.json else format_rows(rows))
            return 0
        if args.action == "add":
            answer = ray.get(controller.add_worker.remote(args.wait, args.timeout))
        else:
            answer = ray.get(controller.drain_worker.remote(args.worker, args.timeout,
                                                            not args.no_wait))
    except Exception as err:  # the controller refused (ValueError) or the wait failed
        cause = _cause(err)
        print(f"tokenflow workers {args.action}: {cause}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'worker':>6}  {'state':9} {'running':>7} {'waiting':>7}  {'node':16} name"]
    for row in rows:
        worker = "-" if row["worker"] is None else str(row["worker"])
        lines.append(f"{worker:>6}  {row['state']:9} {row['num_running']:>7} "
                     f"{row['num_waiting']:>7}  {(row['node'] or '-')[:16]:16} {row['name']}")
    return "\n".join(lines)
