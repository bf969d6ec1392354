"""`python -m cluster.batch` without `--local`: the same file format through the cluster."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.batch_config import BatchConfig
from cluster.frontend import Frontend, Prepared
from cluster.remote_batch import run_remote
from tests.engine.test_batch_cli import CHOICE_LINES, check_choice_lines
from tests.integration.conftest import Cluster


def batch_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_remote_batch_answers_every_line(cluster: Cluster) -> None:
    lines = [
        batch_line("a", {"model": "builtin:tiny", "prompt": "hello", "max_tokens": 5,
                         "ignore_eos": True}),
        batch_line("b", {"model": "builtin:tiny", "max_tokens": 3, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "hi"}]},
                   "/v1/chat/completions"),
        batch_line("c", {"model": "builtin:tiny", "prompt": "x", "max_tokens": -1}),
        "{not json",
        batch_line("done-before", {"model": "builtin:tiny", "prompt": "x"}),
    ]
    out = io.StringIO()
    counts = run_remote(lines, out, cluster.config, {"done-before"}, progress=False)
    assert counts.pop("startup_ms") >= 0  # the controller was up already: connecting only
    assert counts.pop("generation_ms") >= 0  # first request to last answer
    assert counts == {"completed": 2, "failed": 2, "failed_400": 2, "skipped": 1,
                      "completion_tokens": 8}
    records = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert records["a"]["response"]["body"]["usage"]["completion_tokens"] == 5
    assert records["b"]["response"]["body"]["object"] == "chat.completion"
    assert records["c"]["response"]["status_code"] == 400
    assert None in records  # the unparseable line is answered without a custom_id


def test_remote_batch_lines_take_n_and_best_of(cluster: Cluster) -> None:
    out = io.StringIO()
    counts = run_remote([json.dumps(line) for line in CHOICE_LINES], out, cluster.config,
                        set(), progress=False)
    assert counts["completed"] == 3 and counts["failed"] == 0
    check_choice_lines({r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())})


class LineSink(io.StringIO):
    """An output that counts its lines and the threads that wrote them."""

    def __init__(self) -> None:
        super().__init__()
        self.num_lines = 0
        self.thread_names: set[str] = set()

    def write(self, text: str) -> int:
        self.thread_names.add(threading.current_thread().name)
        num_chars = super().write(text)
        self.num_lines += text.count("\n")
        return num_chars


def test_remote_batch_reads_prepares_and_writes_off_the_loop(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop that dispatches the controller's deltas neither reads the input, tokenizes
    nor writes: reads and preparation run on the text pool, writes on their own thread.
    Lines are still read only as requests finish (at most max_in_flight + 1 unanswered),
    and error lines keep their input order."""
    max_in_flight, num_lines, bad = 2, 10, {1, 6}
    config = cluster.config.model_copy(update={"batch": BatchConfig(max_in_flight=max_in_flight)})
    out = LineSink()
    reads: list[tuple[str, int]] = []  # (thread, lines read and not answered yet)

    def lines() -> Iterator[str]:
        for i in range(num_lines):
            reads.append((threading.current_thread().name, i + 1 - out.num_lines))
            yield batch_line(f"bad-{i}" if i in bad else f"ok-{i}", {
                "model": "builtin:tiny", "prompt": f"line {i}", "ignore_eos": True,
                "max_tokens": -1 if i in bad else 3})

    prepare_threads: list[str] = []
    real_prepare = Frontend.prepare

    def prepare(self: Frontend, url: str, body: dict | bytes | str) -> Prepared:
        prepare_threads.append(threading.current_thread().name)
        return real_prepare(self, url, body)

    monkeypatch.setattr(Frontend, "prepare", prepare)
    counts = run_remote(lines(), out, config, set(), progress=False)
    assert counts["completed"] == num_lines - len(bad) and counts["failed_400"] == len(bad)
    assert len(reads) == num_lines and len(prepare_threads) == num_lines
    assert all(name.startswith("tokenflow-text") for name, _ in reads), reads
    assert all(name.startswith("tokenflow-text") for name in prepare_threads), prepare_threads
    assert out.thread_names and all(name.startswith("tokenflow-batch-out")
                                    for name in out.thread_names), out.thread_names
    assert max(num_unanswered for _, num_unanswered in reads) <= max_in_flight + 1, reads
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in records if r["error"] is not None] == \
        [f"bad-{i}" for i in sorted(bad)]
    assert sorted(r["custom_id"] for r in records if r["error"] is None) == \
        sorted(f"ok-{i}" for i in range(num_lines) if i not in bad)


def test_batch_requests_show_in_metrics(cluster: Cluster) -> None:
    """Batch requests are counted by the controller like online ones, tenant `batch`."""
    import httpx

    lines = [batch_line("m", {"model": "builtin:tiny", "prompt": "metrics please",
                              "max_tokens": 2, "ignore_eos": True})]
    assert run_remote(lines, io.StringIO(), cluster.config, set(), progress=False)[
        "completed"] == 1
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    assert re.search(r'tenant_prefill_tokens_total\{tenant="batch"\} [1-9]', text), text[:2000]


def test_ray_data_parquet_shards_and_resume(cluster: Cluster, tmp_path: Path) -> None:
    """Parquet rows through Ray Data into shards with a manifest; a rerun after losing a
    shard and half of another answers exactly the missing rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster.ray_data_batch import run_ray_data

    num_rows = 30
    pq.write_table(pa.table({
        "prompt": [f"row {i}" for i in range(num_rows)],
        "max_tokens": [3] * num_rows, "ignore_eos": [True] * num_rows,
        "temperature": [0.0] * num_rows}), tmp_path / "rows.parquet")
    config = cluster.config.model_copy(update={"batch": dataclasses.replace(
        cluster.config.batch, rows_per_shard=8)})
    folder = str(tmp_path / "out")

    counts, num_retried = run_ray_data(str(tmp_path / "rows.parquet"), folder, config,
                                       progress=False)
    assert counts["completed"] == num_rows and num_retried == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_lines"] == num_rows
    assert [s["num_lines"] for s in manifest["shards"]] == [8, 8, 8, 6]

    def answered() -> list[str]:
        return sorted(json.loads(line)["custom_id"]
                      for shard in sorted((tmp_path / "out").glob("part-*.jsonl"))
                      for line in shard.read_text().splitlines())

    assert answered() == sorted(str(i) for i in range(num_rows))
    (tmp_path / "out" / "part-00001.jsonl").unlink()
    shard = tmp_path / "out" / "part-00002.jsonl"
    shard.write_text("".join(shard.read_text().splitlines(keepends=True)[:4]))
    counts, _ = run_ray_data(str(tmp_path / "rows.parquet"), folder, config, progress=False)
    assert counts["completed"] == 12 and counts["skipped"] == num_rows - 12
    assert answered() == sorted(str(i) for i in range(num_rows))  # each exactly once
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_lines"] == num_rows
