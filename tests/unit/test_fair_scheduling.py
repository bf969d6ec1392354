"""Scheduling that serves everyone, through `ControllerCore` with the real scheduler, a fake
worker and injected time (deterministic): short prompts never queue behind a long one,
chunks are sized per depth by the cost model, and a drifting worker is refitted online."""

from __future__ import annotations

import itertools

from controller.budget import LinearFit, StepCost
from controller.core import ControllerCore, PoolSpec
from controller.messages import SamplingParams, StepPlan
from controller.options import ControllerOptions
from controller.protections import ProtectionConfig
from controller.scheduler import SchedulerConfig
from controller.slo import SloConfig
from tests.unit.fake_runner import FakeRunner

BLOCK = 16
NUM_USERS = 8
# A quadratic attention term (c): a chunk at depth 6000 costs far more than one at depth 0.
TRUE_COST = StepCost(LinearFit(5e-3, 2e-5, 6e-9), LinearFit(4e-3, 1e-4, 5e-9), tile=16)
SLO_S = 0.05
CHUNK_EFFICIENCY = 0.9


class Scene:
    """One worker: the core's step verb in virtual time. `cost` set: the worker's steps take
    `factor` x what `cost` predicts for the plan (every chunk event reports the whole step's
    time, as the real worker does) and the scheduler sizes chunks with `model`."""

    def __init__(self, budget: int = 256, num_blocks: int = 4096,
                 model: StepCost | None = None, cost: StepCost | None = None,
                 protections: ProtectionConfig | None = None, slo: SloConfig | None = None,
                 depth_stretch: float = 1.0, refit_slo_scale: float = 1.0,
                 **scheduler: object) -> None:
        self.now = 0.0
        self.core = ControllerCore(
            [PoolSpec(num_blocks, BLOCK, False)], ControllerOptions(
                scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                          **scheduler),  # type: ignore[arg-type]
                protections=protections or ProtectionConfig(), slo=slo or SloConfig(),
                step_cost=model, itl_slo_s=SLO_S if model is not None else None,
                depth_stretch=depth_stretch, chunk_efficiency=CHUNK_EFFICIENCY,
                refit_slo_scale=refit_slo_scale),
            clock=lambda: self.now)
        self.sched = self.core.scheduler(0)
        self.runner = FakeRunner(self.sched)
        self.cost, self.factor = cost, 1.0
        self.plans: list[StepPlan] = []
        self.step_times: list[float] = []
        self.first_token_step: dict[str, int] = {}
        self.finished: set[str] = set()

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request([(i % 90) + 1 for i in range(prompt_len)], params,
                              request_id=rid)

    def step(self) -> StepPlan:
        plan = self.core.begin_step(0)
        shape = self.sched.last_shape
        result = self.runner.execute(plan)
        if self.cost is not None:
            step_s = self.factor * self.cost.step_s(list(shape.chunks.values()),
                                                    shape.num_decodes, shape.decode_context)
            result.elapsed_s = step_s
            for event in result.chunk_events:
                event.elapsed_s = step_s
            self.step_times.append(step_s)
        for out in self.core.finish_step(0, plan, result):
            if out.num_output_tokens == 1 and out.new_token_ids:
                self.first_token_step.setdefault(out.request_id, len(self.plans))
            if out.finished:
                self.finished.add(out.request_id)
        self.plans.append(plan)
        self.now += 0.01
        return plan

    def users_decoding(self) -> None:
        for i in range(NUM_USERS):
            self.add(f"user-{i}", 32, max_tokens=400)
        while len(self.first_token_step) < NUM_USERS:
            self.step()


def test_short_prompt_behind_a_long_one_gets_its_first_token_within_two_steps():
    """Budget 256, 8 users decoding, a 4000-token prompt lands, a 32-token prompt two
    steps later: the short one is admitted at once, users never miss a step, the long one
    finishes."""
    s = Scene(budget=256)
    s.users_decoding()
    s.add("long", 4000, max_tokens=4)
    s.step()
    s.step()
    arrival = len(s.plans)
    s.add("short", 32, max_tokens=4)
    while "long" not in s.finished:
        plan = s.step()
        users = [f"user-{i}" for i in range(NUM_USERS)]
        assert all(plan.num_scheduled_tokens.get(u) == 1 for u in users)  # never a miss
        assert plan.total_num_scheduled_tokens <= 256
        assert len(s.plans) < 200
    assert s.first_token_step["short"] - arrival < 2  # its first step samples it
    # The long prompt kept moving while the short one was served.
    assert s.first_token_step["long"] - arrival <= 4000 // (256 - NUM_USERS) + 3


def test_a_stream_of_short_prompts_never_starves_the_long_one():
    s = Scene(budget=256)
    s.users_decoding()
    s.add("long", 4000, max_tokens=2)
    arrivals: dict[str, int] = {}
    for k in range(60):
        rid = f"short-{k}"
        arrivals[rid] = len(s.plans)
        s.add(rid, 48, max_tokens=2)
        s.step()
    assert "long" in s.first_token_step  # finished its prefill under the stream
    long_chunks = [p.num_scheduled_tokens.get("long", 0) for p in s.plans[-60:]]
    assert sum(long_chunks) >= 4000
    for rid, step in arrivals.items():
        if rid in s.first_token_step:
            assert s.first_token_step[rid] - step < 2, rid
    assert sum(rid in s.first_token_step for rid in arrivals) >= 59


def test_long_prompts_are_chunked_one_at_a_time_and_do_not_block_short_ones():
    s = Scene(budget=512, max_long_partial_prefills=1)
    s.add("long-a", 3000, max_tokens=2)
    s.add("long-b", 3000, max_tokens=2)
    s.add("short", 40, max_tokens=2)
    plan = s.step()
    assert "long-a" in plan.num_scheduled_tokens and "long-b" not in plan.num_scheduled_tokens
    assert plan.num_scheduled_tokens["short"] == 40  # passed the waiting long-b
    while "long-a" in s.sched.requests and s.sched.requests["long-a"].is_prefilling:
        plan = s.step()
        assert not ("long-a" in plan.num_scheduled_tokens and "long-b" in
                    plan.num_scheduled_tokens and s.sched.requests["long-a"].is_prefilling)
    while s.core.has_unfinished():
        s.step()
    assert {"long-a", "long-b", "short"} <= s.finished


def test_chunks_shrink_with_depth_and_every_step_stays_under_the_slo():
    """Cost model with a quadratic attention term, the scheduler sizing chunks with it:
    later chunks of a long prompt are smaller, every step (users' decodes included) is
    under the SLO in the model's time, and chunks sharing a step are charged their share."""
    s = Scene(budget=8192, model=TRUE_COST, cost=TRUE_COST)
    s.users_decoding()
    start = len(s.plans)
    s.add("long", 8000, max_tokens=2)
    while "long" not in s.first_token_step:
        s.step()
    chunks = [p.num_scheduled_tokens["long"] for p in s.plans[start:]
              if "long" in p.num_scheduled_tokens]
    assert len(chunks) > 3
    assert all(b <= a for a, b in itertools.pairwise(chunks[:-1]))  # the last: the rest
    assert chunks[-2] < 0.6 * chunks[0]
    assert all(c % BLOCK == 0 for c in chunks[:-1])  # on the grid
    assert max(s.step_times[start:]) <= SLO_S
    assert max(s.step_times[start:]) > 0.8 * SLO_S  # the SLO is used, not wasted
    prot = s.core.workers[0].protections.stats
    assert prot.num_deviations == 0  # each chunk charged its share: the model holds
    assert abs(prot.last_budget_score - 1.0) < 1e-6


# CPU-like: a step's fixed cost is a fifth of the SLO, attention dominates deep in a prompt.
DEEP_COST = StepCost(LinearFit(10e-3, 4e-5, 4e-8), LinearFit(4e-3, 1e-4, 5e-9), tile=16)


def _long_prefill(depth_stretch: float) -> tuple[Scene, list[tuple[int, int]], float]:
    """8 users decoding, an 8,000-token prompt: its (context, chunk) per step and the model
    time to its first token."""
    s = Scene(budget=8192, model=DEEP_COST, cost=DEEP_COST, depth_stretch=depth_stretch)
    s.users_decoding()
    start = len(s.plans)
    s.add("long", 8000, max_tokens=2)
    context, chunks = 0, []
    while "long" not in s.first_token_step:
        plan = s.step()
        if "long" in plan.num_scheduled_tokens:
            chunks.append((context, plan.num_scheduled_tokens["long"]))
            context += plan.num_scheduled_tokens["long"]
    return s, chunks, sum(s.step_times[start:])


def test_a_deep_chunk_stretches_its_step_to_stay_efficient_within_the_bound():
    """With a depth stretch (the derived SLO's), deep chunks stay efficient at their depth
    instead of shrinking into the step's fixed cost: fewer, larger chunks, the prompt's first
    token sooner, no step past stretch x SLO, and the first (depth 0) chunk unchanged."""
    _, plain_chunks, plain_s = _long_prefill(1.0)
    s, chunks, stretched_s = _long_prefill(2.0)
    assert chunks[0] == plain_chunks[0]  # depth 0: the SLO's chunk
    assert max(s.step_times) <= 2.0 * SLO_S + 1e-9
    assert max(s.step_times) > SLO_S  # the stretch was used
    assert len(chunks) < 0.8 * len(plain_chunks)
    assert stretched_s < 0.97 * plain_s  # the fixed costs of the steps it saved
    cost = DEEP_COST
    shape = s.sched.last_shape
    for context, tokens in chunks[1:-1]:
        # Each deep chunk: efficient at its depth, or as large as the stretched SLO allows.
        best = max(t / cost.chunk_s(t, context) for t in range(BLOCK, 8192 + 1, BLOCK))
        step_s = cost.step_s([(tokens, context)], NUM_USERS, shape.decode_context)
        bigger = cost.step_s([(tokens + BLOCK, context)], NUM_USERS, shape.decode_context)
        assert tokens / step_s >= 0.85 * CHUNK_EFFICIENCY * best or bigger > 2.0 * SLO_S


def test_worker_twice_as_slow_is_refitted_within_the_window_and_steps_return_under_slo():
    window = 8
    prot = ProtectionConfig(refit_window=window)
    s = Scene(budget=8192, model=TRUE_COST, cost=TRUE_COST, protections=prot)
    s.users_decoding()
    for i in range(16):
        s.add(f"long-{i}", 4000, max_tokens=2)
    for _ in range(10):
        s.step()
    assert max(s.step_times[-10:]) <= SLO_S
    s.factor = 2.0  # the device gets twice as slow, mid-run
    changed = len(s.plans)
    stats = s.core.worker_stats
    while stats(0).num_refits == 0:
        s.step()
        assert len(s.plans) - changed <= window, "no refit within the window"
    refit_at = len(s.plans)
    assert max(s.step_times[changed:refit_at]) > SLO_S  # the drift did break the SLO
    for _ in range(15):
        s.step()
    after = s.step_times[refit_at:]
    assert after and max(after) <= SLO_S * 1.001
    assert stats(0).num_refits == 1  # one drift, one refit
    model = s.core.workers[0].step_cost
    assert model is not None
    assert abs(model.step_s([(256, 1000)], 8, 100) / TRUE_COST.step_s([(256, 1000)], 8, 100)
               - 2.0) < 0.05


def noisy_scene(slo: SloConfig) -> Scene:
    noise = itertools.cycle([1.0, 0.95, 1.15, 1.05, 0.97, 1.1, 1.0, 1.12])
    s = Scene(budget=8192, model=TRUE_COST, cost=TRUE_COST, slo=slo)
    s.users_decoding()
    for i in range(8):
        s.add(f"long-{i}", 4000, max_tokens=2)
    for _ in range(40):
        s.factor = next(noise)
        s.step()
    return s


def test_noisy_steps_are_planned_with_headroom_so_the_slow_ones_stay_under_the_slo():
    """A worker whose steps run 0.95-1.15x the model's time (noise, not drift: no refit).
    Planned to the SLO itself (no headroom allowed), every step slower than the model
    breaks it; with the measured headroom (the slowest measured / predicted of the recent
    steps) none does once the noise's worst was seen, and the room kept is that worst."""
    bare = noisy_scene(SloConfig(max_headroom=1.0))
    kept = noisy_scene(SloConfig())
    stats = kept.core.worker_stats(0)
    assert abs(stats.slo_headroom - 1.15) < 1e-9 and stats.num_refits == 0
    assert bare.core.worker_stats(0).slo_headroom == 1.0

    def over_slo(scene: Scene) -> list[float]:
        warm = scene.step_times[10:]  # once a few steps measured the noise
        return [t / SLO_S for t in warm if t > SLO_S * 1.001]

    assert len(over_slo(bare)) >= 6 and max(over_slo(bare)) > 1.1
    assert not over_slo(kept)
    assert max(kept.step_times[10:]) > 0.9 * SLO_S  # the room kept is the noise, no more


def test_one_chunk_a_step_lets_a_short_prompt_take_turns_with_the_long_one():
    """Flow control or the degraded path leaves one chunk a step: a short prompt behind a
    long prompt's prefill still gets its first token within two steps (they alternate),
    and under a stream of short prompts the long one still gets every other chunk."""
    s = Scene(budget=256, max_concurrent_chunks=1)
    s.users_decoding()
    s.add("long", 8000, max_tokens=2)  # still prefilling after the 41 steps below
    s.step()
    arrivals: dict[str, int] = {}
    for k in range(20):  # one short prompt every other step: as many as the turns serve
        rid = f"short-{k}"
        arrivals[rid] = len(s.plans)
        s.add(rid, 32, max_tokens=2)
        s.step()
        s.step()
    for rid, step in arrivals.items():
        assert s.first_token_step[rid] - step <= 2, rid
    long_steps = sum("long" in p.num_scheduled_tokens for p in s.plans[-40:])
    assert long_steps >= 19  # every other step at least


def test_a_short_prompt_deep_in_a_long_prefill_rides_in_a_step_held_to_the_slo():
    """The short prompt's first token comes at the end of the step it rides in: deep in a
    long prompt, where chunks stretch their steps past the SLO to stay efficient, that
    step is held to the SLO, the short prompt's time taken out of the long chunk. (Served,
    a deep chunk that counted the reserved short tokens as its own overhead grew instead,
    and the step carrying a 32-token prompt took 1.6x a chunk step.)"""
    s = Scene(budget=8192, model=DEEP_COST, cost=DEEP_COST, depth_stretch=2.0,
              long_prefill_token_threshold=512)
    s.users_decoding()
    s.add("long", 8000, max_tokens=2)
    while sum(p.num_scheduled_tokens.get("long", 0) for p in s.plans) < 3000:
        s.step()
    assert s.step_times[-1] > SLO_S  # the long prompt's steps are stretched here
    s.add("short", 32, max_tokens=2)
    plan = s.step()
    assert plan.num_scheduled_tokens["short"] == 32 and plan.num_scheduled_tokens["long"] > 0
    assert s.first_token_step["short"] == len(s.plans) - 1
    assert s.step_times[-1] <= SLO_S
    s.step()  # the short prompt decodes now: the long chunk stretches again
    assert s.step_times[-1] > SLO_S


def _step_with_a_short_prompt(short_step_share: float) -> tuple[Scene, StepPlan]:
    s = Scene(budget=8192, model=TRUE_COST, cost=TRUE_COST,
              long_prefill_token_threshold=512, short_step_share=short_step_share)
    s.users_decoding()
    s.add("long", 6000, max_tokens=2)
    for _ in range(3):
        s.step()
    s.add("short", 32, max_tokens=2)
    return s, s.step()


def test_a_step_carrying_a_waiting_short_prompt_is_planned_to_a_share_of_the_slo():
    """The short prompt's first token ends the step it rides in, so that step is planned to
    `short_step_share` of the SLO: the long chunk beside it shrinks, and the short prompt
    waits for the running step's rest and half a step, not a whole one. The step after
    (the short prompt decoding) is the SLO's again."""
    s, plan = _step_with_a_short_prompt(0.5)
    whole, whole_plan = _step_with_a_short_prompt(1.0)
    for scene, p in ((s, plan), (whole, whole_plan)):
        assert p.num_scheduled_tokens["short"] == 32 and p.num_scheduled_tokens["long"] > 0
        assert scene.first_token_step["short"] == len(scene.plans) - 1
    assert s.step_times[-1] <= 0.5 * SLO_S + 1e-9
    assert whole.step_times[-1] > 0.9 * SLO_S  # without the share: a whole step
    assert plan.num_scheduled_tokens["long"] < 0.6 * whole_plan.num_scheduled_tokens["long"]
    s.step()
    assert s.step_times[-1] > 0.9 * SLO_S


def _slower_after_refit(refit_slo_scale: float, factor: float = 1.5) -> Scene:
    s = Scene(budget=8192, model=TRUE_COST, cost=TRUE_COST,
              protections=ProtectionConfig(refit_window=8), refit_slo_scale=refit_slo_scale)
    s.users_decoding()
    s.factor = factor  # served steps this many times what the calibration measured
    for i in range(8):
        s.add(f"long-{i}", 4000, max_tokens=2)
    while s.core.worker_stats(0).num_refits == 0:
        s.step()
        assert len(s.plans) < 100
    for _ in range(3):
        s.step()
    return s


def test_a_refit_moves_a_derived_slo_so_chunks_keep_their_size():
    """The derived SLO is the step in which a chunk prefills efficiently: on a worker whose
    steps take 1.5x the calibrated time, a refit moves it to 1.5x, and the chunks keep the
    calibrated size (the steps take 1.5x the old SLO); with the SLO fixed (a configured
    one) the chunks shrink to fit it. Bounded: a 4x slower worker moves it 2x at most. A
    faster worker leaves it: larger chunks fit the SLO's time."""
    moved, fixed = _slower_after_refit(2.0), _slower_after_refit(1.0)
    assert abs(moved.sched.itl_slo_s - 1.5 * SLO_S) < 1e-6
    assert fixed.sched.itl_slo_s == SLO_S
    assert max(fixed.step_times[-3:]) <= SLO_S * 1.001
    assert 1.3 * SLO_S < max(moved.step_times[-3:]) <= 1.5 * SLO_S * 1.001

    def chunk(scene: Scene) -> int:
        return sum(n for rid, n in scene.plans[-1].num_scheduled_tokens.items()
                   if rid.startswith("long"))

    assert chunk(moved) > 1.2 * chunk(fixed)
    s = Scene(budget=8192, model=TRUE_COST, cost=TRUE_COST,
              protections=ProtectionConfig(refit_window=8), refit_slo_scale=2.0)
    s.users_decoding()
    s.factor = 4.0
    s.add("long", 8000, max_tokens=2)
    while s.core.worker_stats(0).num_refits == 0:
        s.step()
    assert abs(s.sched.itl_slo_s - 2.0 * SLO_S) < 1e-9
    faster = _slower_after_refit(2.0, factor=0.6)
    assert faster.sched.itl_slo_s == SLO_S
    assert SLO_S * 0.9 < max(faster.step_times[-3:]) <= SLO_S * 1.001
