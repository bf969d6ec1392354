"""`python -m cluster.serve --model M --port P` (what `make serve` runs).

Starts a local Ray on 127.0.0.1, the controller (which starts one worker per GPU, or
`TOKENFLOW_WORKER__NUM_WORKERS` CPU workers), and the Serve ingress on 127.0.0.1:PORT; prints the
URL and serves until Ctrl-C. The ingress replica owns PORT itself (Serve's direct ingress,
`cluster.direct_ingress`): streamed tokens skip the hop through Serve's proxy. The
controller is created here, before the Serve app, so this process owns it (it lives
exactly as long as the server) and a broken model fails at once instead of on the first
request. It then watches the service: restarts of workers and of
the controller are pauses, but when the service has not been healthy for
`cluster.give_up_after_s` (or the controller is gone for good) it exits non-zero, so that a
supervisor (systemd, Kubernetes) restarts it. SIGTERM and Ctrl-C shut Serve and Ray down
and exit 0 (under `make serve`, make itself then reports the signal: 143; a supervisor runs
this module directly). Start-up prints the step budget in use and why (`describe_budget`).

`--ray-address HOST:PORT` joins a running Ray head instead of starting a local Ray (a batch
job submitted to that head then finds this server's controller); on the way out the app is
deleted and the controller removes its workers, since the head outlives this process.

Loopback by default: HTTP on 127.0.0.1 (`--host` to change it; 0.0.0.0 without API keys
warns), and Ray's node address, agents and metrics export on 127.0.0.1. Ray's own gRPC
servers (GCS, raylet, every worker process's core worker) bind all interfaces whatever the
node address (hard-coded in Ray); its token authentication guards them, and a firewall should
close them on a shared host. API keys: `--api-key KEY[:TENANT[:MIN:MAX]]` (repeatable) or
TOKENFLOW_API_KEYS; they reach the ingress through the environment, never its arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from cluster.config import API_KEYS_ENV, TokenflowConfig, api_keys_from_env, nest
from cluster.local_ray import init_local

# How often `make serve` asks the service whether it is healthy.
_WATCH_INTERVAL_S = 2.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cluster.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder or builtin preset (builtin:tiny)")
    ap.add_argument("--port", type=int, help="HTTP port (default 8000)")
    ap.add_argument("--host", help="HTTP bind address (default 127.0.0.1: this machine only)")
    ap.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT[:MIN:MAX]]",
                    help="require this API key (repeatable; added to TOKENFLOW_API_KEYS); "
                         "TENANT and the priority range MIN..MAX are the key's")
    ap.add_argument("--num-workers", type=int, help="CPU worker actors (no GPU present)")
    ap.add_argument("--served-model-name", help="name clients pass as `model`")
    ap.add_argument("--ray-address", help=(
        "join this running Ray cluster (HOST:PORT of a `ray start --head`) instead of "
        "starting a local one; a batch job submitted to that head then uses this server's "
        "controller"))
    ap.add_argument("--no-calibrate", action="store_true", help=(
        "fixed budgets: no budget table loaded or measured at start (calibration.auto)"))
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TokenflowConfig:
    return TokenflowConfig(**nest({
        "worker.model": args.model, "worker.num_workers": args.num_workers,
        "worker.served_model_name": args.served_model_name,
        "calibration.auto": False if args.no_calibrate else None,
        "cluster.port": args.port, "cluster.host": args.host}))


def with_local_threads(config: TokenflowConfig, has_gpu: bool) -> TokenflowConfig:
    """On the local cluster `make serve` starts, CPU workers whose thread count was not set
    share the machine's cores (2 workers on 8 cores: 4 threads each) instead of the one
    thread Ray's fractional CPU reservation gives an actor. Measured in the peer scene on 2
    cores (docs/peer.md): the worker on both cores halved the users' step
    during a long prefill and its time to first token; the controller and the ingress use
    little CPU, and the worker's idle threads sleep (workers/__init__.py)."""
    worker = config.worker
    if worker.num_threads is not None or (has_gpu and worker.device != "cpu"):
        return config
    cores = len(os.sched_getaffinity(0))
    num_threads = max(1, cores // worker.num_workers)
    return config.model_copy(update={"worker": dataclasses.replace(worker,
                                                                    num_threads=num_threads)})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def export_api_keys(keys: list[str]) -> int:
    """Add `--api-key` values to TOKENFLOW_API_KEYS (Ray's processes inherit this
    environment, so the ingress replicas read them there); the number of keys in all.
    ValueError on a malformed key."""
    joined = ",".join(filter(None, [os.environ.get(API_KEYS_ENV, ""), *keys]))
    num_keys = len(api_keys_from_env({API_KEYS_ENV: joined}))
    if joined:
        os.environ[API_KEYS_ENV] = joined
    return num_keys


def wants_direct_ingress(config: TokenflowConfig, joins_cluster: bool) -> bool:
    """Whether the ingress replica serves cluster.port itself (`cluster.direct_ingress`;
    None: where this process starts Ray and one replica can own the port)."""
    cluster = config.cluster
    if cluster.direct_ingress is None:
        return not joins_cluster and cluster.ingress_num_replicas == 1
    return cluster.direct_ingress


def enable_direct_ingress(host: str, port: int) -> int:
    """Set up Serve's direct ingress before Ray starts (its processes inherit this
    environment): the replica's HTTP server gets exactly `port`, and neither drains for
    30 s nor leaves the port unused for 150 s after a crash, waits Serve keeps for a load
    balancer (none is in front). Returns a free port for
    Serve's proxy, which still starts on the head node. Raises OSError when `port` is
    taken: the replica would fail to bind it over and over. Connections of a server that
    just stopped, left in TIME_WAIT, do not count: the replica's server binds with
    SO_REUSEADDR, and so does the probe."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    with socket.socket() as probe:
        probe.bind((host, 0))
        proxy_port = int(probe.getsockname()[1])
    os.environ.update({
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        # A replica restarted after a crash must rebind the port at once, not after the
        # quarantine Serve keeps for a load balancer's stale routes.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    })
    return proxy_port


def ray_num_cpus(config: TokenflowConfig) -> int:
    """Enough logical CPUs for every actor's fractional reservation, at least the cores."""
    cluster = config.cluster
    need = (config.worker.num_workers * cluster.worker_num_cpus + cluster.controller_num_cpus
            + cluster.ingress_num_replicas * cluster.ingress_num_cpus)
    return max(os.cpu_count() or 1, math.ceil(need))


def describe_budget(budget: dict[str, Any], config: TokenflowConfig | None = None) -> str:
    """Where the step budget came from and why, in one line (`model_info()["budget"]`;
    `config`: the one the controller was started with, which says what was explicit)."""
    tokens, source = budget["max_num_batched_tokens"], budget["source"]
    if config is not None and config.budget_is_explicit:
        line = (f"step budget {tokens} tokens: set explicitly "
                f"(scheduler.max_num_batched_tokens), so no automatic calibration")
        if source == "file":
            line += (f"; the budget file {config.calibration.budget_file} sizes chunks "
                     f"under the ITL SLO, its recommended budget is not used")
        return line
    if source == "measured":
        device = budget["device_name"]
        if "thread" not in device:  # a CPU's name says its threads already
            device += f", {budget['threads']} threads"
        line = (f"step budget {tokens} tokens: measured on worker 0 ({device}) in "
                f"{budget['measure_s']:.1f} s")
        if not budget.get("is_cached", True):
            return (f"{line}, while other processes used {budget['contention_cores']:.2f} "
                    f"of its cores: not cached, the next start measures again")
        return f"{line}, cached in {budget['path']}"
    if source == "cache":
        return f"step budget {tokens} tokens: worker 0's cached table {budget['path']}"
    if source == "file":
        where = f" {config.calibration.budget_file}" if config is not None else ""
        return (f"step budget {tokens} tokens: the budget file{where} "
                f"(calibration.budget_file), its recommendation for the ITL SLO")
    why = f" (the budget table failed: {budget['error']})" if "error" in budget else ""
    return f"step budget {tokens} tokens: fixed (scheduler.max_num_batched_tokens){why}"


class _DropMessage(logging.Filter):
    """Drops one logger's records that start with `prefix` (start-up noise we caused)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class Unrecoverable(RuntimeError):
    """The controller is gone for good (Ray will not restart it)."""


def watch_health(ping: Callable[[], bool], give_up_after_s: float, interval_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], object] = time.sleep) -> str:
    """Ping the service every `interval_s`; return why it cannot recover once it has not
    been healthy for `give_up_after_s`, or at once when `ping` raises `Unrecoverable`.
    A restart in progress (a worker, the controller) is a pause, not a failure."""
    unhealthy_since: float | None = None
    while True:
        try:
            ok = ping()
        except Unrecoverable as err:
            return str(err)
        now = clock()
        if ok:
            unhealthy_since = None
        elif unhealthy_since is None:
            unhealthy_since = now
        elif now - unhealthy_since >= give_up_after_s:
            return f"not healthy for {now - unhealthy_since:.0f}s"
        wait(interval_s)


def _ping(controller: Any, timeout_s: float) -> bool:
    import ray
    from ray.exceptions import ActorDiedError

    try:
        return bool(ray.get(controller.ping.remote(), timeout=timeout_s)["ok"])
    except ActorDiedError as err:
        raise Unrecoverable(f"the controller died and will not be restarted: {err}") from None
    except Exception:  # restarting, or too slow to answer: unhealthy for now
        return False


def _import_serve_stack() -> None:
    # A failure here is the main thread's to report: it imports them again after the join.
    with contextlib.suppress(Exception):
        import ray.serve  # noqa: F401

        import cluster.ingress  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    # Read when Ray is first imported: with it off, Ray keeps "127.0.0.1" as the node address
    # instead of swapping in the machine's, so its agents and metrics export bind loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from controller.actor import get_or_create_controller

    args = parse_args(argv)
    config = config_from_args(args)
    try:
        num_keys = export_api_keys(args.api_key) + len(config.edge.api_keys)
        options = config.controller_options()  # a budget file for another model fails here
    except ValueError as err:
        print(f"tokenflow: {err}", file=sys.stderr)
        return 2
    if not is_loopback(config.cluster.host) and num_keys == 0:
        print(f"WARNING: serving on {config.cluster.host} without API keys: anyone who can "
              f"reach this port can use the model; set --api-key or {API_KEYS_ENV}",
              file=sys.stderr, flush=True)
    proxy_port = config.cluster.port
    if wants_direct_ingress(config, bool(args.ray_address)):
        if args.ray_address:
            print("tokenflow: cluster.direct_ingress needs the local Ray this command starts "
                  "(the processes of a running cluster do not see its settings)",
                  file=sys.stderr)
            return 2
        try:
            proxy_port = enable_direct_ingress(config.cluster.host, config.cluster.port)
        except OSError as err:
            print(f"tokenflow: cannot serve on {config.cluster.host}:{config.cluster.port}: "
                  f"{err}", file=sys.stderr)
            return 2
    # Serve and the ingress's web stack are seconds of imports on a small machine: imported
    # while ray.init waits for Ray's processes to come up (the imports below find them).
    # Warm `make serve` on a 2-core Zen 4, 4 interleaved starts each: 8.7 s against 9.5.
    preload = threading.Thread(target=_import_serve_stack, name="import-serve", daemon=True)
    preload.start()
    if args.ray_address:  # a shared cluster: its resources and addresses are its own
        ray.init(address=args.ray_address, namespace=config.cluster.namespace)
    else:
        # address="local": never join (or be confused by) another cluster; the default
        # Redis port 6379 may be taken on this machine, ray.init picks free ports itself.
        init_local(num_cpus=ray_num_cpus(config), _node_ip_address="127.0.0.1",
                   include_dashboard=False, namespace=config.cluster.namespace)
        config = with_local_threads(config, ray.cluster_resources().get("GPU", 0) >= 1)
        options = config.controller_options()
    controller = None
    # Explicit handlers, installed after ray.init (whose own SIGTERM handler would abort
    # the process): a shell starts background jobs with SIGINT ignored, and SIGTERM
    # (docker stop, systemd) should shut Serve and Ray down as cleanly as Ctrl-C.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        controller = get_or_create_controller(options)
        if config.auto_budget() is not None:  # the controller logs its progress every 10 s
            print("starting: worker 0 loads its step budget table from the cache or, on a "
                  "first start, measures it (a short run)", flush=True)
        info_ref = controller.model_info.remote()
        preload.join()
        from ray import serve

        from cluster.ingress import build_app

        # Serve's proxy and the ingress start while the workers load: the two are the
        # longest parts of a start and independent (until the controller answers, the
        # ingress says 503 with Retry-After and /health says why).
        # With direct ingress the replica serves cluster.port and the proxy a spare port.
        serve.start(http_options={"host": config.cluster.host, "port": proxy_port})
        # serve.run finds the Serve instance started just above and says so at INFO, which
        # on a fresh start reads as if another server were running.
        logging.getLogger("ray.serve").addFilter(_DropMessage("Connecting to existing Serve"))
        serve.run(build_app(config.model_dump()), name="tokenflow", route_prefix="/")
        info = ray.get(info_ref)
        url = f"http://{config.cluster.host}:{config.cluster.port}"
        print(f"tokenflow serving {config.worker.model_name} with {info['num_workers']} worker(s) "
              f"on {', '.join(info['devices'])}", flush=True)
        print(describe_budget(info["budget"], config), flush=True)
        print(f"OpenAI API at {url}/v1  (health: {url}/health)  Ctrl-C stops", flush=True)
        cluster = config.cluster
        reason = watch_health(lambda: _ping(controller, cluster.ready_wait_s),
                              cluster.give_up_after_s, _WATCH_INTERVAL_S)
        print(f"tokenflow cannot recover ({reason}); exiting so a supervisor restarts it",
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
        return 0
    finally:
        # The app is deleted (its replicas drain) and Ray stops with everything else: the
        # local cluster is this process's. Not serve.shutdown(): it kills Serve's
        # controller under its own graceful_shutdown call, which Ray logs as a failed task.
        if "ray.serve" in sys.modules:  # else Serve never started
            with contextlib.suppress(Exception):
                sys.modules["ray.serve"].delete("tokenflow")
        if args.ray_address and controller is not None:
            # A joined cluster outlives this process: its detached workers must not.
            with contextlib.suppress(Exception):
                ray.get(controller.shutdown.remote(), timeout=60)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
