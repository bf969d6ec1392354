"""The GPU execution path, side by side with transformers and the hardware, in one run.

`make bench-gpu` (or `python3 -m benchmarks.gpu_bench` where only torch, triton and
transformers are installed; see benchmarks/README.md). It writes a random checkpoint of the
chosen shape itself, then measures, each against its reference:
- prefill of one long prompt vs transformers' forward (last-position logits only);
- the decode step at a batch and context vs transformers `generate` (dynamic and static
  cache) and vs the read bound: weight + KV bytes over the copy bandwidth measured here;
- the mixed step: decodes plus one prefill chunk deep into a long prompt;
- offline throughput vs transformers' static batches;
- the long-prompt scene per policy (users decoding, a long prompt lands): users' P99 gap while it
  lives and its time to first token, tokenflow's scheduler vs prefill-first;
- fp32 greedy equality with transformers on the same device, on a small model;
- the controller's share of a step, in-process: stepping one step at a time (schedule +
  apply vs the worker's execute) and with async scheduling (controller/step_loop.py:
  the next step planned while one runs, launched when it ends, its result applied while the
  next runs), where the share is the step's wall time the device did not spend on it;
- the torch profiler's top ops for one step of each kind.

No Ray, no pydantic: the controller core and the worker are driven directly (`StepLoop`).
`--quick` runs the same code on tiny shapes (CPU, seconds); tests/test_gpu_bench.py runs it
with Ray and pydantic imports blocked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.jit_log import JitLog
from benchmarks.policy_scene import plot_scene, run_scenes, scene_metrics
from benchmarks.policy_workloads import SceneSpec, random_prompt
from benchmarks.virtual_time import VirtualClock
from controller.core import ControllerCore
from controller.messages import SamplingParams, StepPlan, StepResult
from controller.options import CacheConfig, ControllerOptions, WorkerConfig
from controller.request import RequestOutput
from controller.scheduler import SchedulerConfig
from controller.step_loop import StepLoop
from workers.hardware import measure_memory_bandwidth
from workers.presets import PresetSpec, build_tokenizer, preset_config_dict
from workers.worker import Worker, build_worker

RESULTS = Path(__file__).resolve().parent / "results"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SLO_FACTOR = 5.0  # the scene figure's ITL SLO line: 5x the decode step (Sarathi-Serve)
# Deviation and mode logs are expected while measuring (the cost model is not calibrated here).
QUIET_LOGGERS = ("tokenflow.flow", "tokenflow.protections", "tokenflow.slow_requests")
SCENE_POLICIES = {"tokenflow": 2048, "prefill-first": 8192}  # policy -> token budget
# transformers' `generate` runs uncompiled: with a static cache it would otherwise compile the
# model (tens of seconds to minutes) inside the timed calls and the device check's budget.
HF_GENERATE: dict[str, Any] = {"disable_compile": True}


@dataclass(frozen=True)
class GpuBenchConfig:
    model: PresetSpec
    parity_model: PresetSpec
    dtype: str
    block_size: int
    num_kv_blocks: int
    prefill_tokens: int
    decode_batch: int
    decode_context: int
    decode_steps: int  # timed decode steps (ours) and generated tokens (transformers)
    mixed_decodes: int
    mixed_chunk: int
    mixed_depth: int  # the timed chunk starts here
    mixed_repeats: int
    offline_requests: int
    offline_prompt: int
    offline_output: int
    hf_batch_size: int
    scene: SceneSpec
    parity_prompts: int
    parity_tokens: int
    iters: int
    bandwidth_bytes: int
    smoke_context: int = 128  # the smoke phase's short decode
    smoke_steps: int = 8
    profile_top: int = 10
    scene_budgets: dict[str, int] = field(default_factory=lambda: dict(SCENE_POLICIES))


LLAMA_1B = PresetSpec(2048, 16, 32, 8, 8192, 32000, max_position_embeddings=32768, seed=3)
TINY = PresetSpec(64, 2, 4, 2, 192, 512, max_position_embeddings=4096, seed=3)
FULL = GpuBenchConfig(
    model=LLAMA_1B, parity_model=replace(TINY, seed=5), dtype="bfloat16", block_size=16,
    num_kv_blocks=8192, prefill_tokens=4096, decode_batch=64, decode_context=1024,
    decode_steps=32, mixed_decodes=32, mixed_chunk=2048, mixed_depth=8192, mixed_repeats=2,
    offline_requests=128, offline_prompt=512, offline_output=128, hf_batch_size=64,
    scene=SceneSpec(32, 256, 160, 16000, 8, 16), parity_prompts=20, parity_tokens=16, iters=5,
    bandwidth_bytes=2**30)
QUICK = GpuBenchConfig(
    model=TINY, parity_model=replace(TINY, seed=5), dtype="float32", block_size=16,
    num_kv_blocks=512, prefill_tokens=128, decode_batch=8, decode_context=64, decode_steps=4,
    mixed_decodes=4, mixed_chunk=64, mixed_depth=128, mixed_repeats=1, offline_requests=8,
    offline_prompt=32, offline_output=8, hf_batch_size=4, scene=SceneSpec(4, 32, 24, 256, 4, 4),
    parity_prompts=4, parity_tokens=8, iters=2, bandwidth_bytes=32 * 2**20,
    smoke_context=16, smoke_steps=3, scene_budgets={"tokenflow": 64, "prefill-first": 512})


def _progress(message: str) -> None:
    print(f"[gpu-bench] {message}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the engine: controller core + worker, one step verb -----------------------------------
@dataclass(frozen=True)
class StepTiming:
    schedule_s: float  # controller: plan (async: the next step, while this one runs)
    execute_s: float  # worker: metadata, forward, sampling (synchronised on CUDA; async:
    #                   the step's own elapsed_s, the device's time on CUDA)
    apply_s: float  # controller: apply, events
    wall_s: float | None = None  # async: the whole step() call, the step's period

    @property
    def controller_s(self) -> float:
        """What the host adds to the step: serially plan + apply; async, the part of the
        step's period the device did not spend on the step."""
        return self.total_s - self.execute_s

    @property
    def total_s(self) -> float:
        if self.wall_s is not None:
            return self.wall_s
        return self.schedule_s + self.execute_s + self.apply_s


def bench_worker(model: str, block_size: int, num_kv_blocks: int, **worker: Any) -> Worker:
    """A worker built as a serving one is (`build_worker` from the `worker:` and `cache:`
    sections), without bandwidth telemetry: the benchmark reads the device itself."""
    return build_worker(WorkerConfig(model=model, telemetry=False, **worker),
                        CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks))


class BenchEngine:
    """What `cluster.engine.LocalEngine` does, without its pydantic configuration, and with
    every step timed by part. The virtual-time driver (`benchmarks.virtual_time`) drives it
    through the same duck-typed surface."""

    def __init__(self, worker: Worker, policy: str, budget: int, chunk: int | None = None,
                 clock: Callable[[], float] | None = None, is_async: bool = False) -> None:
        self.worker = worker
        # No prefix caching: measurements repeat prompts and a hit would skip their prefill.
        options = ControllerOptions(
            worker=WorkerConfig(max_model_len=worker.max_model_len),
            cache=CacheConfig(block_size=worker.block_size, num_kv_blocks=worker.num_kv_blocks,
                              enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=512,
                                      max_chunk_tokens=chunk, scheduling_policy=policy))
        self.core = ControllerCore.for_workers(options, [worker], clock or time.monotonic)
        self.step_log: list[tuple[StepPlan, StepResult]] = []
        self.keep_step_log = False
        self.timings: list[StepTiming] = []
        # Serial or async scheduling (controller/step_loop.py), as LocalEngine runs it.
        self.loop = StepLoop(self.core, 0, worker.launch, worker.wait, is_ahead=is_async)

    @property
    def scheduler(self):  # the single worker's scheduler
        return self.core.scheduler(0)

    def add_request(self, prompt: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        return self.core.add_request(prompt, params, request_id).request_id

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        done = self.loop.step()
        wall = time.perf_counter() - start
        if done.result is not None:
            # Serially the worker's launch and wait; async, the step's own elapsed_s.
            self.timings.append(StepTiming(done.plan_s, done.result.elapsed_s, done.apply_s,
                                           wall) if self.loop.is_ahead else
                                StepTiming(done.plan_s, done.execute_s, done.apply_s))
            if self.keep_step_log and done.plan is not None:
                self.step_log.append((done.plan, done.result))
        return done.outputs

    def has_work(self) -> bool:
        return self.loop.has_work()

    def run_to_completion(self) -> None:
        while self.has_work():
            self.step()


# -- checkpoint ----------------------------------------------------------------------------
def write_checkpoint(spec: PresetSpec, dtype: torch.dtype, folder: Path,
                     device: torch.device) -> Path:
    """A random Llama checkpoint (config.json, safetensors, tokenizer), drawn on `device`
    (seconds for 1B parameters on a GPU) with the presets' scales; reused when present."""
    from safetensors.torch import save_file

    from workers.model_config import ModelConfig
    from workers.presets import LOGIT_STD, random_state_dict

    if (folder / "complete").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    raw = preset_config_dict(spec) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    config = ModelConfig.from_dict(raw)
    if device.type == "cpu":
        state = {k: v.to(dtype) for k, v in random_state_dict(config, spec.seed).items()}
    else:
        from workers.models.llama import LlamaForCausalLM

        with torch.device("meta"):
            shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
        gen = torch.Generator(device=device).manual_seed(spec.seed)
        state = {}
        for name in sorted(shapes):
            shape = shapes[name]
            if name.endswith("norm.weight"):
                state[name] = torch.ones(shape, dtype=dtype)
                continue
            std = (1.0 if name == "model.embed_tokens.weight"
                   else LOGIT_STD / spec.hidden_size**0.5 if name == "lm_head.weight"
                   else 1.0 / shape[-1] ** 0.5)
            state[name] = (torch.randn(shape, generator=gen, device=device, dtype=dtype)
                           * std).cpu()
    (folder / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    save_file(state, str(folder / "model.safetensors"))
    build_tokenizer(spec.vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "complete").write_text("", encoding="utf-8")
    return folder


def load_hf(folder: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as ours runs
    return model


# -- measurements --------------------------------------------------------------------------
def _median_ms(samples_s: list[float]) -> float:
    return statistics.median(samples_s) * 1e3


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return [random_prompt(random.Random(seed + i), length, vocab) for i in range(num)]


def measure_prefill(worker: Worker, hf: Any, cfg: GpuBenchConfig) -> dict[str, Any]:
    n, vocab, device = cfg.prefill_tokens, worker.vocab_size, worker.device
    engine = BenchEngine(worker, "tokenflow", budget=n)
    ours = []
    for i, prompt in enumerate(_prompts(cfg.iters + 1, n, vocab, 100)):
        engine.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY), f"prefill-{i}")
        engine.step()
        if i:  # the first is the warm-up
            ours.append(engine.timings[-1].execute_s)
    engine.run_to_completion()
    ours_ms = _median_ms(ours)
    report: dict[str, Any] = {"prompt_tokens": n, "tokenflow_ms": ours_ms,
                              "tokenflow_tokens_per_s": n / ours_ms * 1e3}
    if hf is None:
        return report | {"transformers": "not loaded (the reference phase failed)"}
    ids = torch.tensor([_prompts(1, n, vocab, 100)[0]], device=device)

    def forward() -> None:
        with torch.inference_mode():
            hf(ids, logits_to_keep=1)

    forward()
    theirs_ms = _median_ms([_timed(forward, device) for _ in range(cfg.iters)])
    return report | {"transformers_ms": theirs_ms,
                     "transformers_tokens_per_s": n / theirs_ms * 1e3,
                     "speedup_vs_transformers": theirs_ms / ours_ms}


def _decoding_engine(worker: Worker, num: int, context: int, max_tokens: int, tag: str,
                     budget: int, is_async: bool = False) -> BenchEngine:
    """`num` requests of `context` prompt tokens, stepped until every one decodes."""
    engine = BenchEngine(worker, "tokenflow", budget=budget, is_async=is_async)
    for i, prompt in enumerate(_prompts(num, context, worker.vocab_size, 200)):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), f"{tag}-{i}")
    while any(not r.is_decoding or r.num_output_tokens == 0
              for r in engine.scheduler.requests.values()) or engine.scheduler.num_waiting:
        engine.step()
    return engine


def _abort_all(engine: BenchEngine) -> None:
    engine.loop.drain()  # the step still on the device (async)
    for request_id in list(engine.scheduler.requests):
        engine.core.abort(request_id)


def hf_decode_step_s(hf: Any, batch: int, context: int, num_steps: int, vocab: int,
                     device: torch.device, cache: str | None) -> float:
    """Per-token time of `generate` at this batch: (n+1 tokens) - (1 token) over n, so the
    prompt's prefill cancels. Each length runs once untimed first. Uncompiled (HF_GENERATE)."""
    ids = torch.tensor(_prompts(batch, context, vocab, 300), device=device)
    kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "do_sample": False,
                              "pad_token_id": 0, **HF_GENERATE}
    if cache is not None:
        kwargs["cache_implementation"] = cache

    def generate(new: int) -> Callable[[], object]:
        def run() -> None:
            with torch.inference_mode():
                hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        return run

    for new in (1, num_steps + 1):
        generate(new)()
    one = min(_timed(generate(1), device) for _ in range(2))
    many = min(_timed(generate(num_steps + 1), device) for _ in range(2))
    return max(many - one, 0.0) / num_steps


def read_bound_s(worker: Worker, num_seqs: int, context: int, bandwidth: float) -> dict:
    cfg = worker.model_config
    elem = worker.dtype.itemsize
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * elem
    weight_bytes = worker.weight_bytes - embed  # only the batch's embedding rows are read
    kv_bytes = num_seqs * context * worker.kv_bytes_per_block // worker.block_size
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "bound_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3}


def _decode_steps(worker: Worker, cfg: GpuBenchConfig, is_async: bool,
                  profiles: dict[str, Any] | None = None) -> list[StepTiming]:
    """`decode_steps` timed decode-only steps of the decode batch (after two warm-ups)."""
    b, ctx, n = cfg.decode_batch, cfg.decode_context, cfg.decode_steps
    engine = _decoding_engine(worker, b, ctx, 4 * n + 8, "decode-async" if is_async
                              else "decode", budget=8192, is_async=is_async)
    for _ in range(2):  # warm-up at this batch
        engine.step()
    start = len(engine.timings)
    for _ in range(n):
        engine.step()
    timings = engine.timings[start:]
    if profiles is not None:
        profiles["decode"] = profile_step(engine, cfg.profile_top)
    _abort_all(engine)
    engine.step()  # delivers the finished ids: the worker forgets them
    return timings


def measure_decode(worker: Worker, hf: Any, cfg: GpuBenchConfig, bandwidth: float | None,
                   profiles: dict[str, Any]
                   ) -> tuple[dict[str, Any], list[StepTiming], list[StepTiming]]:
    """The decode step stepped one at a time and with async scheduling; the report's
    `step_ms` is the async one (what a GPU deployment runs), `serial_step_ms` the other."""
    b, ctx, n = cfg.decode_batch, cfg.decode_context, cfg.decode_steps
    serial = _decode_steps(worker, cfg, False, profiles)
    timings = _decode_steps(worker, cfg, True)
    bound = read_bound_s(worker, b, ctx + n // 2, bandwidth) if bandwidth else None
    serial_ms = _median_ms([t.total_s for t in serial])
    step_ms = _median_ms([t.total_s for t in timings])
    hf_ms: dict[str, Any] = {"compiled": False}
    for name, cache in (("dynamic_cache", None), ("static_cache", "static")):
        if hf is None:
            hf_ms[name] = None
            hf_ms[f"{name}_error"] = "not loaded (the reference phase failed)"
            continue
        try:
            hf_ms[name] = hf_decode_step_s(hf, b, ctx, n, worker.vocab_size, worker.device,
                                           cache) * 1e3
        except Exception as err:  # a transformers version without this cache: say so
            hf_ms[name] = None
            hf_ms[f"{name}_error"] = repr(err)[:300]
    report = {"batch": b, "context": ctx, "timed_steps": n, "step_ms": step_ms,
              "async_scheduling": True, "serial_step_ms": serial_ms,
              "execute_ms": _median_ms([t.execute_s for t in timings]),
              "serial_execute_ms": _median_ms([t.execute_s for t in serial]),
              "tokens_per_s": b / step_ms * 1e3, "transformers_generate_ms": hf_ms,
              "read_bound": bound,
              "vs_read_bound": step_ms / bound["bound_ms"] if bound else None}
    for name in ("dynamic_cache", "static_cache"):
        if hf_ms.get(name):
            report[f"speedup_vs_{name}"] = hf_ms[name] / step_ms
    return report, timings, serial


def measure_mixed(worker: Worker, cfg: GpuBenchConfig,
                  profiles: dict[str, Any]) -> tuple[dict[str, Any], list[StepTiming]]:
    """Decodes and one chunk per step; timed: the steps whose chunk starts at `mixed_depth`
    (decode-first budget = decodes + chunk, chunk capped at `mixed_chunk`)."""
    d, chunk, depth = cfg.mixed_decodes, cfg.mixed_chunk, cfg.mixed_depth
    steps_per_long = depth // chunk + 1
    max_tokens = (cfg.mixed_repeats + 1) * (steps_per_long + 2) + 8  # users outlive the longs
    engine = _decoding_engine(worker, d, 256 if depth > 1024 else 16, max_tokens, "mixed",
                              budget=8192)
    engine.scheduler.config.max_num_batched_tokens = d + chunk
    engine.scheduler.config.max_chunk_tokens = chunk
    timed: list[StepTiming] = []
    depths: list[int] = []
    long_prompts = _prompts(cfg.mixed_repeats + 1, depth + chunk, worker.vocab_size, 400)
    for i, prompt in enumerate(long_prompts):  # the first is the warm-up
        rid = f"mixed-long-{i}"
        engine.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY), rid)
        while rid in engine.scheduler.requests:
            begin = engine.scheduler.requests[rid].num_computed_tokens
            if begin >= depth and i == 0:  # the warm-up's deep step is the profiled one
                profiles["mixed"] = profile_step(engine, cfg.profile_top)
                continue
            engine.step()
            if begin >= depth:
                timed.append(engine.timings[-1])
                depths.append(begin)
    _abort_all(engine)
    engine.step()
    return ({"decodes": d, "chunk_tokens": chunk, "chunk_depths": depths,
             "timed_steps": len(timed), "step_ms": _median_ms([t.total_s for t in timed]),
             "execute_ms": _median_ms([t.execute_s for t in timed])}, timed)


def measure_offline(worker: Worker, hf: Any, cfg: GpuBenchConfig) -> dict[str, Any]:
    n, p_len, out = cfg.offline_requests, cfg.offline_prompt, cfg.offline_output
    prompts = _prompts(n, p_len, worker.vocab_size, 500)
    def ours(is_async: bool) -> float:
        engine = BenchEngine(worker, "tokenflow", budget=8192, is_async=is_async)
        engine.add_request(prompts[0][:16], SamplingParams(max_tokens=2, **GREEDY), "warm")
        engine.run_to_completion()
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=out, **GREEDY), f"offline-{i}")
        engine.run_to_completion()
        return time.perf_counter() - start

    serial_s = ours(False)
    ours_s = ours(True)
    total = n * out
    report: dict[str, Any] = {
        "requests": n, "prompt_tokens": p_len, "output_tokens": out, "budget": 8192,
        "tokenflow_s": ours_s, "async_scheduling": True, "serial_tokenflow_s": serial_s,
        "serial_tokenflow_output_tokens_per_s": total / serial_s,
        "tokenflow_output_tokens_per_s": total / ours_s}
    if hf is None:
        return report | {"transformers": "not loaded (the reference phase failed)"}
    device = worker.device
    batches = [prompts[i:i + cfg.hf_batch_size] for i in range(0, n, cfg.hf_batch_size)]

    def hf_batch(batch: list[list[int]], new: int) -> None:
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **HF_GENERATE)

    hf_batch(batches[0][:2], 2)
    theirs_s = sum(_timed(lambda b=b: hf_batch(b, out), device) for b in batches)
    return report | {"hf_batch_size": cfg.hf_batch_size, "transformers_s": theirs_s,
                     "transformers_output_tokens_per_s": total / theirs_s,
                     "speedup_vs_transformers": theirs_s / ours_s}


def measure_scene(worker: Worker, cfg: GpuBenchConfig, slo_ms: float,
                  png: Path | None) -> dict[str, Any]:
    """The long-prompt scene per policy, one after the other on the shared worker (the device is
    not shared with a neighbour, so interleaving buys nothing here)."""
    traces, budgets = {}, {}
    for policy, budget in cfg.scene_budgets.items():
        clock = VirtualClock()
        engine = BenchEngine(worker, policy, budget=budget, clock=clock)
        budgets[policy] = budget
        traces.update(run_scenes({policy: engine}, {policy: clock}, cfg.scene))  # type: ignore[dict-item]
    metrics = {p: scene_metrics(t) for p, t in traces.items()}
    report: dict[str, Any] = {"spec": asdict(cfg.scene), "budgets": budgets}
    if png is not None:
        try:  # the figure is optional: a machine without matplotlib still gets the numbers
            plot_scene(traces, slo_ms, png)
            report["png"] = png.name
        except ImportError as err:
            report["png"] = f"not drawn: {err}"
    for policy, m in metrics.items():
        report[policy] = {"users_p99_gap_ms": m["itl_during_long_prefill"]["p99_ms"],
                          "users_median_gap_ms": m["itl_during_long_prefill"]["median_ms"],
                          "long_ttft_s": m["long_ttft_s"], "details": m}
    if {"tokenflow", "prefill-first"} <= metrics.keys():
        ours, theirs = report["tokenflow"], report["prefill-first"]
        report["p99_gap_ratio"] = ours["users_p99_gap_ms"] / theirs["users_p99_gap_ms"]
        report["ttft_ratio"] = ours["long_ttft_s"] / theirs["long_ttft_s"]
    return report


def measure_parity(folder: Path, device: torch.device, cfg: GpuBenchConfig) -> dict[str, Any]:
    """fp32 greedy token ids equal to transformers' on the same device, sequence by sequence."""
    worker = bench_worker(str(folder), cfg.block_size, 256, dtype="float32",
                          device=str(device))
    engine = BenchEngine(worker, "tokenflow", budget=256)
    rng = random.Random(6)
    prompts = [random_prompt(rng, rng.randint(4, 40), worker.vocab_size)
               for _ in range(cfg.parity_prompts)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=cfg.parity_tokens, **GREEDY))
           for p in prompts]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.core.has_work(0):
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    hf = load_hf(folder, torch.float32, device)
    num_equal, first_mismatch = 0, None
    for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        inp = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            ref = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                              max_new_tokens=cfg.parity_tokens, pad_token_id=0,
                              **HF_GENERATE)
        ref_ids = ref[0, len(prompt):].tolist()
        if ref_ids == outputs[rid]:
            num_equal += 1
        elif first_mismatch is None:
            first_mismatch = {"index": i, "ours": outputs[rid], "transformers": ref_ids}
    return {"num_sequences": len(prompts), "num_equal": num_equal,
            "tokens_per_sequence": cfg.parity_tokens, "all_equal": num_equal == len(prompts),
            "first_mismatch": first_mismatch}


def profile_step(engine: BenchEngine, top: int) -> dict[str, Any]:
    """One real step of `engine` under the torch profiler: wall, kernel launches, the top ops
    by host self time and by device self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.worker.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.step()
        wall_s = time.perf_counter() - start
    averages = prof.key_averages()
    # tokenflow's own: its kernels' ops and named ranges (the CPU decode stack's one call).
    ops = [e for e in averages
           if e.key.startswith(("aten::", "mkldnn::", "triton", "tokenflow::"))]

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)

    launches = sum(e.count for e in averages if "LaunchKernel" in e.key)
    by_host = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_device = sorted((e for e in averages if device_us(e) > 0), key=device_us,
                       reverse=True)[:top]
    return {
        "wall_ms": wall_s * 1e3, "num_op_calls": int(sum(e.count for e in ops)),
        "num_kernel_launches": int(launches),
        "ops_device_ms": sum(device_us(e) for e in ops) / 1e3,
        "top_host_ops": [{"op": e.key, "calls": int(e.count),
                          "self_host_ms": e.self_cpu_time_total / 1e3} for e in by_host],
        "top_device_ops": [{"op": e.key[:120], "calls": int(e.count),
                            "self_device_ms": device_us(e) / 1e3} for e in by_device],
    }


def host_share(timings: list[StepTiming]) -> dict[str, float]:
    """Async steps: a step's period shorter than the device's time for it (noise) counts
    as nothing added, not as a negative share."""
    controller = _median_ms([max(t.controller_s, 0.0) for t in timings])
    total = _median_ms([t.total_s for t in timings])
    return {"controller_ms": controller, "execute_ms": _median_ms([t.execute_s
                                                                   for t in timings]),
            "step_ms": total, "controller_share": controller / total}


def _get(report: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(report, dict) or key not in report:
            return None
        report = report[key]
    return report


def targets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The GPU issues' targets for an H200 on the full shapes (informative on other shapes);
    a figure whose phase failed or was skipped is None, not met."""
    static = _get(report, "decode", "transformers_generate_ms", "static_cache")
    step_ms = _get(report, "decode", "step_ms")
    parity = _get(report, "parity", "all_equal")
    rows = {
        "decode_step_ms": (step_ms, "<=", 3.0),
        "decode_vs_read_bound": (_get(report, "decode", "vs_read_bound"), "<=", 3.0),
        "decode_speedup_vs_static_generate": (static / step_ms if static and step_ms else None,
                                              ">=", 2.5),
        "mixed_step_ms": (_get(report, "mixed", "step_ms"), "<=", 20.0),
        "offline_speedup_vs_transformers": (
            _get(report, "offline", "speedup_vs_transformers"), ">=", 2.0),
        "scene_p99_gap_ratio": (_get(report, "scene", "p99_gap_ratio"), "<=", 0.3),
        "scene_ttft_ratio": (_get(report, "scene", "ttft_ratio"), "<=", 1.5),
        "controller_share_of_decode_step": (
            _get(report, "host_share", "decode", "controller_share"), "<=", 0.1),
        "fp32_greedy_equal": (None if parity is None else float(parity), ">=", 1.0),
        "kernels_per_decode_layer": (_get(report, "kernel_count", "fused", "per_layer"),
                                     "<=", 12),
        # Kernels compiled while timed steps ran (benchmarks/jit_log.py): start-up holes.
        "serving_compiles": (_get(report, "triton_compiles", "num_serving_compiles")
                             if _get(report, "triton_compiles", "installed") else None, "<=", 0),
    }
    out = {}
    for name, (value, op, target) in rows.items():
        met = value is not None and (value <= target if op == "<=" else value >= target)
        out[name] = {"value": value, "comparison": op, "target": target, "met": met}
    return out


# -- the run: fail-soft phases, gpu.json written as each ends ------------------------------
TRACEBACK_LINES = 12


class BenchInterrupted(Exception):
    """SIGTERM (the device check's `timeout`) or SIGINT arrived during a phase."""


# The signals received, by name. The handler's exception surfaces in whatever code runs, and
# that code may swallow it or raise its own instead (torch turned one into a ValueError): a
# phase during which a signal arrived counts as interrupted whatever it then raised.
SIGNALS_RECEIVED: list[str] = []


def _interrupt(signum: int, frame: Any) -> None:
    SIGNALS_RECEIVED.append(signal.Signals(signum).name)
    raise BenchInterrupted(f"{SIGNALS_RECEIVED[-1]} received")


class PhaseLog:
    """The report as the run goes: each phase's result, or its error with the traceback's
    last lines, is written to `out` (atomically) as the phase ends, so that a crash, a hung
    device or `timeout`'s kill leaves every finished phase's figures. A phase runs only when
    the phases it needs succeeded and, under `budget_s`, while time is left."""

    def __init__(self, out: Path, report: dict[str, Any], budget_s: float | None) -> None:
        self.out, self.report, self.budget_s = out, report, budget_s
        self.started = time.perf_counter()
        self.current: str | None = None  # the phase running, or last run
        report["phases"] = {}
        out.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=repr) + "\n", encoding="utf-8")
        os.replace(tmp, self.out)

    def is_ok(self, name: str) -> bool:
        return self.report["phases"].get(name, {}).get("status") == "ok"

    @property
    def errors(self) -> list[str]:
        return [n for n, e in self.report["phases"].items() if e["status"] == "error"]

    def mark_cut(self, err: BaseException) -> None:
        """An interruption that struck outside a phase's own handler (between its progress
        line and its call, say): the phase is recorded as cut all the same."""
        if self.current is not None and self.current not in self.report["phases"]:
            self.report["phases"][self.current] = {
                "status": "error", "error": f"{type(err).__name__}: {err}", "traceback": []}
        self.write()

    def run(self, name: str, fn: Callable[[], Any], needs: tuple[str, ...] = ()) -> Any:
        self.current = name
        elapsed = time.perf_counter() - self.started
        missing = [n for n in needs if not self.is_ok(n)]
        result, entry = None, {}
        if missing:
            entry = {"status": "skipped", "reason": f"needs {', '.join(missing)}"}
        elif self.budget_s is not None and elapsed > self.budget_s:
            entry = {"status": "skipped", "reason": f"the {self.budget_s:.0f} s budget is spent"}
        else:
            _progress(f"{name} (at {elapsed:.0f} s)")
            start, num_signals = time.perf_counter(), len(SIGNALS_RECEIVED)
            try:
                result = fn()
                if len(SIGNALS_RECEIVED) > num_signals:  # its exception was swallowed
                    raise BenchInterrupted(f"{SIGNALS_RECEIVED[-1]} received")
                entry = {"status": "ok"}
                if result is not None:
                    self.report[name] = result
            except Exception as err:
                lines = traceback.format_exc().rstrip().splitlines()
                entry = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000],
                         "traceback": lines[-TRACEBACK_LINES:]}
                interrupted = isinstance(err, BenchInterrupted)
                if not interrupted and len(SIGNALS_RECEIVED) > num_signals:
                    interrupted = True  # raised as another error by the code it landed in
                    entry["error"] = f"{SIGNALS_RECEIVED[-1]} received ({entry['error']})"[:2000]
                _progress(f"{name} FAILED: {entry['error'][:300]}")
                if interrupted:
                    entry["wall_s"] = time.perf_counter() - start
                    self.report["phases"][name] = entry
                    self.write()
                    raise BenchInterrupted(entry["error"]) from err
            entry["wall_s"] = time.perf_counter() - start
        self.report["phases"][name] = entry
        self.write()
        return result


@dataclass
class BenchState:
    """What the phases hand on to each other."""

    folder: Path | None = None
    parity_folder: Path | None = None
    worker: Worker | None = None
    hf: Any = None
    bandwidth: float | None = None
    profiles: dict[str, Any] = field(default_factory=dict)


def _execution(worker: Worker) -> dict[str, Any]:
    graphs = worker.graphs
    return {"attention_backend": worker.backend.name, "fused_layers": worker.uses_fused_layers,
            "cuda_graphs": graphs is not None,
            "graph_buckets": graphs.buckets if graphs is not None else [],
            "startup_s": worker.startup_s}


def _graph_replays(worker: Worker) -> int:
    return worker.graphs.num_replays if worker.graphs is not None else 0


def measure_smoke_decode(worker: Worker, cfg: GpuBenchConfig) -> dict[str, Any]:
    """A short decode of the benchmark batch at a short context, stepped serially: the first
    timed figure, seconds after start-up."""
    engine = _decoding_engine(worker, cfg.decode_batch, cfg.smoke_context,
                              cfg.smoke_steps + 8, "smoke", budget=8192)
    engine.step()  # warm-up
    replays = _graph_replays(worker)
    start = len(engine.timings)
    for _ in range(cfg.smoke_steps):
        engine.step()
    timings = engine.timings[start:]
    num_replays = _graph_replays(worker) - replays
    _abort_all(engine)
    engine.step()
    return {"batch": cfg.decode_batch, "context": cfg.smoke_context,
            "timed_steps": len(timings), "step_ms": _median_ms([t.total_s for t in timings]),
            "execute_ms": _median_ms([t.execute_s for t in timings]),
            "graph_replays": num_replays, "graphs_used": num_replays >= len(timings)}


def measure_kernel_count(cfg: GpuBenchConfig) -> dict[str, Any]:
    """Kernels of one decode step of the benchmark model at the decode batch and context, on
    meta tensors (workers/kernels/dispatch_count.py): the fused CUDA path and, for
    comparison, the torch layers over the same attention kernels."""
    from workers.kernels.dispatch_count import count_decode_kernels
    from workers.model_config import ModelConfig

    model_cfg = ModelConfig.from_dict(preset_config_dict(cfg.model))
    dtype = getattr(torch, cfg.dtype)
    chunk = (cfg.mixed_depth, cfg.mixed_chunk)
    return {"fused": count_decode_kernels(model_cfg, cfg.decode_batch, cfg.decode_context,
                                          dtype),
            "unfused": count_decode_kernels(model_cfg, cfg.decode_batch, cfg.decode_context,
                                            dtype, fused=False),
            # The mixed step runs eagerly: its count is the ops the host dispatches.
            "mixed_fused": count_decode_kernels(model_cfg, cfg.mixed_decodes, 256, dtype,
                                                chunk=chunk),
            "mixed_unfused": count_decode_kernels(model_cfg, cfg.mixed_decodes, 256, dtype,
                                                  fused=False, chunk=chunk)}


def run(cfg: GpuBenchConfig, device: torch.device, work_dir: Path, png: Path | None,
        out: Path, budget_s: float | None = None, extra: dict[str, Any] | None = None,
        ) -> dict[str, Any]:
    """Every phase, in order of what matters most; `out` rewritten as each ends."""
    dtype = getattr(torch, cfg.dtype)
    report: dict[str, Any] = {
        "benchmark": "gpu", "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "versions": _versions(), "config": asdict(cfg), **(extra or {})}
    log = PhaseLog(out, report, budget_s)
    jit = JitLog().install()  # every Triton compile, by phase (none should be in serving)
    st = BenchState()
    tag = f"{cfg.model.hidden_size}x{cfg.model.num_hidden_layers}-{cfg.dtype}-s{cfg.model.seed}"
    shares = report.setdefault("host_share", {})

    def checkpoint() -> dict[str, Any]:
        st.folder = write_checkpoint(cfg.model, dtype, work_dir / f"llama-{tag}", device)
        st.parity_folder = write_checkpoint(cfg.parity_model, torch.float32,
                                            work_dir / f"parity-s{cfg.parity_model.seed}",
                                            device)
        return {"model": str(st.folder), "parity_model": str(st.parity_folder)}

    def worker() -> dict[str, Any]:
        start = time.perf_counter()
        st.worker = bench_worker(str(st.folder), cfg.block_size, cfg.num_kv_blocks,
                                 dtype=cfg.dtype, device=str(device))
        report["execution"] = _execution(st.worker)
        report["model"] = {"params": st.worker.num_params,
                           "weight_bytes": st.worker.weight_bytes, "dtype": cfg.dtype}
        return {"load_and_start_s": time.perf_counter() - start, **report["execution"]}

    def kernels() -> dict[str, Any]:
        from benchmarks.gpu_smoke import kernel_check

        spec = cfg.model
        return kernel_check(spec.num_attention_heads, spec.num_key_value_heads,
                            spec.hidden_size // spec.num_attention_heads, spec.hidden_size,
                            spec.intermediate_size, cfg.block_size, device)

    def reference() -> dict[str, Any]:
        start = time.perf_counter()
        st.hf = load_hf(st.folder, dtype, device)
        return {"load_s": time.perf_counter() - start, "generate_compiled": False}

    def bandwidth() -> dict[str, Any]:
        st.bandwidth = measure_memory_bandwidth(nbytes=cfg.bandwidth_bytes, warmup=2, iters=5,
                                                device=str(device))
        report["copy_bandwidth_bytes_s"] = st.bandwidth
        return {"copy_bandwidth_bytes_s": st.bandwidth}

    def decode() -> dict[str, Any]:
        replays = _graph_replays(st.worker)
        result, timings, serial = measure_decode(st.worker, st.hf, cfg, st.bandwidth,
                                                 st.profiles)
        shares["decode"], shares["decode_serial"] = host_share(timings), host_share(serial)
        result["graph_replays"] = _graph_replays(st.worker) - replays
        result["graphs_used"] = result["graph_replays"] > 0
        report["profiles"] = st.profiles  # filled on by the later phases
        return result

    def mixed() -> dict[str, Any]:
        result, timings = measure_mixed(st.worker, cfg, st.profiles)
        shares["mixed"] = host_share(timings)
        report["profiles"] = st.profiles
        return result

    def scene() -> dict[str, Any]:
        st.hf = None  # frees its weights for the scene's long prompt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        step_ms = _get(report, "decode", "step_ms") or _get(report, "smoke_decode", "step_ms")
        return measure_scene(st.worker, cfg, SLO_FACTOR * (step_ms or 1.0), png)

    def profiles() -> dict[str, Any]:
        engine = BenchEngine(st.worker, "tokenflow", budget=cfg.prefill_tokens)
        engine.add_request(_prompts(1, cfg.prefill_tokens, st.worker.vocab_size, 600)[0],
                           SamplingParams(max_tokens=1, **GREEDY), "profile-prefill")
        st.profiles["prefill"] = profile_step(engine, cfg.profile_top)
        engine.run_to_completion()
        return st.profiles

    # The smoke first: the model up, its kernels checked, one timed decode (about two
    # minutes); then the table, most important first.
    phases: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = [
        ("checkpoint", checkpoint, ()),
        ("worker", worker, ("checkpoint",)),
        ("kernel_check", kernels, ()),
        ("smoke_decode", lambda: measure_smoke_decode(st.worker, cfg), ("worker",)),
        ("kernel_count", lambda: measure_kernel_count(cfg), ()),
        ("parity", lambda: measure_parity(st.parity_folder, device, cfg), ("checkpoint",)),
        ("reference", reference, ("checkpoint",)),
        ("bandwidth", bandwidth, ()),
        ("decode", decode, ("worker",)),
        ("mixed", mixed, ("worker",)),
        ("prefill", lambda: measure_prefill(st.worker, st.hf, cfg), ("worker",)),
        ("offline", lambda: measure_offline(st.worker, st.hf, cfg), ("worker",)),
        ("scene", scene, ("worker",)),
        ("profiles", profiles, ("worker",)),
        ("targets", lambda: targets(report), ()),
    ]
    try:
        for name, fn, needs in phases:
            jit.phase = name
            report["triton_compiles"] = jit.report()
            log.run(name, fn, needs)
    except BenchInterrupted as err:
        report["triton_compiles"] = jit.report()
        log.mark_cut(err)
        raise
    report["triton_compiles"] = jit.report()
    report["wall"] = {"total_s": time.perf_counter() - log.started}
    report["errors"] = log.errors
    log.write()
    return report


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version(), "cuda": torch.version.cuda,
                                  "torch_build": torch.__version__}
    for name in ("torch", "triton", "transformers", "numpy", "safetensors", "tokenizers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        out["cuda_driver"] = str(torch.cuda.driver_version()) \
            if hasattr(torch.cuda, "driver_version") else None
        out["device_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", "--tiny", action="store_true",
                        help="tiny shapes: the whole script in seconds, on any device")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="default: results/gpu.json (gpu_quick.json "
                        "with --quick, so a CPU run never replaces a GPU result)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "tokenflow"
                        / "gpu-bench", help="where the random checkpoints are written")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no phase after this many seconds (the device check's "
                        "time limit minus the longest phase); gpu.json says what was skipped")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / ("gpu_quick.json" if args.quick else "gpu.json")
    device = torch.device(args.device)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    png = None if args.no_png else out.with_suffix(".png")
    try:
        report = run(QUICK if args.quick else FULL, device, args.work_dir, png, out,
                     args.budget_s, extra={"quick": args.quick})
    except BenchInterrupted as err:
        print(f"interrupted: {err}; {out} holds every phase that ended", flush=True)
        return 124
    for name, entry in report["phases"].items():
        if entry["status"] != "ok":
            print(f"phase {name}: {entry['status']} {entry.get('reason') or entry.get('error')}")
    for name, entry in report.get("targets", {}).items():
        value = entry["value"]
        shown = "n/a" if value is None else f"{value:.3g}"
        print(f"{'met   ' if entry['met'] else 'MISSED'} {name}: {shown} "
              f"{entry['comparison']} {entry['target']:g}")
    print(f"wrote {out} in {report['wall']['total_s']:.0f} s")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
