"""`Worker`: owns the model, the paged KV tensors and per-request state; executes `StepPlan`s.

Per-request state is maintained only from the plan's diffs (see controller/messages.py):
`finished_request_ids` drops state first, `NewRequestData` (re)creates it, `CachedRequestData`
appends blocks. A scheduled span of `n` tokens feeds `token_ids[num_computed : num_computed + n]`
at global positions `num_computed + i`; the request samples one token iff the span reaches the
end of its known tokens.

Execution of a step: the spans are laid out decodes first (longest context first), then the
chunks; `StepMetadata.build` packs ids, positions, slots and block table on the host and copies
them to the device at once (workers/attention/metadata.py); the attention backend prepares the
step once for all layers (`attention_backend`: triton on CUDA, torch on CPU). On CUDA the
layers are the fused ones (workers/kernels/fused_llama.py), every kernel is compiled and every
graph bucket captured when the worker starts (`_warm_up`), decode-only steps replay a CUDA
graph of their batch-size bucket (workers/cuda_graphs.py) and mixed steps run eagerly; the
random rows' sampling parameters ride in the metadata upload, tokens are sampled on the
device and copied back in one copy: nothing in `launch` waits for the device.

The bytes a step moves (the CPU bandwidth telemetry): workers/step_results.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import cached_property, partial

import numpy as np
import torch
from torch import Tensor

from controller.messages import CachedRequestData, NewRequestData, StepPlan, StepResult
from workers.attention import HostStaging, SeqSpan, StepMetadata, allocate_kv_cache, make_backend
from workers.cpu_setup import prepare_cpu
from workers.cuda_graphs import DecodeGraphs, Forward
from workers.kv_provenance import KVProvenance
from workers.loader import load_model, parse_dtype
from workers.model_config import ModelConfig
from workers.presets import resolve_model
from workers.sampler import Sampler, SamplingRow
from workers.sections import CacheSection, RunOptions, WorkerSection, packing_policy
from workers.step_results import StepResults
from workers.step_state import PendingStep, RequestState, resolve_num_threads
from workers.telemetry import TelemetrySource
from workers.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def build_worker(section: WorkerSection, cache: CacheSection) -> Worker:
    """The one way a serving worker is built (the worker actor, `LocalEngine`): from the
    validated `worker:` and `cache:` sections, with its bandwidth telemetry when asked."""
    worker = Worker(section.model, cache.num_kv_blocks, cache.block_size, dtype=section.dtype,
                    seed=section.seed, device=section.device, run=RunOptions(
                        section.num_threads, section.attention_backend, section.cuda_graphs,
                        section.max_graph_batch, packing_policy(section),
                        section.cpu_fused_layers, section.cpu_keep_freed_memory,
                        section.cpu_sampled_last_layer, section.cpu_greedy_screen,
                        section.cpu_decode_stack, section.cpu_gemm_prefetch))
    if section.check_kv_provenance:
        worker.kv_provenance = KVProvenance(cache.block_size)
    if section.telemetry:
        from workers.telemetry import make_source

        worker.telemetry = make_source(str(worker.device), section.peak_bandwidth_bytes_s)
    return worker


class Worker(StepResults):
    def __init__(
        self,
        model: str,
        num_kv_blocks: int,
        block_size: int,
        dtype: torch.dtype | str = torch.float32,
        seed: int = 0,
        keep_logits: bool = False,
        device: str = "cpu",
        run: RunOptions | None = None,
    ) -> None:
        """`run` (`RunOptions`): how steps run on the device. `num_threads`: torch intra-op
        threads (process-wide) for CPU execution; None keeps the process's default (torch's
        one per core, or Ray's reserved CPUs in an actor); a negative count is relative to
        the cores the process may run on (-1: all, -2: all but one), as joblib counts jobs.
        On a shared machine fewer threads than cores is often faster: every parallel region
        waits for its slowest, possibly descheduled, thread.

        `attention_backend`: "auto" (triton on CUDA, torch on CPU), "torch" or "triton"
        (workers/attention). `cuda_graphs`: replay decode-only steps of up to `max_graph_batch`
        sequences from CUDA graphs (workers/cuda_graphs.py); only where the device is CUDA
        and the backend capturable (triton), ignored elsewhere."""
        run = run or RunOptions()
        num_threads, attention_backend = run.num_threads, run.attention_backend
        cuda_graphs, max_graph_batch = run.cuda_graphs, run.max_graph_batch
        if num_threads is not None:
            torch.set_num_threads(resolve_num_threads(num_threads))
        # "auto" and "cuda" both fall back to CPU where no GPU is present.
        use_cuda = device in ("auto", "cuda") or device.startswith("cuda:")
        use_cuda = use_cuda and torch.cuda.is_available()
        self.device = torch.device(("cuda" if device == "auto" else device) if use_cuda else "cpu")
        self.dtype = parse_dtype(dtype)
        self.model_path = resolve_model(model)
        self.model, self._config = load_model(self.model_path, self.dtype, self.device)
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        cfg = self._config
        self.kv_caches = allocate_kv_cache(
            cfg.num_hidden_layers, num_kv_blocks, block_size, cfg.num_key_value_heads,
            cfg.head_dim, self.dtype, self.device)
        self.gemm_prefetch = prepare_cpu(  # the decode GEMM's prefetch as chosen, or None
            self.model, run, self.device, attention_backend, self.kv_caches)
        self.backend = make_backend(
            attention_backend, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=self.dtype,
            device=self.device)
        self._staging = HostStaging(self.device)
        # The forward of a step: on CUDA with the Triton backend the fused layers
        # (workers/kernels), elsewhere the model's own (the CPU path, token-exact).
        self.forward: Forward = self.model
        if self.device.type == "cuda" and self.backend.name == "triton":
            from workers.kernels.fused_llama import FusedLlama

            self.forward = FusedLlama(self.model)
        self.graphs: DecodeGraphs | None = None
        if (cuda_graphs and max_graph_batch > 0 and self.device.type == "cuda"
                and self.backend.supports_cuda_graphs):
            max_blocks = min(-(-cfg.max_model_len // block_size), num_kv_blocks)
            self.graphs = DecodeGraphs(
                self.forward, self.kv_caches, self.backend, max_graph_batch, max_blocks,
                block_size, cfg.hidden_size, self.dtype, self.device,
            )
        self.sampler = Sampler(seed)
        self.keep_logits = keep_logits
        self.greedy_head = self._greedy_head(run.greedy_screen and not keep_logits)
        self.is_sampled_last_layer = (  # workers/sampled_rows.py, where it runs
            run.sampled_last_layer and self.forward is self.model
            and self.model.runs_cpu_layers(self.dtype, self.device))
        self._grammars = None  # built on first use (`grammars`)
        self.last_logits: dict[str, Tensor] = {}  # [vocab] fp32, last token of the last span
        self.span_logits: dict[str, Tensor] = {}  # [n, vocab] fp32, every token of that span
        self._requests: dict[str, RequestState] = {}
        self.kv_provenance: KVProvenance | None = None  # worker.check_kv_provenance
        self._launched = False  # a step launched and not waited for (`launch`, `wait`)
        self._host_ids = torch.empty(0, dtype=torch.int64)  # pinned once a CUDA step samples
        # Bandwidth samples for flow control (workers/telemetry.py); set by whoever owns the
        # worker (LocalEngine, WorkerActor), None in unit tests that drive plans by hand.
        self.telemetry: TelemetrySource | None = None

        elem = self.dtype.itemsize
        self._kv_bytes_per_token = cfg.kv_bytes_per_token(elem)
        self._act_bytes_per_token = cfg.activation_bytes_per_token(elem)
        embed_bytes = cfg.vocab_size * cfg.hidden_size * elem
        self._matmul_weight_bytes = self.weight_bytes - (
            0 if cfg.tie_word_embeddings else embed_bytes
        )
        # Seconds spent at start compiling kernels and capturing graphs (CUDA), 0 on CPU.
        self.startup_s = self._warm_up() if self.device.type == "cuda" else 0.0

    @property
    def uses_fused_layers(self) -> bool:
        return self.forward is not self.model

    def _warm_up(self) -> float:
        """The slow things once, before the worker reports ready, never inside a step: every
        Triton kernel compiled (an eager mixed step, then a decode-only one prepared as a
        graph capture prepares it, which takes the split-K kernels), then every CUDA-graph
        bucket captured. Warm-up steps write no K/V (slot -1: the Triton kernels skip it).
        A compile failure raises here. -> seconds taken (0 for the torch backend)."""
        start = time.perf_counter()
        if self.backend.name != "triton":  # nothing to compile; SDPA needs no warm-up here
            return 0.0
        chunk = 2 * self.block_size + 3  # three blocks: the prefill kernel's multi-block loop
        blocks = [b % self.num_kv_blocks for b in range(3)]
        spans = [SeqSpan(0, 1, 1, blocks[:1]), SeqSpan(1, chunk, chunk, blocks)]
        with torch.inference_mode():
            for step_spans, no_context in ((spans, False), (spans[:1], True)):
                num_tokens = sum(s.num_query_tokens for s in step_spans)
                meta = StepMetadata.build(step_spans, [0] * num_tokens, self.block_size,
                                          self._staging, logits_indices=[0])
                meta.slot_mapping.fill_(-1)
                if no_context:
                    meta = replace(meta, max_seq_len=None)
                hidden = self.forward(meta.input_ids, meta.positions,
                                      self.backend.prepare(meta), self.kv_caches)
                self.sampler.sample_on_device(self.model.compute_logits(hidden[:1]), None, ())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            log.info("kernels compiled (%s attention, %s layers), %.1f s", self.backend.name,
                     "fused" if self.uses_fused_layers else "torch", time.perf_counter() - start)
            if self.graphs is not None:
                self.graphs.capture_all()
        return time.perf_counter() - start

    # ---- properties -------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return self._config

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The model folder's tokenizer, loaded on first use (workers only need ids)."""
        return Tokenizer(self.model_path)

    @property
    def vocab_size(self) -> int:
        return self._config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._config.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self._config.max_model_len

    @property
    def num_params(self) -> int:
        # parameters() yields a tied tensor once, so it is counted once.
        return sum(p.numel() for p in self.model.parameters())

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        return self.block_size * self._kv_bytes_per_token

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    def held_block_ids(self) -> set[int]:
        return {b for state in self._requests.values() for b in state.block_ids.tolist()}

    def reset(self) -> None:
        """Drop every request (a restarted controller knows none of them; its pool is
        fresh, so the KV rows left behind are never read as a cached prefix)."""
        self._requests.clear()
        if self._grammars is not None:
            self._grammars.clear()
        self._launched = False  # a step launched and never waited for is forgotten too

    # ---- plan diffs -------------------------------------------------------------------------
    def _check_blocks(self, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_kv_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} outside the pool of {self.num_kv_blocks}")

    def _add_request(self, new: NewRequestData) -> None:
        self._check_blocks(new.block_ids)
        state = RequestState(
            token_ids=list(new.token_ids),
            num_computed=new.num_computed_tokens,
            num_admitted_tokens=len(new.token_ids),
            num_output_tokens=new.num_output_tokens,
            sampling_params=new.sampling_params,
        )
        state.add_blocks(new.block_ids)
        self._requests[new.request_id] = state
        if new.sampling_params.grammar_kind:  # its matcher, rebuilt from its output tokens
            outputs = new.token_ids[len(new.token_ids) - new.num_output_tokens :]
            self.grammars.add(new.request_id, new.sampling_params, outputs)

    def _update_request(self, cached: CachedRequestData) -> None:
        state = self._state(cached.request_id)
        self._check_blocks(cached.new_block_ids)
        state.add_blocks(cached.new_block_ids)
        # The controller's count is authoritative (it may roll back a timed-out chunk).
        if cached.num_computed_tokens > len(state.token_ids):
            raise ValueError(f"{cached.request_id}: num_computed beyond the known tokens")
        state.num_computed = cached.num_computed_tokens

    def _state(self, request_id: str) -> RequestState:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"worker holds no request {request_id!r}") from None

    # ---- execution --------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step and return its result (`wait(launch(plan))`)."""
        return self.wait(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        """Apply the plan's diff and start the step: on CUDA everything up to the sampled ids
        is queued on the device (their copy to pinned host memory too) and this returns
        while the device runs, so the caller may plan the next step meanwhile; on CPU the
        step has run when this returns. At most one step is launched and not yet waited
        for: the next plan's inputs include the tokens this one samples."""
        if self._launched:
            raise RuntimeError("a launched step was not waited for")
        try:
            pending = self._launch(plan)
        except BaseException:
            self._launched = False  # nothing runs that `wait` could take
            raise
        self._launched = True
        return pending

    def _launch(self, plan: StepPlan) -> PendingStep:
        start_s = time.perf_counter()
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        for request_id in plan.finished_request_ids:  # first: a preempted id may come back new
            self._requests.pop(request_id, None)
            if self._grammars is not None:
                self._grammars.drop(request_id)
        moves = None
        if plan.block_moves:
            moves = self._remap_blocks(plan.block_moves)
        for new in plan.new_requests:
            self._add_request(new)
        for cached in plan.cached_requests:
            self._update_request(cached)

        # Flat batch order: decodes (1-token spans) first, longest context first, then the
        # multi-token spans (what the attention backends expect, workers/attention); `spans`
        # itself keeps the plan's order (events and results follow it).
        scheduled: list[tuple[str, RequestState, int, int]] = []
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            if num_tokens <= 0:
                continue
            state = self._state(request_id)
            begin, end = state.num_computed, state.num_computed + num_tokens
            if end > len(state.token_ids):
                raise ValueError(
                    f"{request_id}: scheduled up to token {end}, only {len(state.token_ids)} known"
                )
            if end > self._config.max_model_len:
                raise ValueError(
                    f"{request_id}: {end} tokens exceed max_model_len {self._config.max_model_len}"
                )
            scheduled.append((request_id, state, begin, num_tokens))
        self._check_burst(plan, scheduled)
        if self.kv_provenance is not None:  # before the forward: a failed step writes no KV
            self.kv_provenance.check_step(plan.block_moves, scheduled)
        pending = PendingStep(plan, start_s, start_event=start_event)
        if not scheduled:
            if moves is not None:
                self._copy_blocks(*(torch.from_numpy(a).to(self.device) for a in moves))
            pending.end_s = time.perf_counter()
            return pending
        flat = sorted(scheduled, key=lambda s: (s[3] != 1, -(s[2] + s[3]) if s[3] == 1 else 0))
        input_ids: list[int] = []
        by_id: dict[str, SeqSpan] = {}
        for request_id, state, begin, num_tokens in flat:
            by_id[request_id] = SeqSpan(len(input_ids), num_tokens, begin + num_tokens,
                                        state.block_ids)
            input_ids.extend(state.token_ids[begin : begin + num_tokens])
        spans = {request_id: by_id[request_id] for request_id, *_ in scheduled}
        sampling_ids = [
            rid for rid, span in spans.items()
            if span.context_len == len(self._requests[rid].token_ids)
        ]
        last_rows = [spans[r].query_start + spans[r].num_query_tokens - 1 for r in sampling_ids]
        pending.spans, pending.sampling_ids = spans, sampling_ids

        flat_spans = [by_id[request_id] for request_id, *_ in flat]
        bucket = None
        if self.graphs is not None and len(input_ids) == len(flat_spans):  # decode-only
            width = max(-(-span.context_len // self.block_size) for span in flat_spans)
            bucket = self.graphs.bucket_for(len(flat_spans), width)
        sample_rows = [
            SamplingRow(self._requests[rid].sampling_params, self._requests[rid].num_output_tokens)
            for rid in sampling_ids
        ]
        # On CUDA the random rows' sampling parameters ride in the same upload (no sync).
        sampling = (self.sampler.device_sampling(sample_rows) if self.device.type == "cuda"
                    else None)
        # One host build and one copy to the device for the whole step (attention/metadata.py).
        extra = (() if sampling is None else sampling.arrays) + (() if moves is None else moves)
        meta = StepMetadata.build(flat_spans, input_ids, self.block_size, self._staging,
                                  logits_indices=last_rows, pad_to=bucket, extra=extra)
        sampling_inputs = meta.extra[: len(extra) - (0 if moves is None else 2)]
        if moves is not None:  # before the forward reads them, from the same upload
            self._copy_blocks(*meta.extra[-2:])
        sampled = None
        if bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.run(meta)  # [bucket, hidden], padding rows past the real ones
        else:
            attn = self.backend.prepare(meta)
            sampled = self._sampled_rows(meta, spans, sampling_ids)
            forward = self.forward if sampled is None else partial(self.model, sampled=sampled)
            hidden = forward(meta.input_ids, meta.positions, attn, self.kv_caches)
        hidden = hidden[: meta.num_real_tokens]  # [T, hidden]; [S, hidden] when `sampled`

        rows = hidden if sampled is not None else hidden[meta.logits_indices]  # [S, hidden]
        if self._is_screened(sampling_ids):  # greedy rows only: ids from the lm_head screen
            return self._screen(pending, hidden, rows)
        if self.keep_logits:
            all_logits = self.model.compute_logits(hidden)  # [T, vocab]
            for rid, span in spans.items():
                span_rows = all_logits[span.query_start : span.query_start + span.num_query_tokens]
                self.span_logits[rid] = span_rows.cpu()
                self.last_logits[rid] = span_rows[-1].cpu()
            logits = all_logits[meta.logits_indices]
        else:
            logits = self.model.compute_logits(rows)  # [S, vocab]
        raw_logits = self._apply_grammars(logits, sampling_ids)  # scored: before the mask
        if self.device.type == "cuda":
            # The step's one device-to-host copy, queued behind the step: into pinned memory,
            # so that it runs asynchronously; `wait` reads it once `done` has passed.
            ids = self.sampler.sample_on_device(logits, sampling, sampling_inputs)
            self._score(pending, hidden, raw_logits, ids)
            pending.host_ids = self._pinned_ids(len(sample_rows))
            pending.host_ids.copy_(ids, non_blocking=True)
            pending.done = torch.cuda.Event(enable_timing=True)
            pending.done.record()
        else:
            pending.tokens = self.sampler(logits, sample_rows)
            self._score(pending, hidden, raw_logits,
                        torch.tensor(pending.tokens, dtype=torch.long))
            pending.end_s = time.perf_counter()  # the step has run: its time ends here
        return pending

    def wait(self, pending: PendingStep) -> StepResult:
        """The result of the launched step: blocks until the device has run it. Its
        `elapsed_s` is the step's own time (on CUDA the device's, from the launch to the
        sampled ids on the host), not the time the caller spent between the two calls."""
        if not self._launched:
            raise RuntimeError("no launched step to wait for")
        self._launched = False
        result = self._wait_one(pending)
        if pending.plan.num_steps > 1:
            self._run_burst(pending, result)
        return self._sample_telemetry(result)

    def _remap_blocks(self, moves: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Defragmentation, host side: the requests' block tables follow the moves at once;
        -> (sources, destinations), whose K/V rows `_copy_blocks` moves (on CUDA from the
        step's metadata upload: no pageable copy, no sync)."""
        self._check_blocks([*moves, *moves.values()])
        for state in self._requests.values():
            state.block_ids[:] = [moves.get(b, b) for b in state.block_ids.tolist()]
        return (np.fromiter(moves, np.int64, len(moves)),
                np.fromiter(moves.values(), np.int64, len(moves)))

    def _copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        """Sources and destinations are disjoint sets (the controller moves used blocks from
        above the compact region into free slots below it), so one batched index copy per
        tensor is exact."""
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
