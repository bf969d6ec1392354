"""Calibration micro-benchmarks on a worker's device (README, "Token budgets from the hardware").

A real `Worker` runs hand-built `StepPlan`s (controller/messages.py), so the numbers are the
step times the controller will see:
- prefill chunks on the tile grid at several context depths: one request whose first
  `context` tokens count as cached (their K/V are whatever the blocks hold; the timing does
  not depend on values), one token more than is scheduled so the chunk does not sample,
  like every chunk but a prompt's last; re-sent as `CachedRequestData` with the same
  `num_computed_tokens` (the controller's count is authoritative) so it repeats the chunk;
- decode steps: `batch` requests of `context` cached tokens, each sampling one token;
  re-created every run so each run samples (finished ids are dropped before new ones);
- the matmul peak and the memory bandwidth (workers/hardware.py);
- KV capacity: blocks that fit in `memory_fraction` of the device memory after weights,
  an allocation probe (halving on failure), the int64 slot-index limit of the block-wise
  layout and the int32 limit a contiguous per-request layout would hit.
Timing runs in interleaved rounds (every round runs every point once, `sweep`): each
point's first `warmup` runs are discarded (a cold run measures caches and clocks, not the
step), the mean (and median, std) of the next `iters` kept. A prefill point's first run (its
admission) is never timed and counts as its first warm-up run. The GEMM and copy probes keep
their best run, so they run no warm-up at all (another process only ever slows a run). With
`agree_within` (the short calibration), a point or probe whose first two kept runs agree
stops there, and one whose warm-up run agrees with its first kept run keeps both and stops;
one that disagrees runs on to `iters`.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from controller.budget import SCHEMA_VERSION
from controller.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from workers.calibration_grid import (
    CalibrationSpec,
    GridSizing,
    StepGuess,
    decode_points,
    num_blocks_for,
    prefill_points,
    relative_iqr,
    runs_agree,
    size_grid,
    sweep_order,
)
from workers.hardware import bandwidth_runs, matmul_flops_runs
from workers.worker import Worker

INT64_MAX, INT32_MAX = 2**63 - 1, 2**31 - 1
ALLOC_HALVINGS = 8  # allocation probe: how often to halve after a failed allocation
_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
Run = Callable[[], tuple[float, int]]  # one step: (worker-reported seconds, bytes moved)


def model_config_sha256(worker: Worker) -> str:
    """The model's identity: its config.json's hash (a budget table is for this model)."""
    config = Path(worker.model_path) / "config.json"
    config_bytes = config.read_bytes() if config.is_file() else \
        repr(worker.model_config).encode()
    return hashlib.sha256(config_bytes).hexdigest()


class Calibrator:
    def __init__(self, spec: CalibrationSpec, progress: bool = True,
                 worker: Worker | None = None, sizing: GridSizing | None = None,
                 report: Callable[[str], object] | None = None) -> None:
        """`worker`: measure on this one (a serving worker before it serves: its weights,
        pool, backend and CUDA graphs are what the table is for; its requests must be gone
        and it must be running `spec`'s model, dtype and device). A new worker with a pool
        of just the needed size is built when none is given or its pool is too small or
        of another block size. `sizing`: first run a pilot and cut `spec` to fit its time
        (the table stores the spec it measured); None measures `spec` as it is (`--check`,
        the automatic calibration). `report`: where the estimate goes (a line of text)."""
        self.spec, self.progress, self.sizing = spec, progress, sizing
        self.report = report or (lambda line: None)
        if worker is None or worker.block_size != spec.block_size \
                or worker.num_kv_blocks < spec.num_kv_blocks:
            worker = Worker(spec.model, num_kv_blocks=spec.num_kv_blocks,
                            block_size=spec.block_size, dtype=spec.dtype, device=spec.device)
        self.worker = worker
        self._steps = 0
        self._admitted: set[str] = set()  # request ids the worker holds for the sweep
        # (tokens, context) -> the prefill point's admission run: its first warm-up run.
        self.admission_runs: dict[tuple[int, int], tuple[float, int]] = {}

    # -- timing ---------------------------------------------------------------------------
    def _plan(self, **fields: object) -> StepPlan:
        self._steps += 1
        return StepPlan(step_id=self._steps, **fields)  # type: ignore[arg-type]

    def prefill_point(self, tokens: int, context: int) -> Run:
        """Admit a request whose first `context` tokens count as cached; each call of the
        returned function re-runs its chunk of `tokens` (and does not sample)."""
        rid, total = f"prefill-{tokens}@{context}", context + tokens
        ids = [(i % (self.worker.vocab_size - 1)) + 1 for i in range(total + 1)]
        # Points share block ids (values never matter): the pool is the largest point's.
        blocks = list(range(num_blocks_for(total, self.spec.block_size)))
        sched = {"num_scheduled_tokens": {rid: tokens}, "total_num_scheduled_tokens": tokens}
        first = self.worker.execute(self._plan(
            new_requests=[NewRequestData(rid, ids, _PARAMS, blocks, context)], **sched))
        assert first.num_tokens == tokens and not first.sampled_token_ids[rid]
        self._admitted.add(rid)
        self.admission_runs[tokens, context] = (first.elapsed_s, first.bytes_moved)

        def run() -> tuple[float, int]:
            again = CachedRequestData(rid, [], context)
            res = self.worker.execute(self._plan(cached_requests=[again], **sched))
            return res.elapsed_s, res.bytes_moved

        return run

    def decode_point(self, batch: int, context: int) -> Run:
        """Each call admits `batch` requests of `context` cached tokens afresh (dropping the
        previous ones first) and decodes one token for each."""
        per = num_blocks_for(context + 1, self.spec.block_size)
        rids = [f"decode-{batch}@{context}-{i}" for i in range(batch)]
        ids = [(i % (self.worker.vocab_size - 1)) + 1 for i in range(context + 1)]
        self._admitted.update(rids)

        def run() -> tuple[float, int]:
            news = [NewRequestData(r, ids, _PARAMS, list(range(i * per, (i + 1) * per)), context)
                    for i, r in enumerate(rids)]
            res = self.worker.execute(self._plan(
                new_requests=news, finished_request_ids=set(rids),
                num_scheduled_tokens=dict.fromkeys(rids, 1), total_num_scheduled_tokens=batch))
            return res.elapsed_s, res.bytes_moved

        return run

    def sweep(self, runs: list[Run], bar: tqdm | None = None, num_admitted: int = 0,
              admission_runs: list[tuple[float, int]] | None = None) -> list[dict[str, float]]:
        """Interleaved rounds: every round runs every point once; the first `warmup` rounds
        are discarded. On a shared machine a burst of background load then spreads over all
        points instead of bending the curve at whichever point it hit. The first
        `num_admitted` runs already ran once (their admission, `admission_runs` where
        given): that was their first warm-up run, so they sit out the first warm-up round
        (on a 2-core CPU the quick grid's first start saved ~3 s of ~17 by it).

        With `agree_within`: a point whose first two kept runs agree sits out the later
        rounds, and a point whose last warm-up run agrees with its first kept run keeps both
        (it was warm: a cold first run would have disagreed) and sits out the rest."""
        spec, within = self.spec, self.spec.agree_within
        samples: list[list[tuple[float, int]]] = [[] for _ in runs]
        last_warm: list[tuple[float, int] | None] = [None] * len(runs)
        if spec.warmup == 1 and admission_runs is not None:
            last_warm[:num_admitted] = admission_runs[:num_admitted]
        for round_index, index in sweep_order(spec, len(runs), num_admitted):
            kept = samples[index]
            if bar is not None:
                bar.update()
            if runs_agree([t for t, _ in kept], within):
                continue
            sample = runs[index]()
            if round_index < spec.warmup:
                last_warm[index] = sample
                continue
            warm = last_warm[index]
            if not kept and warm is not None and runs_agree([warm[0], sample[0]], within):
                kept.append(warm)
            kept.append(sample)
        self.worker.execute(self._plan(finished_request_ids=set(self._admitted)))
        self._admitted.clear()
        stats = []
        for kept in samples:
            times = [t for t, _ in kept]
            stats.append({"mean_s": statistics.fmean(times), "median_s": statistics.median(times),
                          "std_s": statistics.stdev(times) if len(times) > 1 else 0.0,
                          "iqr": relative_iqr(times),
                          "bytes_moved": kept[-1][1]})
        return stats

    # -- hardware and KV capacity -----------------------------------------------------------
    def hardware(self) -> tuple[dict[str, float], dict[str, float]]:
        """(the best run of the GEMM and of the copy probe, their relative spreads). The best,
        not the mean: these are peaks, and on a shared machine another process only ever
        slows a run, so the best run is the one that repeats."""
        spec, device = self.spec, self.worker.device

        def best_runs(probe: Callable[[int], list[float]]) -> list[float]:
            first = min(spec.iters, 2) if spec.agree_within > 0 else spec.iters
            runs = probe(first)
            if len(runs) < spec.iters and not runs_agree(runs, spec.agree_within):
                runs += probe(spec.iters - len(runs))
            return runs

        flops = best_runs(lambda iters: matmul_flops_runs(
            self.worker.dtype, size=spec.matmul_size, warmup=0, iters=iters, device=device))
        bandwidth = best_runs(lambda iters: bandwidth_runs(
            nbytes=spec.bandwidth_bytes, warmup=0, iters=iters, device=device))
        return ({"peak_flops": max(flops), "memory_bandwidth": max(bandwidth)},
                {"peak_flops": relative_iqr(flops), "memory_bandwidth": relative_iqr(bandwidth)})

    def pilot(self) -> StepGuess:
        """A few single steps (a decode, a middle chunk shallow and deep) that price the
        grid's points; their requests are released before the sweep."""
        spec, limit = self.spec, self.worker.model_config.max_model_len
        decode = self.decode_point(1, min(spec.decode_contexts))
        decode()  # the first run pays one-time costs
        base_s = decode()[0]
        tokens = sorted(spec.prefill_tokens)[len(spec.prefill_tokens) // 2]
        deep = max((c for c in spec.contexts if c + tokens <= limit), default=0)
        shallow_s = self.prefill_point(tokens, 0)()[0]
        deep_s = self.prefill_point(tokens, deep)()[0] if deep else shallow_s
        self.worker.execute(self._plan(finished_request_ids=set(self._admitted)))
        self._admitted.clear()
        token_s = max(shallow_s - base_s, 0.0) / tokens
        pair_s = max(deep_s - shallow_s, 0.0) / (tokens * deep) if deep else 0.0
        return StepGuess(base_s, token_s, pair_s)

    def _size(self, sizing: GridSizing) -> None:
        """Pilot, cut the spec to `sizing`, report the estimate."""
        started = time.perf_counter()
        before, limit = self.spec, self.worker.model_config.max_model_len
        guess = self.pilot()
        flops_per_token = self.model_stats(None)["flops_per_token"]

        def probes_s(spec: CalibrationSpec) -> float:
            # The GEMM at the model's own FLOP rate, the copy at the rate a decode reads
            # the weights: rough, like every estimate here.
            gemm_s = 2.0 * spec.matmul_size ** 3 * guess.token_s / max(flops_per_token, 1.0)
            copy_s = 2.0 * spec.bandwidth_bytes * guess.base_s / max(self.worker.weight_bytes, 1)
            return spec.iters * (gemm_s + copy_s)  # best of iters: no warm-up runs

        budget_s = sizing.max_duration_s - (time.perf_counter() - started) - probes_s(before)
        self.spec = spec = size_grid(before, guess, limit, sizing, budget_s)
        estimate_s = guess.sweep_s(spec, limit) + probes_s(spec)
        rounds = spec.warmup + spec.iters
        num_points = len(prefill_points(spec, limit)) + len(decode_points(spec))
        line = (f"calibrate: estimated {_minutes(estimate_s)} for {num_points} points x "
                f"{rounds} rounds plus the hardware probes")
        if spec != before:
            line += (f" (sized to calibration.max_duration_s {sizing.max_duration_s:g} s: "
                     f"chunks up to {max(spec.prefill_tokens)} tokens, contexts "
                     f"{', '.join(map(str, spec.contexts))}, {spec.warmup} warm-up + "
                     f"{spec.iters} kept runs per point)")
        self.report(line)

    def kv_capacity(self) -> dict[str, object]:
        worker, cfg = self.worker, self.worker.model_config
        if worker.device.type == "cuda":
            total = torch.cuda.get_device_properties(worker.device).total_memory
        else:  # total, not available: other tenants must not make the table drift
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = max(int(total * self.spec.memory_fraction) - worker.weight_bytes, 0)
        per_block = worker.kv_bytes_per_block
        fit = budget // per_block
        probe, blocks, allocated = [], fit, 0
        for _ in range(ALLOC_HALVINGS):
            # One tensor for all layers' K and V of a `blocks` pool, less the calibration
            # worker's own pool, which is resident already (weights are too).
            extra = max(blocks - worker.num_kv_blocks, 0) * per_block
            try:
                buf = torch.empty(extra, dtype=torch.uint8, device=worker.device)
                del buf
                probe.append({"blocks": blocks, "ok": True})
                allocated = blocks
                break
            except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
                probe.append({"blocks": blocks, "ok": False})
                blocks //= 2
        row = cfg.num_key_value_heads * cfg.head_dim  # elements per slot and layer
        max_int64 = INT64_MAX // (self.spec.block_size * row)
        # Element offset of the last allocatable slot, in int64 as the attention path
        # computes it: a wrapped (overflowed) value would differ from the exact integer.
        last_slot = allocated * self.spec.block_size - 1
        offset = torch.tensor([max(last_slot, 0)], dtype=torch.int64) * row
        assert int(offset[0]) == max(last_slot, 0) * row, "int64 slot offsets overflow"
        return {"bytes_per_block": per_block, "memory_budget_bytes": budget, "blocks_fit": fit,
                "alloc_probe": probe, "blocks_allocated": allocated,
                "max_blocks_int64": max_int64, "max_tokens_int32_offset": INT32_MAX // row,
                "capacity_tokens": min(fit, allocated, max_int64) * self.spec.block_size}

    def model_stats(self, weight_bits: int | None) -> dict[str, int | float]:
        cfg, worker = self.worker.model_config, self.worker
        embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        lm_head = cfg.vocab_size * cfg.hidden_size
        body = worker.num_params - embed - lm_head  # matmuls every token goes through
        bits = worker.dtype.itemsize * 8
        return {"num_params": worker.num_params, "weight_bytes": worker.weight_bytes,
                "weight_bits": weight_bits or bits, "measured_weight_bits": bits,
                "flops_per_token": 2.0 * body,
                # QK^T and PV: 2 multiply-adds per pair, head and layer
                "flops_per_pair": 4.0 * cfg.num_hidden_layers * cfg.q_size,
                "flops_per_sample": 2.0 * lm_head, "max_model_len": cfg.max_model_len}

    # -- everything -----------------------------------------------------------------------
    def run(self, weight_bits: int | None = None) -> dict[str, object]:
        """The measurement part of a budget table (BudgetTable.build adds the fits)."""
        threads = torch.get_num_threads()
        if self.spec.threads is not None:
            torch.set_num_threads(self.spec.threads)
        try:  # the thread count is process-wide: give the caller's back
            return self._run(weight_bits)
        finally:
            torch.set_num_threads(threads)

    def _run(self, weight_bits: int | None) -> dict[str, object]:
        if self.sizing is not None:
            self._size(self.sizing)
        spec = self.spec
        limit = self.worker.model_config.max_model_len
        points = prefill_points(spec, limit)
        decodes = decode_points(spec)
        (hardware, hardware_noise), kv = self.hardware(), self.kv_capacity()
        runs = [self.prefill_point(t, c) for t, c in points]
        runs += [self.decode_point(b, c) for b, c in decodes]
        num_runs = len(sweep_order(spec, len(runs), len(points)))
        # smoothing=0: the rate over the whole run; interleaved rounds make it a fair ETA
        # (recent steps alone swing between the smallest and the largest point).
        with tqdm(total=num_runs, desc="calibrate", unit="step", smoothing=0,
                  disable=not self.progress) as bar:
            stats = self.sweep(runs, bar, num_admitted=len(points),
                               admission_runs=[self.admission_runs[p] for p in points])
        prefill = [{"tokens": t, "context": c, **{k: v for k, v in st.items() if k != "iqr"}}
                   for (t, c), st in zip(points, stats, strict=False)]
        noise = {"prefill_time": _median([st["iqr"] for st in stats[:len(points)]]),
                 "decode_time": _median([st["iqr"] for st in stats[len(points):]]),
                 **hardware_noise}
        decode = [{"batch": b, "context": c, **{k: v for k, v in st.items() if k != "iqr"}}
                  for (b, c), st in zip(decodes, stats[len(points):], strict=True)]
        device = self.worker.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
            f"cpu ({torch.get_num_threads()} threads)"
        spec_json = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()}
        return {"schema_version": SCHEMA_VERSION, "created_unix": time.time(),
                "device_name": name, "spec": spec_json,
                "model_config_sha256": model_config_sha256(self.worker),
                "model_stats": self.model_stats(weight_bits), "hardware": hardware, "kv": kv,
                "noise": noise,
                "prefill": prefill, "decode": decode}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"
