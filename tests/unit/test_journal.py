"""The Redis journal against a real `redis-server` this module starts on a free port.

A `ControllerCore` with fake workers steps requests to their end while every step is
journaled, as the controller's step loop does. Shows: the keys a restart reads (the prompt,
the params with their seed, the generated tokens, chunk progress under
`prefill:{id}:chunk_{n}`), finished requests expiring, and Redis SIGKILLed mid-run and
restarted empty: every request still finishes with the same tokens, the journal counts the
pause and catches up (the running requests' keys are back with every token).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from controller.core import ControllerCore, ModelFacts, PoolSpec
from controller.journal import Journal, JournalConfig
from controller.messages import (
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from controller.options import ControllerOptions
from controller.request import Request
from controller.scheduler import SchedulerConfig
from controller.step_loop import StepLoop
from tests.redis_server import RedisServer
from tests.unit.fake_runner import FakeRunner

PARAMS = SamplingParams(max_tokens=12, temperature=0.7, seed=1234, ignore_eos=True,
                        stop_token_ids=(99,))
FLUSH_S = 30.0  # an upper bound on a wait for a condition, not a sleep


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


def make_core() -> tuple[ControllerCore, FakeRunner]:
    core = ControllerCore([PoolSpec(256, 4)], ControllerOptions(scheduler=SchedulerConfig(
        max_num_batched_tokens=32, max_chunk_tokens=8, max_num_seqs=64)),
        ModelFacts(vocab_size=100))
    return core, FakeRunner(core.scheduler(0), vocab_size=100)


class Driver:
    """The step loop's journal calls around `core.step`, and every token per request."""

    def __init__(self, journal: Journal | None) -> None:
        self.core, self.runner = make_core()
        self.journal = journal
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}

    def admit(self, request_id: str, prompt: list[int]) -> Request:
        request = self.core.add_request(prompt, PARAMS, request_id, priority=1, tenant="t1")
        self.tokens[request_id] = []
        if self.journal is not None:
            self.journal.admit(request)
        return request

    def step(self) -> list[RequestOutput]:
        chunk_events = []

        def execute(plan: StepPlan) -> StepResult:
            result = self.runner.execute(plan)
            chunk_events.extend(result.chunk_events)
            return result

        outputs = StepLoop.serial(self.core, 0, execute).step().outputs
        for out in outputs:
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                self.finish[out.request_id] = str(out.finish_reason)
        if self.journal is not None:
            self.journal.record_outputs(outputs)
            self.journal.record_chunks(chunk_events)
            self.journal.end_step()
        return outputs


def prompt(i: int) -> list[int]:
    return [(3 * i + 5 * j) % 97 + 1 for j in range(10 + 3 * i)]


def reference_run(num_requests: int, admit_at: dict[int, int]) -> Driver:
    driver = Driver(None)
    run_driver(driver, num_requests, admit_at)
    return driver


def run_driver(driver: Driver, num_requests: int, admit_at: dict[int, int],
               on_step: dict[int, object] | None = None) -> None:
    """Admit request i before step admit_at[i]; call on_step[n]() before step n."""
    on_step = on_step or {}
    for n in range(500):
        for i, at in admit_at.items():
            if at == n:
                driver.admit(f"r{i}", prompt(i))
        if n in on_step:
            on_step[n]()  # type: ignore[operator]
        driver.step()
        if len(driver.finish) == num_requests:
            return
    raise AssertionError("requests did not finish")


def wait_for_round_trips(journal: Journal, num: int) -> None:
    with journal._cond:
        assert journal._cond.wait_for(lambda: journal.num_round_trips >= num, FLUSH_S)


def test_token_progress_is_coalesced_and_admissions_are_written_at_once(server) -> None:
    """Steps' tokens wait out `write_interval_s` (here: forever) and then go in one round
    trip; an admission does not wait."""
    journal = Journal(server.url, JournalConfig(write_interval_s=3600.0))
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        driver = Driver(journal)
        driver.admit("r0", prompt(0))
        wait_for_round_trips(journal, 1)  # no flush: the admission woke the writer
        assert r.sismember("requests:unfinished", "r0")
        for _ in range(5):
            driver.step()
        assert driver.tokens["r0"], "r0 decoded in those steps"
        assert journal.num_round_trips == 1 and r.llen("tokens:r0") == 0
        driver.admit("r1", prompt(1))
        wait_for_round_trips(journal, 2)  # r1's admission carries r0's tokens with it
        assert [int(t) for t in r.lrange("tokens:r0", 0, -1)] == driver.tokens["r0"]
        assert r.sismember("requests:unfinished", "r1")
        while len(driver.finish) < 2:
            driver.step()
        assert journal.flush(FLUSH_S) and journal.num_round_trips == 3
        for rid in ("r0", "r1"):
            assert [int(t) for t in r.lrange(f"tokens:{rid}", 0, -1)] == driver.tokens[rid]
            assert r.hget(f"request:{rid}", "finish_reason") == "length"
    finally:
        journal.close()
        r.close()


def test_keys_hold_what_a_restart_needs_and_finished_ones_expire(server) -> None:
    journal = Journal(server.url, JournalConfig(finished_ttl_s=600))
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        driver = Driver(journal)
        for i in range(3):
            driver.admit(f"r{i}", prompt(i))
        for _ in range(4):  # prompts of 10-16 tokens in chunks of 8: some prefill, some decode
            driver.step()
        assert journal.flush(FLUSH_S)
        records = {rec.request_id: rec for rec in journal.load_unfinished()}
        assert set(records) == {"r0", "r1", "r2"}
        for i in range(3):
            rec, request = records[f"r{i}"], driver.core.scheduler(0).requests[f"r{i}"]
            assert rec.prompt_token_ids == prompt(i) and rec.params == PARAMS
            assert (rec.tenant, rec.priority, rec.finish_reason) == ("t1", 1, None)
            assert rec.output_token_ids == request.output_token_ids == driver.tokens[f"r{i}"]
            assert rec.chunks, "chunk progress is journaled"
            assert sum(num for _, num in rec.chunks.values()) >= len(prompt(i))
            for n, (start, num) in rec.chunks.items():
                assert r.exists(f"prefill:r{i}:chunk_{n}")
                assert start >= 0 and num > 0
        assert r.ttl("request:r0") == -1  # unfinished: no expiry

        while len(driver.finish) < 3:
            driver.step()
        assert journal.flush(FLUSH_S)
        assert journal.load_unfinished() == [] and r.smembers("requests:unfinished") == set()
        for i in range(3):
            assert r.hget(f"request:r{i}", "finish_reason") == "length"
            assert [int(t) for t in r.lrange(f"tokens:r{i}", 0, -1)] == driver.tokens[f"r{i}"]
            assert 0 < r.ttl(f"request:r{i}") <= 600 and 0 < r.ttl(f"tokens:r{i}") <= 600
            assert 0 < r.ttl(f"prefill:r{i}:chunk_0") <= 600
        stats = journal.stats()
        assert stats.num_pauses == 0 and stats.num_unfinished == 0
        # Batched: far fewer round trips than writes.
        assert stats.num_round_trips < stats.num_ops_written
    finally:
        journal.close()
        r.close()


def test_redis_killed_mid_run_and_restarted_loses_nothing(server) -> None:
    num_requests = 8
    admit_at = {i: 2 * i for i in range(num_requests)}
    reference = reference_run(num_requests, admit_at)
    journal = Journal(server.url, JournalConfig(reconnect_backoff_s=0.01,
                                                reconnect_backoff_max_s=0.05))
    r = redis.Redis.from_url(server.url, decode_responses=True)
    driver = Driver(journal)
    seen: dict[str, object] = {}

    def kill_redis() -> None:
        assert journal.flush(FLUSH_S)
        server.kill()

    def check_paused_then_restart() -> None:
        # Steps went on while Redis was gone; the writer found it gone.
        assert not journal.flush(FLUSH_S) and journal.stats().is_paused
        seen["finished_while_down"] = set(driver.finish)
        seen["stats_while_down"] = journal.stats()
        server.start()  # same port, empty: everything journaled before is gone

    def check_caught_up() -> None:
        assert journal.flush(FLUSH_S, until_paused=False)
        running = driver.core.scheduler(0).requests
        records = {rec.request_id: rec for rec in journal.load_unfinished()}
        assert set(records) == set(running) and records, "keys of running requests are back"
        for request_id, rec in records.items():
            assert rec.output_token_ids == running[request_id].output_token_ids
            assert rec.prompt_token_ids == running[request_id].prompt_token_ids
        seen["caught_up"] = True

    try:
        run_driver(driver, num_requests, admit_at,
                   on_step={8: kill_redis, 14: check_paused_then_restart, 16: check_caught_up})
        assert seen["caught_up"]
        down = seen["stats_while_down"]
        assert down.is_paused and down.num_pauses == 1 and down.num_write_errors >= 1
        # No request failed, and none changed: same tokens as without a journal.
        assert driver.finish == reference.finish
        assert driver.tokens == reference.tokens
        assert journal.flush(FLUSH_S)
        stats = journal.stats()
        assert not stats.is_paused and stats.num_pauses == 1 and stats.num_catch_ups >= 1
        assert stats.num_unfinished == 0 and journal.load_unfinished() == []
        # Requests that finished while Redis was down got their finish (and expiry) too.
        for request_id in seen["finished_while_down"]:  # type: ignore[attr-defined]
            if r.exists(f"request:{request_id}"):
                assert r.hget(f"request:{request_id}", "finish_reason") == "length"
                assert r.ttl(f"request:{request_id}") > 0
    finally:
        journal.close()
        r.close()


def test_a_full_buffer_becomes_a_catch_up(server) -> None:
    journal = Journal(server.url, JournalConfig(max_buffered_ops=3))
    try:
        driver = Driver(journal)
        # Holding the journal's (re-entrant) lock keeps the writer from draining: the
        # buffer fills as it would behind a slow Redis.
        with journal._cond:
            for i in range(4):
                driver.admit(f"r{i}", prompt(i))
            for _ in range(3):
                driver.step()
            assert journal.stats().num_overflows == 1
        assert journal.flush(FLUSH_S)
        stats = journal.stats()
        assert stats.num_catch_ups == 1 and stats.num_pauses == 0
        records = {rec.request_id: rec for rec in journal.load_unfinished()}
        running = driver.core.scheduler(0).requests
        assert set(records) == set(running) == {f"r{i}" for i in range(4)}
        for request_id, rec in records.items():
            assert rec.output_token_ids == running[request_id].output_token_ids
            assert rec.chunks == journal._records[request_id].chunks
    finally:
        journal.close()


def _entry(token: int, step: int) -> TokenLogprob:
    # Floats that JSON must round-trip exactly.
    return TokenLogprob(token, -0.1 * step - 1 / 3, (token, 7), (-0.1 * step - 1 / 3, -9.25))


def test_logprobs_are_journaled_with_their_tokens_and_cut_to_the_shorter_list(server) -> None:
    """A request with `logprobs` gets each token's entry in step with the token (normal
    writes and a catch-up alike); a list cut short (the two are not written atomically)
    gives the record only the tokens both cover, and a restore re-writes both lists."""
    journal = Journal(server.url)
    try:
        core, _ = make_core()
        wants = core.add_request(prompt(0), SamplingParams(max_tokens=20, logprobs=2), "lp")
        plain = core.add_request(prompt(1), SamplingParams(max_tokens=20), "plain")
        journal.admit(wants)
        journal.admit(plain)
        sent = []
        for step in range(5):
            entries = [_entry(10 + step, step)]
            sent += entries
            journal.record_outputs([
                RequestOutput("lp", [10 + step], None, 4, step + 1, logprobs=entries),
                RequestOutput("plain", [20 + step], None, 4, step + 1)])
            journal.end_step()
            if step == 2:
                with journal._cond:  # the rest goes out as a catch-up
                    journal._drop_buffer()
        assert journal.flush(FLUSH_S)
        records = {rec.request_id: rec for rec in journal.load_unfinished()}
        assert records["lp"].output_token_ids == [10, 11, 12, 13, 14]
        assert records["lp"].output_logprobs == sent
        assert records["plain"].output_logprobs is None
        assert records["plain"].output_token_ids == [20, 21, 22, 23, 24]

        client = redis.Redis.from_url(server.url)
        client.rpop(journal._key("logprobs", "lp"))  # as if the crash fell between the two
        cut = {rec.request_id: rec for rec in journal.load_unfinished()}["lp"]
        assert cut.output_token_ids == [10, 11, 12, 13] and cut.output_logprobs == sent[:4]
        journal.restore([cut])
        journal.record_outputs([RequestOutput("lp", [30], None, 4, 5,
                                              logprobs=[_entry(30, 9)])])
        assert journal.flush(FLUSH_S)
        again = {rec.request_id: rec for rec in journal.load_unfinished()}["lp"]
        assert again.output_token_ids == [10, 11, 12, 13, 30]
        assert again.output_logprobs == [*sent[:4], _entry(30, 9)]
    finally:
        journal.close()
