"""The OpenAI Batch file format, shared by the local (`cluster.batch`) and the remote
(`cluster.remote_batch`) runners: reading validated requests, resuming, writing answers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from cluster import protocol as p
from cluster.frontend import Frontend, Prepared


def is_retryable(status_code: int | None) -> bool:
    """A failure worth another try on resume: rate limited, or the service failed (5xx,
    e.g. a 503 while a worker restarted). A 4xx other than 429 would fail the same way."""
    return status_code is not None and (status_code == 429 or status_code >= 500)


def prepare_resume(path: Path, rewrite: bool = True) -> tuple[set[str], int]:
    """Get OUT ready for a resumed run: (custom_ids answered for good, lines to retry).
    With `rewrite`, OUT is rewritten (atomically) without the retryable error lines and
    any torn last line, so every custom_id ends up with exactly one answer."""
    if not path.exists():
        return set(), 0
    done: set[str] = set()
    kept: list[str] = []
    num_retry = num_dropped = 0
    for line in path.read_text().splitlines():
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
        done.add(custom_id)
        kept.append(line)
    if rewrite and num_dropped:
        tmp = path.with_name(path.name + ".resume")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return done, num_retry


def _custom_id_of(line: str) -> str | None:
    try:
        value = json.loads(line).get("custom_id")
        return value if isinstance(value, str) else None
    except (ValueError, AttributeError):
        return None


def write_line(out: TextIO, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def read_items(lines: Iterable[str], frontend: Frontend, done_ids: set[str], out: TextIO,
               counts: dict[str, int]) -> Iterator[tuple[str, Prepared]]:
    """Validated (custom_id, request) pairs of the input; lines answered in a previous run
    are skipped, malformed ones get their error line here."""
    for line in lines:
        if not line.strip():
            continue
        custom_id = _custom_id_of(line)
        if custom_id is not None and custom_id in done_ids:
            counts["skipped"] += 1
            continue
        try:
            item = p.parse_batch_line(line)
            prepared = frontend.prepare(item.url, item.body)
        except p.ProtocolError as err:
            write_line(out, p.batch_error_line(custom_id, err))
            counts["failed"] += 1
            continue
        yield item.custom_id, prepared
