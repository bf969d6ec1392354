"""The OpenAI Batch file format, shared by the local (`cluster.batch`) and the remote
(`cluster.remote_batch`) runners: reading validated requests, resuming, writing answers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from cluster import protocol as p
from cluster.frontend import Frontend, Prepared


def read_done_ids(path: Path) -> set[str]:
    """custom_ids already answered in OUT (a previous, interrupted run)."""
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        try:
            done.add(json.loads(line)["custom_id"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a crash: that request runs again
    return done


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
