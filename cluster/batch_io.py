"""The OpenAI Batch file format, shared by the local (`cluster.batch`) and the remote
(`cluster.remote_batch`) runners: reading validated requests, resuming, writing answers.

Inputs and outputs are paths or URIs on any filesystem fsspec opens (`s3://`, `gs://`,
`file://`, local paths). Input is OpenAI Batch JSONL, or Parquet (`*.parquet`) with a
`prompt` or `messages` column: each row becomes one Batch line."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from cluster import protocol as p
from cluster.frontend import Frontend, Prepared


def is_retryable(status_code: int | None) -> bool:
    """A failure worth another try on resume: rate limited, or the service failed (5xx,
    e.g. a 503 while a worker restarted). A 4xx other than 429 would fail the same way."""
    return status_code is not None and (status_code == 429 or status_code >= 500)


# Set in the entrypoint's environment by Ray's job supervisor.
RAY_JOB_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
PARQUET_SUFFIXES = (".parquet", ".pq")
# Parquet columns that are not part of the request body.
ROW_META_COLUMNS = ("custom_id", "url")


def under_ray_job() -> bool:
    return RAY_JOB_ENV_VAR in os.environ


def check_location(location: str, what: str) -> str:
    """`location` (a path or a URI) as given, or ValueError for a relative path under a
    Ray job: the job runs in a temporary copy of its working dir on the head node, where
    a relative output would be lost with the copy and a relative input is not the user's."""
    if "://" in location or Path(location).is_absolute() or not under_ray_job():
        return location
    raise ValueError(
        f"{what} {location!r} is a relative path, and this runs under `ray job submit`: "
        "the job's working directory is a temporary copy on the head node, so the file "
        "would not be the one you mean. Give an absolute path or a URI (s3://..., gs://...).")


def _fs_and_path(location: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(location)


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def exists(location: str) -> bool:
    fs, path = _fs_and_path(location)
    return bool(fs.exists(path))


def read_text(location: str) -> str:
    fs, path = _fs_and_path(location)
    with fs.open(path, "rt") as f:
        return f.read()


def write_text(location: str, text: str) -> None:
    """Whole-file write; atomic on a local filesystem (object stores write whole objects)."""
    fs, path = _fs_and_path(location)
    if _is_local(fs):
        tmp = Path(path).with_name(Path(path).name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return
    with fs.open(path, "wt") as f:
        f.write(text)


def open_output(location: str) -> TextIO:
    """OUT for appending (each line flushed as its request finishes). Object stores cannot
    append: use `--ray-data`, whose shards are written whole."""
    fs, path = _fs_and_path(location)
    if not _is_local(fs):
        raise ValueError(f"{location}: JSONL output appends line by line, which needs a local "
                         "or mounted filesystem; use --ray-data for object stores (shards)")
    return fs.open(path, "at")


def is_parquet(location: str) -> bool:
    return location.rstrip("/").endswith(PARQUET_SUFFIXES)


def row_to_line(row: dict[str, Any], index: int) -> str:
    """One Parquet row as a Batch line: `custom_id` (else the row index), `url` (else by
    the prompt column), every other non-null column is a body field."""
    body = {k: v for k, v in row.items() if k not in ROW_META_COLUMNS and v is not None}
    url = row.get("url") or ("/v1/chat/completions" if "messages" in body
                             else "/v1/completions")
    custom_id = row.get("custom_id")
    return json.dumps({"custom_id": str(index) if custom_id is None else str(custom_id),
                       "method": "POST", "url": url, "body": body})


def iter_input_lines(location: str, batch_rows: int = 1024) -> Iterator[str]:
    """The input's Batch lines, streamed (one Parquet record batch in memory at a time)."""
    fs, path = _fs_and_path(location)
    if is_parquet(location):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            index = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows):
                for row in batch.to_pylist():
                    yield row_to_line(row, index)
                    index += 1
        return
    with fs.open(path, "rt") as f:
        yield from f


def prepare_resume(location: str | Path, rewrite: bool = True) -> tuple[set[str], int]:
    """Get OUT ready for a resumed run: (custom_ids answered for good, lines to retry).
    With `rewrite`, OUT is rewritten (atomically) without the retryable error lines and
    any torn last line, so every custom_id ends up with exactly one answer."""
    location = str(location)
    if not exists(location):
        return set(), 0
    done: set[str] = set()
    kept: list[str] = []
    num_retry = num_dropped = 0
    for line in read_text(location).splitlines():
        try:
            record = json.loads(line)
            custom_id = record["custom_id"]
        except (ValueError, KeyError, TypeError):
            num_dropped += 1  # a torn last line from a crash: that request runs again
            continue
        status = (record.get("response") or {}).get("status_code")
        if record.get("error") is not None and is_retryable(status):
            num_retry += 1
            num_dropped += 1
            continue
        if custom_id is None and isinstance(record.get(INPUT_SHA256), str):
            done.add(f"#{INPUT_SHA256}:{record[INPUT_SHA256]}")
        done.add(custom_id)
        kept.append(line)
    if rewrite and num_dropped:
        write_text(location, "".join(line + "\n" for line in kept))
    return done, num_retry


# An error line for an input line that names no custom_id carries the input line's hash
# under this key, so that a resumed run knows the line is answered (its error is written
# once, not on every resume).
INPUT_SHA256 = "input_sha256"


def input_sha256(line: str) -> str:
    return hashlib.sha256(line.strip().encode()).hexdigest()


def line_key(line: str) -> str:
    """What marks an input line as answered: its custom_id, else its content's hash."""
    custom_id = _custom_id_of(line)
    return custom_id if custom_id is not None else f"#{INPUT_SHA256}:{input_sha256(line)}"


def error_line(custom_id: str | None, err: p.ProtocolError, line: str | None = None) -> dict:
    """The output line answering a failed input line; one naming no custom_id carries the
    input line's hash."""
    record = p.batch_error_line(custom_id, err)
    if custom_id is None and line is not None:
        record[INPUT_SHA256] = input_sha256(line)
    return record


def _custom_id_of(line: str) -> str | None:
    try:
        value = json.loads(line).get("custom_id")
        return value if isinstance(value, str) else None
    except (ValueError, AttributeError):
        return None


def write_line(out: TextIO, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def write_error(out: TextIO, custom_id: str | None, err: p.ProtocolError,
                counts: dict[str, int], line: str | None = None) -> None:
    """An error line, counted as failed and by its status code (`failed_<code>`)."""
    write_line(out, error_line(custom_id, err, line))
    count_error(err, counts)


def count_error(err: p.ProtocolError, counts: dict[str, int]) -> None:
    counts["failed"] += 1
    key = f"failed_{err.status_code}"
    counts[key] = counts.get(key, 0) + 1


def new_counts() -> dict[str, int]:
    return {"completed": 0, "failed": 0, "skipped": 0, "completion_tokens": 0}


def summary(counts: dict[str, int], num_retried: int, elapsed_s: float) -> dict[str, Any]:
    """This run's completed, failed (and by status code), skipped, retried, tokens; and
    its start-up (model load, controller start: `counts["startup_ms"]`) apart from the
    tokens/s after it, since a short job is mostly start-up."""
    by_code = {k.removeprefix("failed_"): v for k, v in sorted(counts.items())
               if k.startswith("failed_")}
    num_tokens = counts["completion_tokens"]
    startup_s = counts.get("startup_ms", 0) / 1e3
    return {"completed": counts["completed"], "failed": counts["failed"],
            "failed_by_code": by_code, "skipped": counts["skipped"], "retried": num_retried,
            "completion_tokens": num_tokens, "elapsed_s": round(elapsed_s, 3),
            "tokens_per_s": round(num_tokens / max(elapsed_s, 1e-9), 1),
            "startup_s": round(startup_s, 3),
            "tokens_per_s_after_startup": round(
                num_tokens / max(elapsed_s - startup_s, 1e-9), 1),
            **_generation(counts)}


def _generation(counts: dict[str, int]) -> dict[str, Any]:
    """Seconds from the first request handed to the engine to the last answer written, and
    the tokens/s over them: the generation rate alone, without start-up or input reading
    before the first request (a runner that does not time it reports neither)."""
    if "generation_ms" not in counts:
        return {}
    generation_s = counts["generation_ms"] / 1e3
    return {"generation_s": round(generation_s, 3), "tokens_per_s_generating": round(
        counts["completion_tokens"] / max(generation_s, 1e-9), 1)}


class Progress:
    """tqdm in the job log: requests/s as the rate, generated tokens/s as the postfix."""

    def __init__(self, enabled: bool, total: int | None = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="batch", unit="req", disable=not enabled,
                        file=sys.stderr, mininterval=1.0)
        self.start = time.perf_counter()
        self.num_tokens = 0

    def add_total(self, num: int) -> None:
        self.bar.total = (self.bar.total or 0) + num

    def finished(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.num_tokens / elapsed:.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def write_answer(out: TextIO, custom_id: str, body: dict[str, Any], counts: dict[str, int],
                 progress: Progress) -> None:
    write_line(out, p.batch_output_line(custom_id, body, None, 200))
    count_answer(body, counts, progress)


def count_answer(body: dict[str, Any], counts: dict[str, int], progress: Progress) -> None:
    num_tokens = int((body.get("usage") or {}).get("completion_tokens", 0))
    counts["completed"] += 1
    counts["completion_tokens"] += num_tokens
    progress.finished(num_tokens)


def take_lines(lines: Iterator[str], done_ids: set[str], max_lines: int
               ) -> tuple[list[str], int]:
    """(up to `max_lines` input lines still to answer, how many lines answered in a previous
    run were passed over); fewer lines only at the end of the input. Blank lines are
    dropped. Reads the input (blocking I/O): the remote runner calls it off its event loop,
    never two at once (one iterator)."""
    taken: list[str] = []
    num_skipped = 0
    while len(taken) < max_lines:
        line = next(lines, None)
        if line is None:
            break
        if not line.strip():
            continue
        if line_key(line) in done_ids:
            num_skipped += 1
            continue
        taken.append(line)
    return taken, num_skipped


def prepare_line(line: str, frontend: Frontend
                 ) -> tuple[str | None, Prepared | p.ProtocolError]:
    """(custom_id, the validated request, or the error that answers the line). CPU-bound
    (parsing, templating, tokenizing) and thread-safe: the remote runner calls it on the
    text pool. A line too malformed to name its custom_id is answered without one."""
    try:
        item = p.parse_batch_line(line)
        prepared = frontend.prepare(item.url, item.body)
        return item.custom_id, prepared
    except p.ProtocolError as err:
        return _custom_id_of(line), err


def read_items(lines: Iterable[str], frontend: Frontend, done_ids: set[str], out: TextIO,
               counts: dict[str, int]) -> Iterator[tuple[str, Prepared]]:
    """Validated (custom_id, request) pairs of the input, read one line at a time; lines
    answered in a previous run are skipped, malformed ones get their error line here."""
    pending = iter(lines)
    while True:
        taken, num_skipped = take_lines(pending, done_ids, 1)
        counts["skipped"] += num_skipped
        if not taken:
            return
        custom_id, result = prepare_line(taken[0], frontend)
        if isinstance(result, p.ProtocolError):
            write_error(out, custom_id, result, counts, taken[0])
            continue
        assert custom_id is not None  # a line that parsed names its custom_id
        yield custom_id, result
