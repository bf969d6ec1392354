"""The request journal in Redis: what a restarted controller needs to finish every request.

Per admitted request (`{prefix}` is `JournalConfig.key_prefix`):
- `{prefix}request:{id}`: a hash; `record` is the JSON of the request as admitted (prompt
  token ids, sampling params with their seed, tenant, priority, arrival), `num_chunks`,
  and once finished `finish_reason` / `error`.
- `{prefix}tokens:{id}`: the generated token ids, a list appended to every step.
- `{prefix}logprobs:{id}`: with `logprobs` asked, each token's log-probabilities (JSON), in
  step with the tokens.
- `{prefix}prefill:{id}:chunk_{n}`: prefill chunk n's progress, `{"start", "num_tokens"}`.
- `{prefix}requests:unfinished`: the set of ids still running, what a restart reads.
A finished request's keys expire after `finished_ttl_s`.

The step loop only appends to an in-memory buffer (bounded) and an in-memory mirror of every
unfinished request; a writer thread drains the buffer in ONE pipelined round trip per wake-
up, at most one per `write_interval_s` for token progress (admissions go at once), so
neither Redis latency nor a round trip per step reaches the step loop. When Redis goes away
the journal pauses (a rate-limited warning, counters), retries with backoff and, once Redis
answers, catches up by re-writing the full state of every unfinished request from the mirror
(and expiring those that finished meanwhile): nothing is lost, the writes are idempotent. A
buffer overflow is handled the same way. Ray-free and torch-free. """

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from controller.backoff import Backoff
from controller.journal_records import JournalConfig, JournalRecord, JournalStats, encode_logprob
from controller.messages import ChunkComplete, RequestOutput
from controller.request import Request

logger = logging.getLogger(__name__)


_Op = tuple[Any, ...]

# ARGV[1]: the token lists' key prefix, ARGV[2]: a JSON object request id -> new ids. Keys
# are built in the script (one argument instead of one per request: packing each argument
# is what costs the writer thread); fine on a standalone Redis, not on Redis Cluster.
# unpack() in slices: Lua's stack caps how many arguments one call takes (a catch-up can
# be long).
_APPEND_TOKENS = """
local n = 0
for request_id, ids in pairs(cjson.decode(ARGV[2])) do
  for i = 1, #ids, 4000 do
    redis.call('RPUSH', ARGV[1] .. request_id, unpack(ids, i, math.min(i + 3999, #ids)))
  end
  n = n + 1
end
return n
"""


class Journal:
    def __init__(self, url: str, config: JournalConfig | None = None) -> None:
        self.config = cfg = config or JournalConfig()
        # No retries inside the client: the writer thread owns backoff and catch-up.
        self.redis = redis.Redis.from_url(
            url, socket_timeout=cfg.socket_timeout_s, socket_connect_timeout=cfg.socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._cond = threading.Condition()
        self._ops: list[_Op] = []
        self._records: dict[str, JournalRecord] = {}  # the mirror of unfinished requests
        # New tokens by request since the writer last drained, merged across steps and
        # written after the buffered ops (only a finish must follow its request's tokens,
        # and pushing a finish pushes them first).
        self._step_tokens: dict[str, list[int]] = {}
        self._step_logprobs: dict[str, list[str]] = {}  # the same, encoded, when asked
        # Set while paused or after an overflow: the next write is a full catch-up, so
        # nothing is buffered meanwhile; finishes are remembered to expire their keys.
        self._needs_catch_up = False
        self._finished_meanwhile: dict[str, tuple[str, str | None, int]] = {}
        self._is_paused = False
        self._is_writing = False
        self._is_urgent = False  # an admission or a flush waits: skip the write interval
        self._is_idle = False  # the writer waits for ops (not out its write interval)
        self._stopping = False
        self._last_warning = float("-inf")
        self.num_pauses = self.num_write_errors = self.num_catch_ups = 0
        self.num_overflows = self.num_round_trips = self.num_ops_written = 0
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    # -- keys -------------------------------------------------------------------------------
    def _key(self, kind: str, request_id: str) -> str:
        return f"{self.config.key_prefix}{kind}:{request_id}"

    def chunk_key(self, request_id: str, chunk_index: int) -> str:
        return f"{self.config.key_prefix}prefill:{request_id}:chunk_{chunk_index}"

    @property
    def unfinished_key(self) -> str:
        return f"{self.config.key_prefix}requests:unfinished"

    # -- the step loop's side (cheap: memory only) -------------------------------------------
    def admit(self, request: Request) -> None:
        record = JournalRecord.of(request)
        with self._cond:
            self._records[record.request_id] = record
            self._push(("admit", record.request_id, record.static_json()))
            self._is_urgent = True
            self._cond.notify_all()

    def restore(self, records: list[JournalRecord]) -> None:
        """Records read back after a restart: journaled from now on as if just admitted
        (their keys are already in Redis)."""
        with self._cond:
            for record in records:
                self._records[record.request_id] = record
                if record.output_logprobs is not None:
                    # Its two lists, cut to the shorter on reading, are appended from here.
                    self._push(("admit", record.request_id, record.static_json()))
                    self._push(("tokens", record.request_id, list(record.output_token_ids),
                                [encode_logprob(e) for e in record.output_logprobs]))

    def record_output(self, out: RequestOutput) -> None:
        self.record_outputs([out])

    def record_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, under one lock: the step loop calls this once per step."""
        with self._cond:
            records, step_tokens = self._records, self._step_tokens
            for out in outputs:
                record = records.get(out.request_id)
                if record is None:
                    continue  # not journaled (admitted before a restart that lost it)
                if out.new_token_ids:
                    record.output_token_ids.extend(out.new_token_ids)
                    # Merged per request until the writer drains: one JSON object per
                    # round trip, however many steps it covers.
                    ids = step_tokens.get(out.request_id)
                    if ids is None:
                        step_tokens[out.request_id] = list(out.new_token_ids)
                    else:
                        ids.extend(out.new_token_ids)
                    if record.output_logprobs is not None and out.logprobs is not None:
                        record.output_logprobs.extend(out.logprobs)
                        self._step_logprobs.setdefault(out.request_id, []).extend(
                            encode_logprob(entry) for entry in out.logprobs)
                if out.finish_reason is not None:
                    del records[out.request_id]
                    self._push_step_tokens()  # its tokens before its finish
                    step_tokens = self._step_tokens
                    self._push(("finish", out.request_id, str(out.finish_reason), out.error,
                                len(record.chunks)))

    def record_chunks(self, events: list[ChunkComplete]) -> None:
        with self._cond:
            for event in events:
                record = self._records.get(event.request_id)
                if record is None:
                    continue
                record.chunks[event.chunk_index] = (event.start, event.num_tokens)
                self._push(("chunk", event.request_id, event.chunk_index, event.start,
                            event.num_tokens))

    def end_step(self) -> None:
        """The step's writes are buffered: wake the writer if it waits for work."""
        with self._cond:
            # Waking a writer that sits out its interval would only cost a thread switch.
            if (self._ops or self._step_tokens) and self._is_idle:
                self._cond.notify()

    def _push_step_tokens(self) -> None:
        if self._step_tokens:
            self._push(("step_tokens", "", self._step_tokens, self._step_logprobs))
            self._step_tokens, self._step_logprobs = {}, {}

    def _push(self, op: _Op) -> None:
        if self._needs_catch_up:
            # The catch-up writes the mirror's state, which includes this op; only a finish
            # (its request left the mirror) must be remembered.
            if op[0] == "finish":
                self._finished_meanwhile[op[1]] = op[2:]
            return
        if len(self._ops) >= self.config.max_buffered_ops:
            self.num_overflows += 1
            self._drop_buffer()
            self._cond.notify()
            self._push(op)
            return
        self._ops.append(op)

    def _drop_buffer(self, *more: list[_Op]) -> None:
        """Give up buffered writes for a catch-up; keep their finishes. Lock held."""
        for ops in (*more, self._ops):
            for op in ops:
                if op[0] == "finish":
                    self._finished_meanwhile.setdefault(op[1], op[2:])
        self._ops = []
        self._needs_catch_up = True

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        backoff = Backoff(cfg.reconnect_backoff_s, cfg.reconnect_backoff_max_s)
        while True:
            with self._cond:
                while not (self._ops or self._step_tokens or self._needs_catch_up
                           or self._stopping):
                    self._is_idle = True
                    self._cond.wait()
                self._is_idle = False
                if self._stopping and not (self._ops or self._step_tokens
                                           or self._needs_catch_up):
                    return
                is_catch_up = self._needs_catch_up
                if is_catch_up:
                    # Atomic with the producers: ops pushed after this go on top of it.
                    ops = self._catch_up_ops()
                    # already in the mirror the catch-up writes
                    self._step_tokens, self._step_logprobs = {}, {}
                    self._needs_catch_up = False
                    self._finished_meanwhile = {}
                else:
                    self._push_step_tokens()
                    ops = self._ops
                self._ops = []
                self._is_writing = True
                self._is_urgent = False
            try:
                self._write(ops)
            except redis.RedisError as err:
                with self._cond:
                    self._is_writing = False
                    self.num_write_errors += 1
                    if not self._is_paused:
                        self.num_pauses += 1
                    self._is_paused = True
                    # The failed batch may be half applied: re-write it all once Redis is
                    # back (ops buffered since would land on top of a stale state).
                    self._drop_buffer(ops)
                    self._cond.notify_all()
                    if self._stopping:
                        return
                self._warn(err)
                wait_s = backoff.next_s()
                with self._cond:  # a retry interval, cut short by close()
                    self._cond.wait_for(lambda: self._stopping, wait_s)
                continue
            backoff.reset()
            with self._cond:
                self._is_writing = False
                if is_catch_up:
                    self.num_catch_ups += 1
                if self._is_paused:
                    self._is_paused = False
                    logger.warning("journal: Redis is back, %d unfinished requests re-written",
                                   len(self._records))
                self._cond.notify_all()
                if cfg.write_interval_s > 0:  # let steps' tokens gather for one round trip
                    self._cond.wait_for(lambda: self._stopping or self._is_urgent,
                                        cfg.write_interval_s)

    def _catch_up_ops(self) -> list[_Op]:
        ops: list[_Op] = []
        for record in self._records.values():
            ops.append(("admit", record.request_id, record.static_json()))
            ops.append(("tokens", record.request_id, list(record.output_token_ids),
                        [encode_logprob(e) for e in record.output_logprobs or ()]))
            ops.extend(("chunk", record.request_id, n, start, num)
                       for n, (start, num) in record.chunks.items())
        ops.extend(("finish", rid, *finish) for rid, finish in self._finished_meanwhile.items())
        return ops

    def _write(self, ops: list[_Op]) -> None:
        ttl = self.config.finished_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        # Every request's new tokens in this batch go out as ONE command (a Lua script that
        # appends to each list): a command per request costs the writer thread far more
        # interpreter time (packing, parsing) than the round trip itself, and that time is
        # taken from the step loop.
        request_to_tokens: dict[str, list[int]] = {}
        request_to_logprobs: dict[str, list[str]] = {}  # the same script, another list

        def push_tokens() -> None:
            for kind, new in (("tokens", request_to_tokens), ("logprobs", request_to_logprobs)):
                if new:
                    pipe.eval(_APPEND_TOKENS, 0, self._key(kind, ""), json.dumps(new))
                    new.clear()

        for op in ops:
            kind, request_id = op[0], op[1]
            if kind == "tokens":
                request_to_tokens.setdefault(request_id, []).extend(op[2])
                if op[3]:
                    request_to_logprobs.setdefault(request_id, []).extend(op[3])
                continue
            if kind == "step_tokens":
                for merged, new in ((request_to_tokens, op[2]), (request_to_logprobs, op[3])):
                    if not merged:  # the usual case: one merged dict per write
                        merged.update(new)
                        continue
                    for rid, items in new.items():
                        merged.setdefault(rid, []).extend(items)
                continue
            if request_id in request_to_tokens or request_id in request_to_logprobs:
                push_tokens()  # keep each request's commands in order
            if kind == "admit":  # also the catch-up of a request: its tokens follow
                pipe.hset(self._key("request", request_id), "record", op[2])
                pipe.delete(self._key("tokens", request_id), self._key("logprobs", request_id))
                pipe.sadd(self.unfinished_key, request_id)
            elif kind == "chunk":
                pipe.set(self.chunk_key(request_id, op[2]),
                         json.dumps({"start": op[3], "num_tokens": op[4]}))
                pipe.hset(self._key("request", request_id), "num_chunks", op[2] + 1)
            else:  # finish
                reason, error, num_chunks = op[2], op[3], op[4]
                pipe.hset(self._key("request", request_id), "finish_reason", reason)
                if error:
                    pipe.hset(self._key("request", request_id), "error", error)
                pipe.srem(self.unfinished_key, request_id)
                for key in (self._key("request", request_id), self._key("tokens", request_id),
                            self._key("logprobs", request_id),
                            *(self.chunk_key(request_id, n) for n in range(num_chunks))):
                    pipe.expire(key, ttl)
        push_tokens()
        pipe.execute()
        self.num_round_trips += 1
        self.num_ops_written += len(ops)

    def _warn(self, err: Exception) -> None:
        now = time.monotonic()
        if now - self._last_warning >= self.config.warn_interval_s:
            self._last_warning = now
            logger.warning("journal paused, Redis unreachable (%d write errors so far), "
                           "serving on: %s: %s", self.num_write_errors, type(err).__name__, err)

    # -- reading back -------------------------------------------------------------------------
    def load_unfinished(self) -> list[JournalRecord]:
        """Every request the journal holds as unfinished, in arrival order."""
        ids = sorted(self.redis.smembers(self.unfinished_key))
        pipe = self.redis.pipeline(transaction=False)
        for request_id in ids:
            pipe.hgetall(self._key("request", request_id))
            pipe.lrange(self._key("tokens", request_id), 0, -1)
            pipe.lrange(self._key("logprobs", request_id), 0, -1)
        replies = pipe.execute()
        found: list[tuple[str, dict[str, str], list[str], list[str]]] = []
        for i, request_id in enumerate(ids):
            fields, tokens, logprobs = replies[3 * i : 3 * i + 3]
            if "record" in fields and "finish_reason" not in fields:
                found.append((request_id, fields, tokens, logprobs))
        pipe = self.redis.pipeline(transaction=False)
        for request_id, fields, *_ in found:
            for n in range(int(fields.get("num_chunks", 0))):
                pipe.get(self.chunk_key(request_id, n))
        chunk_values = iter(pipe.execute())
        records = []
        for request_id, fields, tokens, logprobs in found:
            chunks = {}
            for n in range(int(fields.get("num_chunks", 0))):
                value = next(chunk_values)
                if value is not None:
                    chunk = json.loads(value)
                    chunks[n] = (chunk["start"], chunk["num_tokens"])
            records.append(JournalRecord.from_redis(request_id, fields, tokens, chunks,
                                                    logprobs))
        return sorted(records, key=lambda r: r.arrival_time)

    # -- state --------------------------------------------------------------------------------
    def flush(self, timeout_s: float, *, until_paused: bool = True) -> bool:
        """Wait until everything recorded so far is in Redis (True), or the timeout passes
        (False); with `until_paused`, also stop waiting (False) once Redis is found
        unreachable."""
        def is_done() -> bool:
            return not (self._ops or self._step_tokens or self._needs_catch_up
                        or self._is_writing)

        with self._cond:
            self._is_urgent = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: is_done() or (until_paused and self._is_paused),
                                timeout_s)
            return is_done()

    def stats(self) -> JournalStats:
        with self._cond:
            return JournalStats(self._is_paused, self.num_pauses, self.num_write_errors,
                                self.num_catch_ups, self.num_overflows, self.num_round_trips,
                                self.num_ops_written, len(self._ops), len(self._records))

    def close(self, flush_timeout_s: float = 0.0) -> None:
        if flush_timeout_s > 0:
            self.flush(flush_timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=self.config.socket_timeout_s + 1)
        self.redis.close()
