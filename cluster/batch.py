"""Batch inference over the OpenAI Batch file format.

    python -m cluster.batch -i IN.jsonl -o OUT.jsonl --local --model builtin:tiny

Each input line is `{"custom_id", "method", "url", "body"}`; each output line answers
one `custom_id` with a response body or an error. A malformed line gets an error line
and the rest of the file still runs. Resumable: lines whose `custom_id` is already in
OUT are skipped and new lines are appended, each flushed as its request finishes.
Without `--local` the requests go to a running tokenflow Ray cluster (`ray job submit`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

from cluster import protocol as p
from cluster.batch_io import prepare_resume, read_items, write_line
from cluster.config import TokenflowConfig, nest
from cluster.frontend import Frontend, Prepared, TextStream


@dataclass
class Job:
    custom_id: str
    prepared: Prepared
    stream: TextStream


def run_local(lines: Iterable[str], out: TextIO, config: TokenflowConfig,
              done_ids: set[str], progress: bool = True) -> dict[str, int]:
    from tqdm import tqdm

    from cluster.engine import LocalEngine

    engine = LocalEngine(config)
    tokenizer = engine.worker.tokenizer
    frontend = Frontend(tokenizer, config, engine.worker.vocab_size)
    counts = {"completed": 0, "failed": 0, "skipped": 0}
    jobs: dict[str, Job] = {}
    for custom_id, prepared in read_items(lines, frontend, done_ids, out, counts):
        try:
            request_id = engine.add_request(prepared.prompt_token_ids, prepared.params,
                                            priority=prepared.priority)
        except ValueError as err:  # the engine refused it (KV capacity)
            write_line(out, p.batch_error_line(custom_id, p.ProtocolError(400, str(err))))
            counts["failed"] += 1
            continue
        jobs[request_id] = Job(custom_id, prepared, frontend.text_stream(prepared))

    bar = tqdm(total=len(jobs), desc="batch", unit="req", disable=not progress,
               file=sys.stderr)
    while jobs:
        for output in engine.step():
            job = jobs.get(output.request_id)
            if job is None:
                continue
            _, reason = job.stream.advance(output.new_token_ids, output.finish_reason,
                                           partial(engine.abort, output.request_id))
            if reason is None:
                continue
            body = frontend.response(job.prepared, output.request_id, job.stream, reason)
            write_line(out, p.batch_output_line(job.custom_id, body, None, 200))
            del jobs[output.request_id]
            counts["completed"] += 1
            bar.update(1)
        if jobs and not engine.has_unfinished():
            raise RuntimeError("engine went idle with unfinished batch requests")
    bar.close()
    engine.check_integrity()
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cluster.batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--input", required=True, type=Path, help="OpenAI Batch JSONL in")
    ap.add_argument("-o", "--output", required=True, type=Path, help="JSONL out (appended)")
    ap.add_argument("--local", action="store_true",
                    help="run in this process (LocalEngine) instead of on a Ray cluster")
    ap.add_argument("--model", help="checkpoint folder or builtin preset")
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--num-kv-blocks", type=int)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-calibrate", action="store_true", help=(
        "fixed budgets: no budget table loaded or measured at start (calibration.auto)"))
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TokenflowConfig:
    return TokenflowConfig(**nest({
        "worker.model": args.model,
        "scheduler.max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduler.max_num_seqs": args.max_num_seqs, "cache.block_size": args.block_size,
        "cache.num_kv_blocks": args.num_kv_blocks,
        "cache.enable_prefix_caching": args.enable_prefix_caching,
        "calibration.auto": False if args.no_calibrate else None}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    done_ids, num_retried = prepare_resume(args.output)
    with args.input.open() as inp, args.output.open("a") as out:
        if args.local:
            counts = run_local(inp, out, config, done_ids, progress=not args.no_progress)
        else:
            from cluster.remote_batch import run_remote

            counts = run_remote(inp, out, config, done_ids, progress=not args.no_progress)
    counts["retried"] = num_retried  # retryable failures of an earlier run, run again
    summary = json.dumps(counts)
    print(summary, file=sys.stderr)
    args.output.with_name(args.output.name + ".summary.json").write_text(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
