"""Workers SIGKILLed on a real Ray cluster, mid-stream: nothing lost, nothing wrong.

A second controller (its own namespace, two workers, prefix caching on) on the session's
Ray cluster. 16 greedy streams run undisturbed once for reference, then again while a
worker is killed with SIGKILL, three times in the controller's life: every stream finishes
with a finish reason and exactly the reference's token ids (the dead worker's requests are
recomputed on the other one and continue without a gap or a duplicate). Afterwards a
request whose prefix was cached before a crash returns the very same tokens: a restarted
worker's KV is zeros, and a pool that kept its prefix hashes would serve them.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from cluster.config import TokenflowConfig
from controller.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 13 * j + 3) % 500 + 1 for i in range(17 + 3 * j)] for j in range(16)]
CACHED_PROMPT = [(5 * i + 1) % 400 + 1 for i in range(41)]  # 5 full blocks of 8


@pytest.fixture(scope="module")
def controller(cluster):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 2},
        cache={"block_size": 8, "num_kv_blocks": 256, "enable_prefix_caching": True},
        scheduler={"max_num_batched_tokens": 64},
        cluster={"namespace": "tokenflow-restart", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1, "worker_max_restarts": -1})
    controller = get_or_create_controller(config.controller_options())
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    ray.kill(controller)


def _stream(controller, prompt: list[int], request_id: str, on_token=None
            ) -> tuple[list[int], str | None, str | None]:
    import ray

    tokens: list[int] = []
    finish, error = None, None
    gen = controller.generate.options(num_returns="streaming").remote(prompt, PARAMS,
                                                                      request_id)
    for ref in gen:
        delta = ray.get(ref, timeout=120)
        tokens.extend(delta["token_ids"])
        finish = delta["finish_reason"] or finish
        error = delta.get("error") or error
        if on_token is not None and delta["token_ids"]:
            on_token(len(tokens))
    return tokens, finish, error


def _run_all(controller, tag: str, kill_worker: int | None = None) -> list[tuple]:
    """All 16 prompts at once; with `kill_worker`, SIGKILL it once 4 streams have 2 tokens."""
    import ray

    started = threading.Semaphore(0)
    results: list[tuple | None] = [None] * len(PROMPTS)

    def run(j: int) -> None:
        fired = [False]

        def on_token(num_tokens: int) -> None:
            if num_tokens >= 2 and not fired[0]:
                fired[0] = True
                started.release()

        results[j] = _stream(controller, PROMPTS[j], f"{tag}-{j}", on_token)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    if kill_worker is not None:
        for _ in range(4):
            assert started.acquire(timeout=120)
        pid = ray.get(controller.stats.remote(), timeout=30)["workers"][kill_worker]["pid"]
        os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def test_worker_sigkill_mid_stream_loses_nothing_and_changes_nothing(controller):
    import ray

    reference = _run_all(controller, "ref")
    assert all(f == "length" and e is None and len(t) == PARAMS.max_tokens
               for t, f, e in reference)
    cached_before, _, _ = _stream(controller, CACHED_PROMPT, "cached-0")
    assert _stream(controller, CACHED_PROMPT, "cached-1")[0] == cached_before  # a hit

    pids = set()
    for kill in range(3):  # the service recovers every time, not only the first
        worker = kill % 2
        before = ray.get(controller.stats.remote(), timeout=30)["workers"][worker]
        pids.add(before["pid"])
        disturbed = _run_all(controller, f"kill{kill}", kill_worker=worker)
        for j, ((tokens, finish, error), (ref_tokens, _, _)) in enumerate(
                zip(disturbed, reference, strict=True)):
            assert error is None and finish == "length", (kill, j, error)
            assert tokens == ref_tokens, (kill, j)
        # A request after the crash whose prefix was cached before it: same tokens.
        again, _, error = _stream(controller, CACHED_PROMPT, f"cached-after-{kill}")
        assert error is None and again == cached_before
        assert ray.get(controller.wait_workers_up.remote(120), timeout=150)["ok"]
        stats = ray.get(controller.stats.remote(), timeout=30)
        assert stats["workers"][worker]["num_failures"] == before["num_failures"] + 1
        assert stats["workers"][worker]["pid"] not in pids

    health = ray.get(controller.ping.remote(), timeout=60)
    assert health["ok"] and health["num_workers_up"] == 2
    report = ray.get(controller.check_integrity.remote(), timeout=60)
    assert all(w["checked"] for w in report["workers"])
