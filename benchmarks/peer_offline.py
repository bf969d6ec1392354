"""One offline engine for the peer benchmark (benchmarks/peer_bench.py), kept in its own
process so both engines run one at a time on the same cores and each keeps its start-up.

    python benchmarks/peer_offline.py --engine tokenflow|batch|vllm|vllm-eager --model FOLDER

Run with the project's venv for tokenflow and batch (a `ray job submit` per round on a Ray
head of its own) and vLLM's own venv for vllm (this file imports
neither the project nor vLLM at the top, so either interpreter can run it). Prints JSON
lines: `{"event": "ready", "startup_s": ...}` once loaded, then one `{"event": "round",
...}` per `run` line read on stdin (32 prompts x 128 random ids, 64 greedy tokens each, EOS
ignored: the same ids for every engine); `profile` (tokenflow) prints the step breakdown
and the GEMM rates; `quit` ends it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 32, 128, 64
FIRST_ID = 300  # past the specials and the byte tokens of the built-in tokenizer
MAX_HEAD_RETRIES = 1  # a batch round's fresh Ray heads that may fail before the round does
JOB_FAILURE_KEPT = 1000  # characters of a failed head's output kept in the round's JSON


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in range(PROMPT_LEN)]
            for _ in range(NUM_PROMPTS)]


def digest(outputs: list[list[int]]) -> str:
    """A fingerprint of all prompts' greedy outputs: equal digests, equal tokens."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class TokenflowRunner:
    def __init__(self, model: str, dtype: str) -> None:
        from cluster.batch import offline_config
        from cluster.config import TokenflowConfig
        from cluster.engine import LocalEngine
        from controller.messages import SamplingParams
        from workers.presets import resolve_model

        self.folder = str(resolve_model(model))
        # tokenflow's offline configuration, what `python -m cluster.batch --local` runs: the
        # batch profile's step budget, not one planned for an ITL SLO no one waits on here.
        config = offline_config(TokenflowConfig(worker={"model": model, "dtype": dtype}))
        self.engine = LocalEngine(config)
        self.params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        self.vocab_size = self.engine.worker.vocab_size
        sched = self.engine.scheduler
        self.budget = {"max_num_batched_tokens": sched.config.max_num_batched_tokens,
                       "itl_slo_s": sched.itl_slo_s}

    def run(self, batch: list[list[int]]) -> list[list[int]]:
        return [c.output_token_ids for c in self.engine.generate(batch, self.params)]

    def profile(self, batch: list[list[int]], fresh: list[list[int]]) -> dict[str, Any]:
        from benchmarks.peer_profile import offline_breakdown
        from benchmarks.peer_roofline import measure_gemms

        # The GEMM rates in this process: the engine's torch threads, the same load.
        return {**offline_breakdown(self.engine, batch, fresh, self.params),
                "gemm": measure_gemms(self.folder), "greedy_screen": self.greedy_screen(),
                # Whether the decode GEMM prefetches, as the worker chose at its start
                # (workers/gemm_prefetch.py: both timed where `auto`).
                "gemm_prefetch": self.engine.worker.gemm_prefetch}

    def greedy_screen(self) -> dict[str, Any] | None:
        """The lm_head's screen the worker runs (workers/greedy_head.py): its GEMM ("onednn",
        "own" or "i16") and, where the worker timed two at start, each one's milliseconds."""
        head = self.engine.worker.greedy_head
        return None if head is None else {"gemm": head.gemm, "timings_ms": head.timings_ms}


class BatchRunner:
    """The `ray job submit` batch path (docs/batch.md's recipe): every round starts a Ray
    head of its own (so that its idle daemons cost the other engines' rounds nothing),
    writes the prompts as an OpenAI Batch file of token-id prompts, submits
    `python -m cluster.batch` as a job (no controller runs on the head, so its engine runs
    in one task: cluster/task_batch.py), and stops the head. The job's summary times its start-up
    (controller and model) apart from its generation (first request to last answer)."""

    def __init__(self, model: str, dtype: str) -> None:
        from workers.presets import resolve_model

        self.model = str(resolve_model(model))
        self.env = {"TOKENFLOW_WORKER__DTYPE": dtype}  # the job's controller and workers
        config = json.loads((Path(self.model) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.budget: dict[str, Any] = {}
        self.last: dict[str, Any] = {}

    def run(self, batch: list[list[int]]) -> list[list[int]]:
        from benchmarks.batch_bench import Head, JobFailed

        failures: list[str] = []
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "requests.jsonl", Path(tmp) / "results.jsonl"
            inp.write_text("".join(json.dumps(batch_line(i, ids, self.model)) + "\n"
                                   for i, ids in enumerate(batch)))
            while True:
                t0 = time.perf_counter()
                head = Head()
                head_start_s = time.perf_counter() - t0
                try:
                    head.submit(self.model, "-i", str(inp), "-o", str(out), "--no-progress",
                                env=self.env)
                    break
                except JobFailed as err:
                    # A fresh head's ports are picked free and then bound by Ray's own
                    # processes; one taken meanwhile (seen: the dashboard agent's, once in
                    # ~20 heads) fails the head, not the batch path: one more, fresh head.
                    print(f"batch round on a fresh head failed: {err}", file=sys.stderr)
                    failures.append(str(err)[-JOB_FAILURE_KEPT:])
                    if len(failures) > MAX_HEAD_RETRIES:
                        raise
                finally:
                    head.stop()
            job = json.loads(Path(f"{out}.summary.json").read_text())
            by_id = {int(r["custom_id"]): r for r in map(json.loads, out.open())}
        # The round's rate is the job's generation alone, so a retried head costs it nothing.
        self.last = {"head_start_s": head_start_s, "job": job, "head_failures": failures}
        return [by_id[i]["response"]["body"]["choices"][0]["token_ids"]
                for i in range(len(batch))]


def batch_line(index: int, ids: list[int], model: str) -> dict[str, Any]:
    """One OpenAI Batch request: token-id prompt, greedy, EOS ignored, ids returned."""
    return {"custom_id": str(index), "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": ids, "max_tokens": OUTPUT_LEN,
                     "temperature": 0, "ignore_eos": True, "return_token_ids": True}}


class VllmRunner:
    def __init__(self, model: str, eager: bool, dtype: str) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=model, dtype=dtype, enforce_eager=eager, seed=0)
        self.params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.budget = {"max_num_batched_tokens":
                       self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens}

    def run(self, batch: list[list[int]]) -> list[list[int]]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch],
                                 self.params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=("tokenflow", "batch", "vllm", "vllm-eager"),
                        required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations of every engine (the checkpoint is fp32)")
    args = parser.parse_args()
    start = time.perf_counter()
    runner: Any = (TokenflowRunner(args.model, args.dtype) if args.engine == "tokenflow" else
                   BatchRunner(args.model, args.dtype) if args.engine == "batch" else
                   VllmRunner(args.model, eager=args.engine == "vllm-eager", dtype=args.dtype))
    emit(event="ready", startup_s=time.perf_counter() - start, **runner.budget)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        # `run SEED`: new prompts per round (the same for both engines), so no round is
        # served from the previous round's prefix cache.
        batch = prompts(runner.vocab_size, int(arg or 0))
        if command == "run":
            t0 = time.perf_counter()
            outputs = runner.run(batch)
            wall = time.perf_counter() - t0
            num = sum(len(o) for o in outputs)
            extra = getattr(runner, "last", {})
            # The batch job's round counts its generation only, as the engines' rounds do
            # (their start-up is the ready event's); its start-up is reported beside it.
            tok_s = extra["job"]["tokens_per_s_generating"] if extra else num / wall
            emit(event="round", wall_s=wall, output_tokens=num, tok_s=tok_s,
                 first_output=outputs[0], outputs_digest=digest(outputs), **extra)
        elif command == "profile":  # `profile SEED`: prompts no round saw, and SEED + 1's
            emit(event="profile",
                 **runner.profile(batch, prompts(runner.vocab_size, int(arg or 0) + 1)))
        elif command == "quit":
            break


if __name__ == "__main__":
    main()
