"""The controller actor's configuration: the worker, KV cache and cluster sections, and
`ControllerOptions`, which nests every section the actor and its core take.

Ray-, torch- and pydantic-free so `cluster.config` can validate and build them without
importing Ray; the controller does not import the composition root (`cluster/`), which
owns the full configuration (`TokenflowConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args, get_type_hints

from controller.autoscale import ScalingConfig
from controller.budget import AutoBudget, BudgetTable, StepCost
from controller.calibration import CalibrationConfig
from controller.flow import FlowConfig
from controller.journal_records import JournalConfig
from controller.protections import ProtectionConfig
from controller.recovery import RecoveryConfig
from controller.scheduler import SchedulerConfig
from controller.settings import FORBID_EXTRA, check_settings, check_thread_count, setting
from controller.slo import SloConfig
from controller.worker_state import DegradedConfig


@dataclass(frozen=True)
class WorkerConfig:
    """The model and the worker actors that run it (`worker:` in the configuration)."""

    __pydantic_config__ = FORBID_EXTRA

    model: str = setting("builtin:tiny", description=(
        "Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) of the "
        "Llama family, or a built-in preset: builtin:tiny (default), builtin:small or "
        "builtin:bench."))
    served_model_name: str | None = setting(None, description=(
        "Name clients pass as `model`; defaults to the `model` value."))
    dtype: str = setting("float32", description=(
        "Weights, activations and KV cache dtype: float32, bfloat16 or float16. float32 is "
        "token-exact against transformers; bfloat16 on a CPU with AMX or AVX512-BF16 runs "
        "oneDNN's packed bf16 GEMMs (several times fp32's rate) within bf16 rounding "
        "(tests/workers/test_cpu_bf16.py states the tolerance)."))
    device: str = setting("auto", description=(
        "auto (CUDA when present, else CPU), cpu or cuda."))
    seed: int = setting(0, description="Seed of the workers' sampler for unseeded requests.")
    num_workers: int = setting(1, ge=1, description=(
        "CPU worker actors to start when no GPU is present (one per GPU otherwise)."))
    max_model_len: int = setting(8192, ge=1, description="Prompt + output tokens at most.")
    default_max_tokens: int = setting(256, ge=1, description=(
        "max_tokens when a request does not set it."))
    telemetry: bool = setting(True, description=(
        "Sample memory-bandwidth utilisation every step (NVML on NVIDIA GPUs, an estimate "
        "on CPU) for the bandwidth modes; off, those modes never trigger."))
    peak_bandwidth_gbs: float | None = setting(None, gt=0, description=(
        "Peak memory bandwidth (GB/s) for the CPU bandwidth estimate; None measures it "
        "at worker start."))
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = setting(
        "auto", description=(
            "auto: the paged Triton kernels on CUDA; on CPU `cpu` (decode rows in one C++ "
            "kernel reading the paged cache in place, chunks on SDPA) where its kernels "
            "build, else `torch` (SDPA over gathered blocks, the reference); torch, cpu or "
            "triton to force one (triton on CPU only under the Triton interpreter)."))
    cuda_graphs: bool = setting(True, description=(
        "Replay CUDA graphs for decode-only steps on CUDA (captured per batch-size bucket "
        "on first use); mixed steps run eagerly."))
    max_graph_batch: int = setting(256, ge=1, description=(
        "Largest decode batch replayed from a CUDA graph; larger ones run eagerly."))
    cpu_packed_weights: bool = setting(True, description=(
        "On a CPU fp32 worker, keep oneDNN-packed copies of the linear layers' weights "
        "(decode GEMMs skip the per-call re-pack; costs one extra copy of those weights)."))
    cpu_packed_min_rows: int = setting(8, ge=1, description=(
        "Rows from which a packed layer calls its packed copy; fewer rows take the plain "
        "GEMM, whose call overhead is lower."))
    cpu_packed_min_elements: int = setting(1 << 17, ge=1, description=(
        "Weights smaller than this (elements) get no oneDNN-packed copy (the C++ decode "
        "GEMM's copy, `cpu_decode_gemm_max_rows`, still applies)."))
    cpu_packed_any_rows_elements: int = setting(1 << 20, ge=1, description=(
        "Weights of at least this many elements use the packed copy for any row count."))
    cpu_decode_gemm_max_rows: int = setting(64, ge=0, description=(
        "On a CPU fp32 worker whose C++ kernels build, a packed linear layer called with up "
        "to this many rows (a decode step, a few decodes beside a short chunk) runs the "
        "C++ GEMM (workers/kernels/csrc/cpu_gemm.cpp), which prefetches the next block of "
        "the weight while it computes one where `cpu_gemm_prefetch` keeps that: 1.3-1.6x "
        "oneDNN's packed kernel at 1-32 rows on an AVX-512 Xeon, even at 96, behind it "
        "from 128; on AVX2 with FMA (a Zen 3) 1.2-1.4x at 8-64 rows. Only where the build "
        "has AVX-512 or AVX2 with FMA (oneDNN's elsewhere). Costs another copy of the layer "
        "weights; 0: never (oneDNN's kernel or the plain GEMM)."))
    cpu_fused_layers: bool = setting(True, description=(
        "On a CPU fp32 or bf16 worker whose C++ kernels build, the residual add + RMSNorm, "
        "rotary and SiLU-and-mul run as one C++ pass each (workers/kernels/csrc/cpu_layers.cpp) "
        "instead of 2-8 torch operators each; False keeps the operators (the reference). "
        "fp32: rotary is bit-equal, the norm's sum and SiLU's exp round within a few ulp; "
        "bf16: each pass rounds once, where the operators round after each."))
    cpu_sampled_last_layer: bool = setting(True, description=(
        "On a CPU fp32 or bf16 worker with the C++ layers, a step's last layer computes K/V for "
        "every row but its attention, o_proj, MLP and final norm only for the rows that "
        "sample (one per request finishing its prompt or decoding): no other row's output "
        "is read (workers/sampled_rows.py). Off where a request asks for prompt "
        "log-probabilities. False runs the last layer on every row."))
    cpu_greedy_screen: bool = setting(True, description=(
        "On a CPU fp32 worker with bf16 units (AMX or AVX512-BF16) or, without them, AVX2, "
        "a step whose sampling rows are all greedy, with no log-probs and no grammar, takes "
        "its ids from a bf16 or a per-row int16 copy of the lm_head (where a CPU without AMX "
        "has both, the one whose GEMM ran faster at the worker's start): the top 16 "
        "screened logits of a row are recomputed in fp32 when a bound on the copy's error "
        "proves the argmax is among them, else the row's whole fp32 logits "
        "(workers/greedy_head.py). The ids are the fp32 argmax's; the copy costs half the "
        "lm_head's fp32 bytes. False: every row's fp32 logits."))
    cpu_keep_freed_memory: bool = setting(True, description=(
        "On a CPU worker, have glibc's allocator serve allocations up to 32 MiB from its "
        "heap and keep freed memory instead of returning it to the system (mallopt), so a "
        "step's large activations reuse mapped pages instead of faulting in fresh ones "
        "(about a fifth of a 4,096-token prefill step on builtin:bench). The process's "
        "memory then stays near its peak."))
    cpu_decode_stack: bool = setting(True, description=(
        "On a CPU fp32 worker with the C++ layers and decode GEMM, a step whose rows are all "
        "decodes (at most `cpu_decode_gemm_max_rows`) runs its layers in one C++ call "
        "(workers/decode_stack.py) instead of the Python layer loop: the same kernels in the "
        "same order, bit-equal hidden states, without ~15 Python dispatches a layer. False: "
        "the loop."))
    cpu_gemm_prefetch: Literal["auto", "on", "off"] = setting("on", description=(
        "Whether the C++ decode GEMM (`cpu_decode_gemm_max_rows`) prefetches its weight's "
        "next block into L2 while it computes one (and a decode step's next GEMM's first): "
        "auto times both on the worker's own weights (their first 128 MB) at its start, 32 "
        "rows, and keeps the "
        "faster (workers/gemm_prefetch.py; ~0.1 s on builtin:bench). Which wins is the "
        "machine's: on a 2-core Xeon the prefetches took the 40 GEMMs from 7.8-8.3 to "
        "7.0-7.5 ms, on a 2-core Zen 4 host from 9.0 to 9.9, where LocalEngine ran 3-4 % "
        "faster offline without them; but served there, without them the peer scene's long "
        "prompt took 4.10-4.62 s against 3.43 with (vLLM's 3.46-3.96), so on by default. "
        "Results are the same either way; process-wide (the last worker built in a process "
        "sets it)."))
    cpu_bind_threads: bool = setting(True, description=(
        "A CPU worker actor whose torch threads are as many as the cores it may run on pins "
        "thread t to the t-th of them (as vLLM's CPU build binds its threads), so the "
        "scheduler does not move a step's threads onto a core another process holds "
        "(served, 2 cores: the users got 8-15 % more tokens/s in 7 of 7 paired rounds). Not "
        "done with fewer threads than cores (several workers on a node) nor in LocalEngine, "
        "whose process is the caller's. False: never."))
    check_kv_provenance: bool = setting(False, description=(
        "Debugging: before every step the worker checks that each KV slot it attends over "
        "was computed from the same tokens (workers/kv_provenance.py) and fails the step "
        "otherwise; a prefix hit or a block move gone wrong then fails loudly instead of "
        "changing an answer now and then. Costs a Python pass over each context per step; "
        "the integration tests' cluster runs with it."))
    num_threads: int | None = setting(None, description=(
        "torch intra-op threads of a CPU worker (actor or LocalEngine). None: the "
        "process's default: as many as the CPUs Ray reserves for an actor "
        "(cluster.worker_num_cpus rounded down, at least 1: Ray's OMP_NUM_THREADS), one "
        "per core in LocalEngine, and on the local cluster `make serve` starts the "
        "machine's cores divided among its CPU workers. Negative counts from the cores "
        "the process may run on, as joblib does: -1 every core, -2 all but one; never "
        "fewer than one; 0 is refused."))

    def __post_init__(self) -> None:
        check_settings(self)
        check_thread_count("worker.num_threads", self.num_threads)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def peak_bandwidth_bytes_s(self) -> float | None:
        return None if self.peak_bandwidth_gbs is None else self.peak_bandwidth_gbs * 1e9


@dataclass(frozen=True)
class CacheConfig:
    """Each worker's paged KV cache (`cache:` in the configuration)."""

    __pydantic_config__ = FORBID_EXTRA

    block_size: int = setting(16, ge=1, description="Tokens per KV block.")
    num_kv_blocks: int = setting(2048, ge=2, description=(
        "KV blocks per worker (the pool needs at least two)."))
    enable_prefix_caching: bool = setting(True, description=(
        "Share full KV blocks between requests with the same prefix (chained hashes)."))

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ClusterConfig:
    """Ray and Serve: actors' resources and lifetimes, the HTTP edge (`cluster:`)."""

    __pydantic_config__ = FORBID_EXTRA

    host: str = setting("127.0.0.1", description="HTTP bind address of the Serve ingress.")
    port: int = setting(8000, ge=1, le=65535, description="HTTP port of the Serve ingress.")
    namespace: str = setting("tokenflow", description="Ray namespace of the named actors.")
    redis_url: str | None = setting(None, description=(
        "Redis of the request journal (redis://host:port/db): a restarted controller "
        "resumes every unfinished request from it. None: no journal (the embedded default "
        "still serves; a controller restart then fails the open requests)."))
    worker_num_cpus: float = setting(0.5, gt=0, description=(
        "Ray CPUs reserved per CPU worker actor (fractional on small machines)."))
    worker_resource: str | None = setting(None, description=(
        "A custom Ray resource that marks where CPU workers may run, e.g. nodes started "
        "with `ray start --resources='{\"tokenflow_worker\": 2}'`: one worker per unit "
        "in the cluster at start, each taking one unit, so a node runs as many workers as "
        "it declares. None: worker.num_workers CPU workers wherever Ray has CPUs (one "
        "per GPU on GPU nodes either way). Workers are spread over nodes so that losing "
        "one node costs the fewest."))
    worker_overlap_calls: bool | None = setting(None, description=(
        "Whether a worker actor takes the next step's call while a step runs (Ray "
        "receives and decodes it on a second thread, beside the step). None: on GPU "
        "workers only, whose host thread is free while the device computes. On a CPU "
        "worker the step's OpenMP threads hold every core, and the call's work beside "
        "them stalls a parallel region each time it takes a core: on 2 cores a batch "
        "job's 32-row decode step took 50 ms with it and 40 ms without, the next call "
        "then waiting ~1 ms for Ray between steps (docs/peer.md)."))
    worker_max_restarts: int = setting(-1, ge=-1, description=(
        "Times Ray restarts a dead worker actor (-1: without limit). Its in-flight requests "
        "move to the other workers either way, and it rejoins routing once it is back."))
    worker_transport: Literal["actor_call", "compiled_graph"] = setting(
        "actor_call", description=(
            "How each step's plan reaches a worker actor. actor_call: one Ray actor call "
            "per step. compiled_graph: a Ray Compiled Graph per worker (shared-memory "
            "channels, no per-call scheduling), built at start and rebuilt after a worker "
            "restart; a worker whose graph cannot be built (compiling fails, its first "
            "empty step fails, or the thread the graph runs on is still held by a dead "
            "controller's graph) falls back to actor calls until it restarts. Not the "
            "default: against a short stand-in step on a small CPU machine it cut the step "
            "at 16 running requests, not at 128, where the controller's own work dominates "
            "(benchmarks/README.md has the figures); and Ray's "
            "channel readers poll, keeping a core busy in the controller and one in each "
            "worker even while idle."))
    compiled_graph_probe_s: float = setting(2.0, gt=0, description=(
        "How long a worker may take to answer a call on the thread its compiled graph "
        "would run on before it falls back to actor calls (a dead controller's graph "
        "holds that thread for good); the graph's first step then has "
        "recovery.ready_timeout_s."))
    controller_num_cpus: float = setting(0.25, ge=0, description=(
        "Ray CPUs reserved for the controller actor (it mostly waits on workers)."))
    controller_resource: str | None = setting(None, description=(
        "A custom Ray resource the controller actor takes one unit of, to pin it to the "
        "nodes that declare it; when its node dies, Ray restarts it on another such node "
        "and it resumes from the journal (cluster.redis_url). None: any node with "
        "controller_num_cpus free."))
    controller_max_restarts: int = setting(-1, ge=-1, description=(
        "Times Ray restarts a dead controller actor (-1: without limit). The workers "
        "outlive it (named, detached actors) and the restarted controller reattaches."))
    controller_max_concurrency: int = setting(10_000, ge=16, description=(
        "Concurrent calls the async controller accepts: one per open request stream."))
    detached_controller: bool = setting(False, description=(
        "Give the controller a detached lifetime, so it outlives the process that created "
        "it (`serve deploy` on a long-lived cluster); tests and `make serve` keep it owned."))
    ingress_num_cpus: float = setting(0.25, ge=0, description=(
        "Ray CPUs reserved per Serve ingress replica (tokenization, SSE)."))
    ingress_num_replicas: int = setting(1, ge=1, description="Serve ingress replicas.")
    direct_ingress: bool | None = setting(None, description=(
        "The ingress replica serves HTTP on host:port itself (Ray Serve's direct ingress), "
        "so a streamed token no longer passes through Serve's proxy actor on its way out; "
        "the proxy then listens on a free port and carries nothing. On 2 cores, in the "
        "peer scene (docs/peer.md), the users got 114 tok/s against 106 and the short "
        "prompt its first token in 0.44 s against 0.63. None (default): on where `python "
        "-m cluster.serve` starts its own Ray and ingress_num_replicas is 1 (one replica "
        "can own the port), else off. True with more replicas is refused."))
    ingress_max_ongoing_requests: int = setting(4096, ge=1, description=(
        "Requests one ingress replica holds at once (Serve's default of 5 would queue "
        "every further stream at the proxy, defeating continuous batching)."))
    retry_after_s: int = setting(1, ge=0, description=(
        "Retry-After header (seconds) of a 429 or 503 answer (queues full, no worker up, "
        "the service starting)."))
    ready_wait_s: float = setting(5.0, gt=0, description=(
        "How long /health and a request wait for the controller's answer before they get "
        "503 with Retry-After (never a hang while it restarts or its workers wait for "
        "resources)."))
    give_up_after_s: float = setting(300.0, gt=0, description=(
        "`make serve` exits non-zero when the service has not been healthy for this long, "
        "so that a supervisor restarts it."))

    def __post_init__(self) -> None:
        check_settings(self)
        if self.direct_ingress and self.ingress_num_replicas > 1:
            raise ValueError("cluster.direct_ingress needs cluster.ingress_num_replicas 1: "
                             "one replica owns the port (set it false to serve through "
                             "Serve's proxy)")
        kinds = get_args(get_type_hints(ClusterConfig)["worker_transport"])
        if self.worker_transport not in kinds:  # pydantic checks it, direct construction not
            raise ValueError(f"ClusterConfig.worker_transport must be one of {kinds}, got "
                             f"{self.worker_transport!r}")


@dataclass(frozen=True)
class ControllerOptions:
    """Built by `TokenflowConfig.controller_options()`: the sections as validated there,
    the scheduler with a budget file's numbers applied, and the resolved cost model."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    protections: ProtectionConfig = field(default_factory=ProtectionConfig)
    degraded: DegradedConfig = field(default_factory=DegradedConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    step_cost: StepCost | None = None  # a budget table's: chunks sized per step
    itl_slo_s: float | None = None  # what step_cost sizes chunks for
    # A chunk at depth may stretch its step to depth_stretch x itl_slo_s to reach
    # chunk_efficiency of its depth's best rate (the derived SLO only; 1: never).
    depth_stretch: float = 1.0
    # A refit may raise itl_slo_s up to x times (the derived SLO only; 1: never).
    refit_slo_scale: float = 1.0
    chunk_efficiency: float = 1.0
    worker_cls: str = "workers.actor:WorkerActor"  # "module:Class" of the worker actor
    # Set (calibration.auto without a budget file): before its scheduler config is final,
    # the controller has worker 0 load or measure the table on the worker's own device;
    # the four fields above are then replaced by `with_budget_table`.
    auto_budget: AutoBudget | None = None

    def with_budget_table(self, table: BudgetTable,
                          cal: CalibrationConfig) -> ControllerOptions:
        """These options running on `table`: its budget for the SLO (planned with `cal`'s
        limits), its cost model."""
        scheduler = budgeted_scheduler(self.scheduler, table, cal, self.slo, self.cache)
        derived = self.slo.itl_ms is None
        stretch = self.slo.max_depth_stretch if derived else 1.0
        return replace(self, scheduler=scheduler, step_cost=table.step_cost(),
                       itl_slo_s=table.slo_ms(self.slo.itl_ms) / 1e3, auto_budget=None,
                       depth_stretch=stretch, chunk_efficiency=cal.chunk_efficiency,
                       refit_slo_scale=self.slo.max_refit_slo_scale if derived else 1.0)


def budgeted_scheduler(scheduler: SchedulerConfig, table: BudgetTable, cal: CalibrationConfig,
                       slo: SloConfig, cache: CacheConfig) -> SchedulerConfig:
    """`scheduler` with the table's budget for the ITL SLO (the table wins), planned at
    depth 0 unless `cal` names one (the cost model shrinks deeper chunks step by step)."""
    context = 0 if cal.plan_context_tokens is None else cal.plan_context_tokens
    budget, _ = table.recommend(
        table.slo_ms(slo.itl_ms), block_size=cache.block_size,
        kv_capacity_tokens=cache.num_kv_blocks * cache.block_size, context=context,
        decodes=cal.plan_decodes)
    return replace(scheduler, max_num_batched_tokens=budget)
