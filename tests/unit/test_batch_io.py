"""Batch I/O: locations (paths, URIs, relative ones under a Ray job), Parquet rows,
resume of retryable failures, the summary by status code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import protocol as p
from cluster.batch_io import (
    RAY_JOB_ENV_VAR,
    check_location,
    iter_input_lines,
    new_counts,
    prepare_resume,
    summary,
    write_error,
)


def test_relative_location_refused_only_under_a_ray_job(monkeypatch, tmp_path: Path) -> None:
    assert check_location("out.jsonl", "output") == "out.jsonl"
    monkeypatch.setenv(RAY_JOB_ENV_VAR, "{}")
    with pytest.raises(ValueError, match="temporary copy"):
        check_location("out.jsonl", "output")
    assert check_location(str(tmp_path / "out.jsonl"), "output").endswith("out.jsonl")
    assert check_location("s3://bucket/out.jsonl", "output") == "s3://bucket/out.jsonl"


def test_parquet_rows_become_batch_lines(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", None], "max_tokens": [3, 4],
                             "messages": [None, [{"role": "user", "content": "hi"}]]}),
                   tmp_path / "rows.parquet")
    lines = [json.loads(x) for x in iter_input_lines(f"file://{tmp_path}/rows.parquet")]
    assert lines[0] == {"custom_id": "0", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "a", "max_tokens": 3}}
    assert lines[1]["url"] == "/v1/chat/completions" and lines[1]["custom_id"] == "1"
    assert lines[1]["body"]["messages"] == [{"role": "user", "content": "hi"}]


def test_resume_retries_retryable_and_summary_counts_codes(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    counts = new_counts()
    with out.open("w") as f:
        write_error(f, "busy", p.ProtocolError(503, "worker died"), counts)
        write_error(f, "bad", p.ProtocolError(400, "temperature"), counts)
        write_error(f, "slow", p.ProtocolError(429, "queue full"), counts)
    assert summary(counts, 0, 1.0)["failed_by_code"] == {"400": 1, "429": 1, "503": 1}
    done, num_retry = prepare_resume(str(out))
    assert done == {"bad"} and num_retry == 2
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["bad"]
