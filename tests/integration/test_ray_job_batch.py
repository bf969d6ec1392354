"""The README's `ray job submit` recipe, run as written against a real Ray head.

The lines come from the README's `batch-cluster` block: the exports (ports and paths
overridden through the environment they default from), the token, `ray start` (plus
`--block`, so that this test owns the head's processes and stops them by pid; `ray stop`
would stop every Ray head on the machine), `ray job submit` and the summary. `make install`
is skipped: the test already runs from the installed `.venv`. Greedy token ids are compared
with `LocalEngine`'s (`--local` on the same input); then half the output is deleted and the
same command resumes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- batch-cluster:begin -->", "<!-- batch-cluster:end -->"
NUM_REQUESTS = 12


def readme_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    return [line for line in block.splitlines()
            if line.strip() and not line.startswith(("```", "#"))]


def pick(lines: list[str], prefix: str) -> list[str]:
    return [line for line in lines if line.startswith(prefix)]


def write_requests(path: Path) -> None:
    rows = []
    for i in range(NUM_REQUESTS):
        body = {"model": "builtin:tiny", "prompt": f"request {i}: tell me about {i * 7}",
                "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        rows.append(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}))
    rows.insert(5, '{"custom_id": "torn", "method": "POST", "url": ')  # malformed
    path.write_text("\n".join(rows) + "\n")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def token_ids(path: Path) -> dict[str, list[int]]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"]
            for r in records(path) if r["custom_id"] is not None}


def dashboard_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True  # it answers (401 without the token): it is up
    except OSError:
        return False


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    lines = readme_lines()
    env = dict(os.environ, RAY_PORT=str(free_port()), DASHBOARD_PORT=str(free_port()),
               CLIENT_PORT=str(free_port()), AGENT_PORT=str(free_port()),
               IN=str(tmp_path / "requests.jsonl"), OUT=str(tmp_path / "results.jsonl"))
    env.pop("RAY_ADDRESS", None)
    prelude = "\n".join(pick(lines, "export ") + pick(lines, ".venv/bin/ray get-auth-token"))
    (start,) = pick(lines, ".venv/bin/ray start ")
    head = subprocess.Popen(["bash", "-c", f"{prelude}\nexec {start} --block"], cwd=ROOT,
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        port = int(env["DASHBOARD_PORT"])
        # Bounded poll of the job server (the dashboard) coming up.
        for _ in range(240):
            if head.poll() is not None:
                raise RuntimeError(f"ray start exited with {head.returncode}")
            if dashboard_up(port):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=0.5)  # the poll's pause, cut short if the head exits
        else:
            raise TimeoutError("the Ray dashboard did not come up in 120 s")
        # On loopback as asked: the raylet advertises 127.0.0.1, not the machine's address.
        # The dashboard can answer before the raylet's process exists (on a busy machine it
        # did): a bounded poll for the raylet first.
        for _ in range(120):
            addresses = raylet_addresses(env["RAY_PORT"])
            if addresses or head.poll() is not None:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=0.5)
        assert addresses == ["127.0.0.1"]
        yield env, prelude
    finally:
        stop_head(head, env["RAY_PORT"])


def raylet_addresses(gcs_port: str) -> list[str]:
    """The node address each raylet of the head on `gcs_port` advertises (its command line;
    Ray starts it detached, so it is found by its GCS port, not as a child)."""
    addresses = []
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []
        if any(a.startswith("--gcs-address=") and a.endswith(f":{gcs_port}") for a in args) \
                and any(a.startswith("--node_ip_address=") for a in args):
            addresses += [a.partition("=")[2] for a in args
                          if a.startswith("--node_ip_address=")]
    return addresses


def stop_head(head: subprocess.Popen, gcs_port: str) -> None:
    """SIGTERM the blocking `ray start`, its process tree and the head's detached daemons
    (found by its GCS port) at once, then SIGKILL whatever is left after 10 s: by pid,
    nothing of any other Ray head. (SIGTERM to `ray start` alone took over 30 s to tear its
    node down, and left processes that needed the SIGKILL anyway: 46 s a teardown.)"""
    procs: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        procs.append(psutil.Process(head.pid))
        procs += procs[0].children(recursive=True)
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []
        if any(a.startswith("--gcs-address=") and a.endswith(f":{gcs_port}") for a in args):
            procs.append(proc)
    procs = list({proc.pid: proc for proc in procs}.values())
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=15)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(timeout=15)  # reaped: no zombie left behind


def submit(env: dict[str, str], prelude: str, *flags: str) -> subprocess.CompletedProcess:
    """The README's job (its batch command with `flags` appended) and its summary."""
    lines = readme_lines()
    (job,) = pick(lines, ".venv/bin/ray job submit ")
    job = " ".join([job, *flags])
    (cat,) = pick(lines, "cat ")
    return subprocess.run(["bash", "-c", f"{prelude}\n{job}\n{cat}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_readme_ray_job_submit_and_resume(ray_head: tuple[dict[str, str], str],
                                          tmp_path: Path) -> None:
    env, prelude = ray_head
    inp, out = Path(env["IN"]), Path(env["OUT"])
    write_requests(inp)

    proc = submit(env, prelude)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tok/s" in proc.stdout + proc.stderr  # the progress bar, from the job log
    # No controller on the head, one worker: the engine ran in one task, none started.
    assert "the engine runs in one task" in proc.stdout + proc.stderr
    assert "starting one for this job" not in proc.stdout + proc.stderr
    summary = summary_of(proc)
    assert summary["completed"] == NUM_REQUESTS
    assert summary["failed_by_code"] == {"400": 1}
    rows = records(out)
    assert len(rows) == NUM_REQUESTS + 1
    (bad,) = [r for r in rows if r["custom_id"] is None]
    assert bad["response"]["status_code"] == 400
    assert "not valid JSON" in bad["error"]["message"]

    # Greedy: the cluster's token ids are LocalEngine's, token by token.
    local_out = tmp_path / "local.jsonl"
    local = subprocess.run(
        [str(ROOT / ".venv/bin/python"), "-m", "cluster.batch", "-i", str(inp), "-o",
         str(local_out), "--local", "--model", "builtin:tiny", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    cluster_ids = token_ids(out)
    assert set(cluster_ids) == {f"r{i}" for i in range(NUM_REQUESTS)}
    assert cluster_ids == token_ids(local_out)
    assert all(len(ids) == 6 for ids in cluster_ids.values())

    # Resume: drop every other answer and resubmit the command, this time through a
    # controller the job starts (the path of more than one worker): the same tokens.
    kept = [line for i, line in enumerate(out.read_text().splitlines()) if i % 2 == 0]
    out.write_text("".join(line + "\n" for line in kept))
    num_kept = sum(1 for line in kept if json.loads(line)["custom_id"] is not None)
    bad_kept = len(kept) - num_kept  # the malformed line's answer, if its line was kept
    proc = submit(env, prelude, "--no-engine-in-task")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting one for this job" in proc.stdout + proc.stderr
    summary = summary_of(proc)
    assert summary["skipped"] == num_kept + bad_kept  # a kept error line is not redone
    assert summary["completed"] == NUM_REQUESTS - num_kept
    answered = [r["custom_id"] for r in records(out)]
    assert sorted(a for a in answered if a) == sorted(f"r{i}" for i in range(NUM_REQUESTS))
    assert answered.count(None) == 1  # the malformed line: reported once, kept or redone
    assert token_ids(out) == cluster_ids


def test_relative_paths_refused_under_a_ray_job(tmp_path: Path) -> None:
    env = dict(os.environ, RAY_JOB_CONFIG_JSON_ENV_VAR="{}")
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/python"), "-m", "cluster.batch", "-i", "requests.jsonl",
         "-o", str(tmp_path / "out.jsonl")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "relative path" in proc.stderr and "temporary copy" in proc.stderr


def readme_serve_on_head() -> str:
    """The README's command that serves on the batch recipe's head."""
    text = (ROOT / "README.md").read_text()
    (line,) = re.findall(r"`(\.venv/bin/python -m cluster\.serve --ray-address [^`]+)`", text)
    return line


def test_a_job_uses_the_controller_served_on_its_head(ray_head: tuple[dict[str, str], str],
                                                       tmp_path: Path) -> None:
    """`cluster.serve --ray-address` joins the recipe's head; the job submitted there finds
    that server's controller (it starts none of its own) and its requests count in the
    server's /metrics as tenant "batch". SIGTERM stops the server cleanly (exit 0) and takes
    its workers with it: the head outlives it."""
    env, prelude = ray_head
    port = free_port()
    serve = subprocess.Popen(
        ["bash", "-c", f"{prelude}\nexec {readme_serve_on_head()} --model builtin:tiny "
                       f"--port {port}"],
        cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert serve.stdout is not None
        for line in serve.stdout:  # bounded: the server exits or says it is ready
            lines.append(line)
            if "OpenAI API at" in line:
                break
        assert "OpenAI API at" in lines[-1], "".join(lines[-40:])
        write_requests(Path(env["IN"]))
        proc = submit(env, prelude)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert summary_of(proc)["completed"] == NUM_REQUESTS
        assert "starting one for this job" not in proc.stdout + proc.stderr
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30)
        text = metrics.read().decode()
        (batch,) = [float(x.split()[-1]) for x in text.splitlines()
                    if x.startswith('tokenflow_tenant_prefill_tokens_total{tenant="batch"')]
        assert batch > 0
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            raise
    assert code == 0
