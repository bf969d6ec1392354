"""Every command block of README.md runs as written, so a recipe cannot rot.

Each block is named by a `<!-- block: NAME -->` line above it, and `HOW` below says how the
test handles each one: a block without an entry, or an entry without a block, fails the
test. Commands run with bounded time on `builtin:tiny` and on loopback, in a scratch folder
holding links to the checkout's `.venv`, `Makefile`, `examples/` and `dashboards/` (what
the commands write lands there, not in the checkout); `PYTHONPATH` names the checkout, so
its code is what runs. What changes: the port (`127.0.0.1:8000` becomes a free one),
`builtin:bench` becomes `builtin:tiny` with a 10 s calibration budget, and `make serve`
becomes the command `make -n serve` prints (a server, started, probed and stopped with
SIGTERM, after which it must exit 0, having logged none of `NOISE`); blocks that cannot run
here say why in `HOW`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- block: (?P<name>[\w-]+) -->\n(?:<!--[^\n]*-->\n)*"
                   r"```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
LINKS = (".venv", "Makefile", "pyproject.toml", "requirements-cpu.txt", "examples",
         "dashboards")
SERVER_START_S = 240  # a first start builds the preset and Ray; a loaded VM is slow
COMMAND_S = 300
NODE_START_S = 60  # a `ray start` until its node is up (head) or registered (worker node)
NODE_STOP_S = 16  # `ray stop`'s grace period: SIGTERM, then SIGKILL
# Log lines a healthy start, a few requests and a SIGTERM must not print.
NOISE = ("Connecting to existing Serve app", "graceful_shutdown failed", "budget model says",
         "Traceback")

HOW = {
    "start": "`make serve`: started as a server from `make -n serve`, probed, stopped; "
             "`make test`: not run (the suite this test is part of)",
    "curl": "run against the `config` server",
    "openai": "run with .venv/bin/python against the `config` server",
    "metrics": "run against the `config` server, after `curl` and `openai`",
    "prometheus": "run on a free port against the `config` server until its target is up "
                  "(skipped when prometheus is not installed: apt-get install prometheus)",
    "grafana": "not run: needs Docker and Grafana (no Grafana here); the provisioning it "
               "mounts is checked in tests/unit/test_dashboard.py",
    "nodes": "run line by line on loopback (127.0.0.2, .3), ports free: both `ray start` "
             "lines with `--block` (so that the test owns each node's processes and stops "
             "them by pid, as `ray stop` would but sparing other Ray instances), the server "
             "in the foreground; a worker listed on each node, a request answered, every "
             "connection on loopback",
    "batch-local": "run twice: four answers, then a resume that skips them",
    "batch-cluster": "run line by line by tests/integration/test_ray_job_batch.py "
                     "(its own Ray head on free ports)",
    "calibrate": "run: builtin:tiny for builtin:bench, a 10 s budget; --check prints its "
                 "report (its verdict depends on the machine's noise); the budget file "
                 "server started, its start-up line checked, stopped",
    "config": "`make serve` with this environment: started, says the budget is explicit",
    "api-keys": "not run: it serves every interface; API keys are tested in "
                "tests/unit/test_ingress.py and tests/integration/test_load_and_abort.py",
    "gpu": "`make bench-gpu` not run (needs a CUDA GPU); the CPU line run",
}


def blocks() -> dict[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = [(m["name"], m["body"]) for m in BLOCK.finditer(text)]
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"block names repeat: {names}"
    # Every fenced block is named (a block without a name would not be run).
    assert text.count("```") == 2 * len(found), "a README code block has no <!-- block: -->"
    return dict(found)


def test_every_block_is_handled() -> None:
    assert set(blocks()) == set(HOW)


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("readme")
    for name in LINKS:
        (folder / name).symlink_to(ROOT / name)
    return folder


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def rewrite(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(
        "builtin:bench", "builtin:tiny")


def run(line: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=environment(**extra),
                          capture_output=True, text=True, timeout=COMMAND_S)


def serve_argv(line: str, cwd: Path, port: int) -> tuple[dict[str, str], list[str]]:
    """`VAR=value ... make serve ARGS` -> (its environment, the command make would run)."""
    words = shlex.split(line.split("#")[0])
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:2] == ["make", "serve"], line
    recipe = subprocess.run(["make", "-s", "-n", *words[1:], f"PORT={port}"], cwd=cwd,
                            capture_output=True, text=True, timeout=60, check=True)
    (command,) = [x for x in recipe.stdout.splitlines() if "-m cluster.serve" in x]
    return env, shlex.split(command)


@contextmanager
def server(line: str, cwd: Path) -> Iterator[tuple[int, list[str]]]:
    """The README's `make serve` line running on a free port: (port, its output so far).
    Stopped with SIGTERM on the way out; it must exit 0."""
    port = free_port()
    env, argv = serve_argv(line, cwd, port)
    with serving(argv, cwd, environment(**env)) as (_, lines):
        yield port, lines


@contextmanager
def serving(argv: list[str], cwd: Path,
            env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`argv` (a `cluster.serve`) started and ready: (its process, its output so far).
    Stopped with SIGTERM on the way out; it must exit 0, having logged none of `NOISE`."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines: list[str] = []
    ready: queue.Queue[bool] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for out in proc.stdout:
            lines.append(out.rstrip("\n"))
            if "OpenAI API at" in out:
                ready.put(True)
        ready.put(False)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.get(timeout=SERVER_START_S), "\n".join(lines[-40:])
        yield proc, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise
    reader.join(timeout=30)
    assert code == 0, "\n".join(lines[-40:])  # SIGTERM is a clean stop
    noise = [x for x in lines if any(n in x for n in NOISE)]
    assert not noise, noise


def test_batch_local(scratch: Path) -> None:
    (line,) = blocks()["batch-local"].strip().splitlines()
    first = run(line, scratch)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(x) for x in (scratch / "results.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["chat", "hello", "ids", "stop"]
    assert all(r["response"]["status_code"] == 200 for r in rows)
    again = run(line, scratch)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((scratch / "results.jsonl.summary.json").read_text())
    assert summary["skipped"] == 4 and summary["completed"] == 0


def test_calibrate_check_and_serve_with_the_table(scratch: Path) -> None:
    calibrate, check, serve = blocks()["calibrate"].strip().splitlines()
    made = run(rewrite(calibrate, 0), scratch, TOKENFLOW_CALIBRATION__MAX_DURATION_S="10")
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.startswith("calibrate: estimated "), made.stdout
    assert "wrote budget.json" in made.stdout
    checked = run(check, scratch)
    assert checked.returncode in (0, 1), checked.stderr[-3000:]
    assert "prefill_time" in checked.stdout and "allowed" in checked.stdout
    with server(rewrite(serve, 0), scratch) as (_, lines):
        assert any(x.startswith("step budget ") and "the budget file budget.json" in x
                   for x in lines), "\n".join(lines)


def test_serve_and_ask(scratch: Path) -> None:
    readme = blocks()
    serve_line, _ = readme["start"].strip().splitlines()
    assert serve_line.startswith("make serve ")
    (config,) = readme["config"].strip().splitlines()
    with server(config, scratch) as (port, lines):
        assert any(x.startswith("step budget 4096 tokens: set explicitly") for x in lines), \
            "\n".join(lines)
        curl = run(rewrite(readme["curl"], port), scratch)
        assert curl.returncode == 0, curl.stderr
        answer = json.loads(curl.stdout)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        snippet = scratch / "first.py"
        snippet.write_text(rewrite(readme["openai"], port))
        said = run(f"{ROOT / '.venv/bin/python'} {snippet}", scratch)
        assert said.returncode == 0, said.stderr[-3000:]
        assert said.stdout.rstrip().endswith(("stop", "length"))
        metrics = run(rewrite(readme["metrics"], port), scratch)
        assert metrics.returncode == 0, metrics.stderr
        counts = {re.search(r'finished_reason="(\w+)"', x)[1]: float(x.split()[-1])
                  for x in metrics.stdout.splitlines()}
        assert sum(counts.values()) == 2 and counts["error"] == 0, metrics.stdout
        if shutil.which("prometheus"):
            prometheus_is_up(readme["prometheus"], scratch, port)


def prometheus_is_up(block: str, scratch: Path, port: int) -> None:
    config = scratch / "prometheus.yml"
    config.write_text(rewrite((ROOT / "dashboards/prometheus.yml").read_text(), port))
    prom_port = free_port()
    line = (block.strip().replace("dashboards/prometheus.yml", str(config))
            .replace("/tmp/tf-prom", str(scratch / "prom"))
            .replace("127.0.0.1:9090", f"127.0.0.1:{prom_port}"))
    proc = subprocess.Popen(shlex.split(line), cwd=scratch, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "prometheus never scraped the server"
            try:
                body = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/targets", timeout=5)
                targets = body.json()["data"]["activeTargets"]
                if targets and targets[0]["health"] == "up":
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)  # a poll interval
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# Joins the nodes' cluster and prints its live nodes once `argv[2]` of them are up.
LIVE_NODES = """
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while len(alive := [n for n in ray.nodes() if n["Alive"]]) < int(sys.argv[2]):
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"id": n["NodeID"], "ip": n["NodeManagerAddress"]} for n in alive]))
"""


def test_many_nodes(scratch: Path) -> None:
    """The `nodes` block: a head and a worker node on loopback addresses of this machine, a
    server with one worker on each; `tokenflow workers list` shows both nodes, a request
    is answered, and no process of the cluster has a socket off loopback."""
    lines = [x for x in blocks()["nodes"].splitlines() if x.strip()]
    ports = {name: str(free_port()) for name in (
        "RAY_PORT", "DASHBOARD_PORT", "CLIENT_PORT", "AGENT_PORT", "NODE_AGENT_PORT", "PORT")}
    env = environment(**ports)
    prelude = "\n".join(x for x in lines
                        if x.startswith(("export ", ".venv/bin/ray get-auth-token ")))
    head, node = [x for x in lines if x.startswith(".venv/bin/ray start ")]
    (serve,) = [x for x in lines if " -m cluster.serve " in x]
    (listing,) = [x for x in lines if x.startswith(".venv/bin/tokenflow workers ")]
    (curl,) = [x for x in lines if x.startswith("curl ")]
    assert serve.endswith(" &"), serve  # in the foreground here: the test stops it

    def bash(line: str) -> list[str]:
        # `exec` after the line's own assignments: SIGTERM reaches the command itself.
        words = re.fullmatch(r"((?:\w+=\S*\s+)*)(.*)", line)
        assert words is not None
        assign, rest = words.groups()
        return ["bash", "-c", f"{prelude}\n{assign}exec {rest}"]

    said = run(f"{prelude}\necho $HEAD_IP $NODE_IP $RAY_PORT", scratch, **ports)
    head_ip, node_ip, ray_port = said.stdout.split()
    assert ipaddress.ip_address(head_ip).is_loopback and ipaddress.ip_address(node_ip).is_loopback
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        # `--block`: each `ray start` stays the parent of its node's processes.
        nodes.append(subprocess.Popen(bash(f"{head} --block"), cwd=scratch, env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        wait_listening(head_ip, int(ray_port), nodes[0])
        nodes.append(subprocess.Popen(bash(f"{node} --block"), cwd=scratch, env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        found = run(f"{prelude}\n.venv/bin/python -c {shlex.quote(LIVE_NODES)} "
                    f"$HEAD_IP:$RAY_PORT 2 {NODE_START_S}", scratch, **ports)
        assert found.returncode == 0, found.stderr[-3000:]
        live = json.loads(found.stdout.strip().splitlines()[-1])
        assert sorted(n["ip"] for n in live) == sorted([head_ip, node_ip]), live
        with serving(bash(serve.removesuffix("&").strip()), scratch, env) as (proc, _):
            listed = run(f"{prelude}\n{listing}", scratch, **ports)
            assert listed.returncode == 0, listed.stderr[-3000:]
            asked = run(f"{prelude}\n{curl}", scratch, **ports)
            assert asked.returncode == 0, asked.stderr
            ends = endpoints([x.pid for x in [*nodes, proc]])
        rows = [x.split() for x in listed.stdout.splitlines()[1:]]
        # The node column: a prefix of a Ray node id (16 hex digits), one per worker.
        on = {row[4] for row in rows if row[1] == "serving"}
        assert len(rows) == 2 and len(on) == 2, listed.stdout
        assert all(any(n["id"].startswith(x) for n in live) for x in on), (on, live)
        assert json.loads(asked.stdout)["choices"][0]["finish_reason"] in ("stop", "length")
        # On loopback, or a listener on every interface (Ray's gRPC servers bind those).
        assert ends and not [who for who, ip in ends if not is_loopback_or_any(ip)], ends
    finally:
        for started in reversed(nodes):
            stop_node(started)


def wait_listening(host: str, port: int, proc: subprocess.Popen[bytes]) -> None:
    """Until `host:port` (a head's GCS) accepts connections; bounded."""
    deadline = time.monotonic() + NODE_START_S
    while True:
        assert proc.poll() is None, f"ray start exited with {proc.returncode}"
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {host}:{port}"
            time.sleep(0.2)  # a poll interval


def is_loopback_or_any(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def endpoints(pids: list[int]) -> list[tuple[str, str]]:
    """(who, IP) of each end of every TCP/UDP socket of these processes and their
    descendants."""
    seen: list[tuple[str, str]] = []
    for pid in pids:
        try:
            top = psutil.Process(pid)
            tree = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            try:
                connections = proc.net_connections(kind="inet")
                name = proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            seen += [(f"{name} ({proc.pid}) {conn.status} {end.ip}:{end.port}", end.ip)
                     for conn in connections for end in (conn.laddr, conn.raddr) if end]
    return seen


def stop_node(node: subprocess.Popen[bytes]) -> None:
    """Stop a blocking `ray start` and its node as `ray stop` does (SIGTERM to each of its
    processes, SIGKILL to those left after a grace period), but by pid: only this node's,
    sparing any other Ray on the machine. SIGTERM to `ray start` alone would first wait
    for the node to drain, up to 30 s (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S)."""
    try:
        top = psutil.Process(node.pid)
        tree = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        with suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=NODE_STOP_S)
    for proc in alive:
        with suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=15)
    with suppress(subprocess.TimeoutExpired):
        node.wait(timeout=15)


def test_gpu_block_cpu_line(scratch: Path) -> None:
    gpu_line, cpu_line = blocks()["gpu"].strip().splitlines()
    assert gpu_line.startswith("make bench-gpu")
    done = run(cpu_line.split("#")[0], scratch)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu_quick.json" in done.stdout + done.stderr


def test_python_is_the_checkouts() -> None:
    """The commands run the checkout's code (PYTHONPATH), not another editable install."""
    probe = subprocess.run([str(ROOT / ".venv/bin/python"), "-c",
                            "import cluster; print(cluster.__file__)"],
                           env=environment(), cwd="/", capture_output=True, text=True,
                           timeout=60)
    assert probe.stdout.strip().startswith(str(ROOT)), (probe.stdout, sys.executable)
