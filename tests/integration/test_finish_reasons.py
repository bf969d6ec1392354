"""`/metrics` counts each finished request by the finish reason its client got.

Through the session cluster with the real `openai` client: a stop string the edge matches
(streamed and not), a stop token id, max_tokens, and a client that leaves mid-stream. The
counter is read from `/metrics` before and after; the stop string's abort reaches the
controller after the response (fire and forget), so the scrape is polled, not slept for.
The error reason (a request failed on too many workers) is counted in
tests/unit/test_controller_actor.py, where a worker failure can be injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Cluster

MODEL = "builtin:tiny"
GREEDY = {"temperature": 0.0, "max_tokens": 12}
EXTRA = {"return_token_ids": True, "ignore_eos": True}
REASONS = ("stop", "length", "abort", "error")


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)


def reason_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts = dict.fromkeys(REASONS, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name == "tokenflow_request_success":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["finished_reason"]] = sample.value
    return counts


def await_counts(url: str, expected: Callable[[dict[str, float]], bool],
                 deadline_s: float = 30) -> dict[str, float]:
    end = time.monotonic() + deadline_s
    while not expected(counts := reason_counts(url)):
        assert time.monotonic() < end, f"finish reasons never reached the expected: {counts}"
        time.sleep(0.05)  # a poll interval, not a synchronisation
    return counts


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {r: after[r] - before[r] for r in REASONS}


def test_every_reason_has_a_series(cluster: Cluster) -> None:
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    for reason in REASONS:
        assert f'tokenflow_request_success_total{{finished_reason="{reason}"}}' in text


def test_stop_strings_count_as_stop_not_abort(client: OpenAI, cluster: Cluster) -> None:
    whole = client.completions.create(model=MODEL, prompt="abc", extra_body=EXTRA, **GREEDY)
    stop = whole.choices[0].text[3:5]
    assert stop, "the greedy continuation is long enough to hold a stop string"
    before = reason_counts(cluster.url)
    for _ in range(3):
        resp = client.completions.create(model=MODEL, prompt="abc", stop=[stop],
                                         extra_body=EXTRA, **GREEDY)
        assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="abc", stop=[stop],
                                            extra_body=EXTRA, stream=True, **GREEDY))
    assert chunks[-1].choices[0].finish_reason == "stop"
    after = await_counts(cluster.url, lambda c: c["stop"] - before["stop"] >= 4)
    assert delta(after, before) == {"stop": 4, "length": 0, "abort": 0, "error": 0}


def test_stop_token_and_length_count_as_returned(client: OpenAI, cluster: Cluster) -> None:
    whole = client.completions.create(model=MODEL, prompt="xyz", extra_body=EXTRA, **GREEDY)
    assert whole.choices[0].finish_reason == "length"
    stop_id = whole.choices[0].token_ids[4]  # type: ignore[attr-defined]
    before = reason_counts(cluster.url)
    resp = client.completions.create(
        model=MODEL, prompt="xyz", extra_body={**EXTRA, "stop_token_ids": [stop_id]},
        **GREEDY)
    assert resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model=MODEL, prompt="xyz", extra_body=EXTRA, **GREEDY)
    assert resp.choices[0].finish_reason == "length"
    after = await_counts(cluster.url, lambda c: c["length"] - before["length"] >= 1
                         and c["stop"] - before["stop"] >= 1)
    assert delta(after, before) == {"stop": 1, "length": 1, "abort": 0, "error": 0}


def test_a_client_leaving_mid_stream_counts_as_abort(client: OpenAI, cluster: Cluster) -> None:
    before = reason_counts(cluster.url)
    stream = client.completions.create(model=MODEL, prompt="hello", extra_body=EXTRA,
                                       stream=True, temperature=0.0, max_tokens=500)
    next(iter(stream))  # the request runs
    stream.close()  # and its client goes away
    after = await_counts(cluster.url, lambda c: c["abort"] - before["abort"] >= 1)
    assert delta(after, before) == {"stop": 0, "length": 0, "abort": 1, "error": 0}
