"""The served scene of the peer benchmark, against any OpenAI-compatible server, and the
servers themselves (tokenflow's `make serve` command, `vllm serve`), started in their own
session so that stopping one ends exactly its process tree.

Scene: `NUM_USERS` users stream `USER_TOKENS` greedy tokens each from `USER_PROMPT_LEN`-id
prompts; `LONG_AT_S` after they start, or once the users have received
`LONG_AT_USER_SHARE` of their tokens if that comes first, a `LONG_PROMPT_LEN`-id prompt
arrives, and `SHORT_AFTER_S` later a `SHORT_PROMPT_LEN`-id one (both stream `PROBE_TOKENS`
tokens). The share keeps the long prompt inside the users' streams on a fast machine: on a
2-core Zen 5 in bf16 both engines' users had all their tokens within 1.7 s, before a long
prompt at 2 s, and the gaps "during the long prefill" were none (tokens are counted from
each chunk's `token_ids`, `return_token_ids`, which both servers send). A
user's gap is the time between two of its stream events: one event per token on vLLM
and on tokenflow's steps that carry a chunk, one per decode burst (several tokens, counted
from the stream's usage chunk) on tokenflow's decode-only steps, so a burst's gap counts
once, not as several gaps of zero. The gaps "during the long prefill" are those that end
between the long prompt's arrival and its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NUM_USERS, USER_PROMPT_LEN, USER_TOKENS = 8, 64, 256
LONG_AT_S, LONG_PROMPT_LEN = 2.0, 6000
LONG_AT_USER_SHARE = 0.25
SHORT_AFTER_S, SHORT_PROMPT_LEN = 0.5, 32
PROBE_TOKENS = 8
FIRST_ID = 300


@dataclass
class Stream:
    start: float
    events: list[float] = field(default_factory=list)  # arrival of each chunk with text
    error: str | None = None
    num_tokens: int | None = None  # the usage chunk's completion_tokens

    @property
    def tokens(self) -> int:
        """Tokens received: a chunk may carry several (a decode burst, a stream that fell
        behind), so the usage count, not the chunks; the chunks where there is none."""
        return len(self.events) if self.num_tokens is None else self.num_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.events[0] - self.start if self.events else None


@dataclass
class TokenCount:
    """Tokens the users have received so far; `reached` is set at `target`."""

    target: int
    count: int = 0
    reached: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, n: int) -> None:
        self.count += n
        if self.count >= self.target:
            self.reached.set()


async def _stream(client: Any, url: str, model: str, prompt: list[int], max_tokens: int,
                  t0: float, counter: TokenCount | None = None) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if counter is not None:  # each chunk then names its tokens
        body["return_token_ids"] = True
    out = Stream(time.perf_counter() - t0)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    out.events.append(time.perf_counter() - t0)
                    if counter is not None:
                        counter.add(len(chunk["choices"][0].get("token_ids") or ()))
                if chunk.get("usage"):
                    out.num_tokens = chunk["usage"]["completion_tokens"]
    except Exception as err:  # recorded, the round is then reported as failed
        out.error = repr(err)
    return out


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_scene(url: str, model: str, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]

    users_prompts = [ids(USER_PROMPT_LEN) for _ in range(NUM_USERS)]
    long_prompt, short_prompt = ids(LONG_PROMPT_LEN), ids(SHORT_PROMPT_LEN)
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        counter = TokenCount(math.ceil(LONG_AT_USER_SHARE * NUM_USERS * USER_TOKENS))
        users = [asyncio.create_task(_stream(client, url, model, p, USER_TOKENS, t0, counter))
                 for p in users_prompts]
        with contextlib.suppress(TimeoutError):  # LONG_AT_S, or the users' share if sooner
            await asyncio.wait_for(counter.reached.wait(), LONG_AT_S)
        long_task = asyncio.create_task(_stream(client, url, model, long_prompt,
                                                PROBE_TOKENS, t0))
        await asyncio.sleep(SHORT_AFTER_S)
        short_task = asyncio.create_task(_stream(client, url, model, short_prompt,
                                                 PROBE_TOKENS, t0))
        user_streams = await asyncio.gather(*users)
        long_s, short_s = await long_task, await short_task
    errors = [s.error for s in [*user_streams, long_s, short_s] if s.error]
    long_first = long_s.events[0] if long_s.events else None
    window_gaps, all_gaps = [], []
    for s in user_streams:
        for a, b in zip(s.events, s.events[1:], strict=False):
            all_gaps.append(b - a)
            if long_first is not None and long_s.start <= b <= long_first:
                window_gaps.append(b - a)
    user_tokens = sum(s.tokens for s in user_streams)
    users_end = max((s.events[-1] for s in user_streams if s.events), default=None)
    return {
        "errors": errors,
        "long_ttft_s": long_s.ttft_s, "short_ttft_s": short_s.ttft_s,
        "window_gap_p99_s": _q(window_gaps, 0.99), "window_gap_p50_s": _q(window_gaps, 0.5),
        "num_window_gaps": len(window_gaps),
        "gap_p50_s": _q(all_gaps, 0.5), "gap_p99_s": _q(all_gaps, 0.99),
        "users_tok_s": user_tokens / users_end if users_end else None,
        "user_tokens": user_tokens, "long_at_s": long_s.start,
    }


# -- servers -------------------------------------------------------------------------------
def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, b""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    started: float
    log: Path
    ready_s: float | None = None
    model: str | None = None

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from spawn until /health answers 200 and /v1/models names a model."""
        deadline = self.started + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}; see {self.log}")
            status, _ = _get(f"{self.url}/health")
            if status == 200:
                status, body = _get(f"{self.url}/v1/models")
                if status == 200:
                    self.model = json.loads(body)["data"][0]["id"]
                    self.ready_s = time.perf_counter() - self.started
                    return self.ready_s
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s; see {self.log}")

    def rss_bytes(self) -> tuple[int, int]:
        """Resident memory of the server's process tree, and its process count."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0, 0
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total, len(procs)

    def cpu_s(self) -> float:
        """CPU seconds the server's process tree has used so far (idle cost while the other
        engine's round runs)."""
        return tree_cpu_s(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # Ray's daemons outliving the leader
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_server(name: str, argv: list[str], port: int, env: dict[str, str],
                 log: Path) -> Server:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
    return Server(name, proc, f"http://127.0.0.1:{port}", time.perf_counter(), log)


def flow_metrics(url: str) -> dict[str, float]:
    """tokenflow's flow-control and protection counters from /metrics (cumulative): what
    limited its steps to fewer chunks, if anything did."""
    status, body = _get(f"{url}/metrics")
    wanted = ("flow_transitions", "flow_mode", "chunk_timeouts", "degraded_mode",
              "budget_deviation", "bandwidth_utilization", "itl_slo_seconds")
    out: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines() if status == 200 else []:
        if line.startswith("#") or not any(w in line for w in wanted):
            continue
        name, _, value = line.rpartition(" ")
        try:
            if float(value):
                out[name] = float(value)
        except ValueError:
            continue
    return out


def summarize(rounds: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    values = [r[key] for r in rounds if r.get(key) is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process `pid` and its descendants have used so far."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    except psutil.NoSuchProcess:
        pass
    return total


# An engine counts as idle once its process tree uses under this share of a core over the
# window; the next round waits for that (at most SETTLE_MAX_S): an engine still busy after
# its own round (OpenMP threads spinning, a compile, a warm-up) took a core from the other's
# round. Measured on 2 cores: LocalEngine's rounds right after vLLM's ran 1.5-3.6x slower.
SETTLE_WINDOW_S, SETTLE_MAX_SHARE, SETTLE_MAX_S = 0.5, 0.05, 30.0


def settle_machine() -> float:
    """Wait until the whole machine is idle (or SETTLE_MAX_S passed); the wait. Before a
    server starts: a start right after another server stopped shared the cores with its
    teardown (a cached tokenflow start took 12.1 s there against 8.5 s on an idle machine)."""
    import psutil

    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE_MAX_S:
        # cpu_percent's interval is a measurement window, not synchronisation.
        busy_cores = psutil.cpu_percent(interval=SETTLE_WINDOW_S) / 100 * (os.cpu_count() or 1)
        if busy_cores < SETTLE_MAX_SHARE:
            break
    return time.perf_counter() - start


def settle(pids: list[int]) -> float:
    """Wait until every process tree in `pids` is idle (or SETTLE_MAX_S passed); the wait."""
    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE_MAX_S:
        before = [tree_cpu_s(pid) for pid in pids]
        time.sleep(SETTLE_WINDOW_S)  # a measurement window, not synchronisation
        used = max((tree_cpu_s(pid) - b for pid, b in zip(pids, before, strict=True)),
                   default=0.0)  # no other engine: nothing to wait for
        if used < SETTLE_MAX_SHARE * SETTLE_WINDOW_S:
            break
    return time.perf_counter() - start
