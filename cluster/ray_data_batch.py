"""`python -m cluster.batch --ray-data`: big inputs read with Ray Data, sharded output.

The input (JSONL in OpenAI's Batch format, or Parquet with a prompt/messages column; a file
or a folder, on any filesystem) is streamed block by block with Ray Data in file order, each
row goes through the running controller as in `remote_batch` (at most
`batch.max_in_flight` outstanding), and answers are appended to shard files of
`batch.rows_per_shard` lines in the output folder. `manifest.json` lists the closed
shards; a resubmitted job reads the shards already there (dropping retryable failures, as
for one JSONL output), skips what they answer and writes new shards after them.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Any

from cluster.batch_io import (
    _fs_and_path,
    is_parquet,
    prepare_resume,
    read_text,
    row_to_line,
    write_text,
)
from cluster.config import TokenflowConfig

SHARD_RE = re.compile(r"part-(\d{5,})\.jsonl$")
MANIFEST = "manifest.json"


class ShardWriter(io.TextIOBase):
    """A text sink that rolls over to a new shard every `rows_per_shard` lines (checked on
    flush, which `write_line` calls once per line) and keeps the manifest current."""

    def __init__(self, folder: str, first_index: int, rows_per_shard: int,
                 shard_to_num_lines: dict[str, int]) -> None:
        super().__init__()
        self.folder = folder.rstrip("/")
        self.fs, _ = _fs_and_path(self.folder)
        self.index = first_index
        self.rows_per_shard = rows_per_shard
        self.shard_to_num_lines = shard_to_num_lines
        self.file: Any = None
        self.num_lines = 0

    def _shard(self, index: int) -> str:
        return f"part-{index:05d}.jsonl"

    def write(self, text: str) -> int:
        if self.file is None:
            _, path = _fs_and_path(f"{self.folder}/{self._shard(self.index)}")
            self.file = self.fs.open(path, "wt")
        self.num_lines += text.count("\n")
        return self.file.write(text)

    def flush(self) -> None:
        if self.file is None:
            return
        self.file.flush()
        if self.num_lines >= self.rows_per_shard:
            self._close_shard()

    def _close_shard(self) -> None:
        self.file.close()
        self.shard_to_num_lines[self._shard(self.index)] = self.num_lines
        self.file, self.num_lines = None, 0
        self.index += 1
        self.write_manifest(complete=False)

    def write_manifest(self, complete: bool) -> None:
        shards = [{"path": name, "num_lines": n}
                  for name, n in sorted(self.shard_to_num_lines.items())]
        write_text(f"{self.folder}/{MANIFEST}", json.dumps(
            {"shards": shards, "num_lines": sum(self.shard_to_num_lines.values()),
             "complete": complete}, indent=1) + "\n")

    def close(self, complete: bool = True) -> None:
        """Close the open shard; `complete` only when every input row was answered (a run
        that failed or was interrupted leaves a manifest that says it is not)."""
        if self.file is not None:
            self._close_shard()
        self.write_manifest(complete=complete)
        super().close()


def resume_shards(folder: str) -> tuple[set[str], int, dict[str, int], int]:
    """(custom_ids answered, retryable lines to run again, shard -> lines, next index)."""
    fs, path = _fs_and_path(folder)
    fs.makedirs(path, exist_ok=True)
    done: set[str] = set()
    num_retry = 0
    shard_to_num_lines: dict[str, int] = {}
    next_index = 0
    for name in sorted(fs.ls(path, detail=False)):
        match = SHARD_RE.search(name)
        if match is None:
            continue
        shard = f"{folder.rstrip('/')}/{match.group(0)}"
        shard_done, shard_retry = prepare_resume(shard)
        done |= shard_done
        num_retry += shard_retry
        shard_to_num_lines[match.group(0)] = len(read_text(shard).splitlines())
        next_index = max(next_index, int(match.group(1)) + 1)
    return done, num_retry, shard_to_num_lines, next_index


def dataset_lines(location: str) -> Iterator[str]:
    """The input's Batch lines, streamed by Ray Data in file order (so that Parquet rows
    without a custom_id keep the same index on a resumed run)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    if is_parquet(location):
        for index, row in enumerate(ray.data.read_parquet(location).iter_rows()):
            yield row_to_line(dict(row), index)
        return
    for row in ray.data.read_text(location).iter_rows():
        yield row["text"]


def run_ray_data(location: str, folder: str, config: TokenflowConfig,
                 progress: bool = True) -> tuple[dict[str, int], int]:
    """Run every row of `location` into shards under `folder`: (counts, lines retried)."""
    from cluster.remote_batch import connect_controller, run_remote

    controller = connect_controller(config)  # also joins the Ray cluster Ray Data runs on
    done, num_retry, shard_to_num_lines, next_index = resume_shards(folder)
    out = ShardWriter(folder, next_index, config.batch.rows_per_shard,
                      shard_to_num_lines)
    try:
        counts = run_remote(dataset_lines(location), out, config, done,  # type: ignore[arg-type]
                            progress=progress, controller=controller)
    except BaseException:
        out.close(complete=False)
        raise
    out.close()
    return counts, num_retry
