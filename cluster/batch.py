"""Batch inference over the OpenAI Batch file format.

    python -m cluster.batch -i IN.jsonl -o OUT.jsonl --local --model builtin:tiny
    python -m cluster.batch -i /abs/rows.parquet -o /abs/out/ --ray-data   # on the cluster

Each input line is `{"custom_id", "method", "url", "body"}`; each output line answers
one `custom_id` with a response body or an error. A malformed line gets an error line
and the rest of the file still runs. Resumable: lines whose `custom_id` is already in
OUT are skipped and new lines are appended, each flushed as its request finishes.
Without `--local` the requests go to a running tokenflow Ray cluster (`ray job submit`):
to its controller, or where none runs and the job has one worker, to an engine the job runs
in one Ray task on its node (cluster/task_batch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

from cluster.batch_config import OWN_CONTROLLER_SECTIONS
from cluster.batch_io import (
    check_location,
    iter_input_lines,
    open_output,
    prepare_resume,
    summary,
    write_text,
)
from cluster.config import BUDGET_FIELD, TokenflowConfig, nest
from cluster.local_batch import run_local


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cluster.batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--input", required=True, help=(
        "OpenAI Batch JSONL, or Parquet with a prompt/messages column: a path or a URI"))
    ap.add_argument("-o", "--output", required=True, help=(
        "JSONL out (appended), or with --ray-data a folder of shards: a path or a URI"))
    ap.add_argument("--local", action="store_true",
                    help="run in this process (LocalEngine) instead of on a Ray cluster")
    ap.add_argument("--ray-data", action="store_true", help=(
        "read the input with Ray Data and write sharded output with a manifest"))
    ap.add_argument("--model", help="checkpoint folder or builtin preset")
    ap.add_argument("--num-workers", type=int, help="worker actors of a controller the job "
                    "starts (a running controller keeps its own)")
    ap.add_argument("--max-num-batched-tokens", type=int, help=(
        "step budget (default for offline jobs: the batch profile's, "
        "batch.overrides.scheduler.max_num_batched_tokens)"))
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--num-kv-blocks", type=int)
    ap.add_argument("--max-in-flight", type=int, help="batch.max_in_flight")
    ap.add_argument("--rows-per-shard", type=int, help="batch.rows_per_shard")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None)
    ap.add_argument("--engine-in-task", action=argparse.BooleanOptionalAction, default=None,
                    help="batch.engine_in_task: with no controller running and one worker, "
                    "run the engine in one Ray task on this node (default) instead of "
                    "starting a controller for the job")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-calibrate", action="store_true", help=(
        "fixed budgets: no budget table loaded or measured at start (calibration.auto)"))
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TokenflowConfig:
    config = TokenflowConfig(**nest({
        "worker.model": args.model, "worker.num_workers": args.num_workers,
        "scheduler.max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduler.max_num_seqs": args.max_num_seqs, "cache.block_size": args.block_size,
        "cache.num_kv_blocks": args.num_kv_blocks,
        "cache.enable_prefix_caching": args.enable_prefix_caching,
        "batch.max_in_flight": args.max_in_flight,
        "batch.rows_per_shard": args.rows_per_shard,
        "batch.engine_in_task": args.engine_in_task,
        "calibration.auto": False if args.no_calibrate else None}))
    return offline_config(config)


def offline_config(config: TokenflowConfig) -> TokenflowConfig:
    """An offline job's engine: the batch profile (`batch.overrides`) on every section but
    those of a controller the job starts (`OWN_CONTROLLER_SECTIONS`), each override unless
    its setting was given (flag, env, keyword); a budget file gives the step budget. With
    the profile's budget the automatic calibration is off: the table recommends a budget
    for the ITL SLO, which no one waits on here."""
    budget = f"scheduler.{BUDGET_FIELD}"
    given = {budget} if config.calibration.budget_file is not None else set()
    sections = [s for s in config.batch.overrides if s not in OWN_CONTROLLER_SECTIONS]
    job = config.with_batch_profile(sections, given)
    if BUDGET_FIELD not in config.batch.overrides.get("scheduler", {}) or given \
            or config.is_given(budget):
        return job
    calibration = dataclasses.replace(job.calibration, auto=False)
    return job.model_copy(update={"calibration": calibration})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        inp = check_location(args.input, "input")
        output = check_location(args.output, "output")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config = config_from_args(args)
    start = time.perf_counter()
    if args.ray_data:
        from cluster.ray_data_batch import run_ray_data

        counts, num_retried = run_ray_data(inp, output, config,
                                           progress=not args.no_progress)
        summary_at = output.rstrip("/") + "/summary.json"
    else:
        controller = None
        if not args.local:
            from cluster.remote_batch import find_controller
            from cluster.task_batch import run_in_task, should_run_in_task

            controller = find_controller(config)
        if not args.local and should_run_in_task(config, controller is not None):
            counts, num_retried = run_in_task(inp, output, config,
                                              progress=not args.no_progress)
        else:
            done_ids, num_retried = prepare_resume(output)
            with open_output(output) as out:
                lines = iter_input_lines(inp)
                if args.local:
                    counts = run_local(lines, out, config, done_ids,
                                       progress=not args.no_progress)
                else:
                    from cluster.remote_batch import run_remote

                    counts = run_remote(lines, out, config, done_ids,
                                        progress=not args.no_progress, controller=controller)
        summary_at = output + ".summary.json"
    result = summary(counts, num_retried, time.perf_counter() - start)
    # This process's peak RSS: what streaming keeps bounded however long the input is.
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    text = json.dumps(result)
    print(text, file=sys.stderr)
    write_text(summary_at, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
