"""Structured outputs through the whole cluster with the real `openai` client (builtin:tiny,
random weights: the grammar, not the weights, makes every answer valid).

`beta.chat.completions.parse` with a pydantic model (nested objects, an enum, arrays, an
optional field) returns parsed objects for 20 of 20 requests, streamed and not; completions
take vLLM's guided_* aliases; a bad schema is a 400 with the reason; nothing leaks."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.integration.conftest import Cluster
from tests.structured.schemas import Person

MODEL = "builtin:tiny"
NUM_REQUESTS = 20
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _async_client(cluster: Cluster) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                       timeout=120)


def _args(i: int) -> dict:
    # Half greedy, half seeded sampling: validity must not depend on the sampler.
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
    return {"model": MODEL, "messages": MESSAGES, "response_format": Person,
            "max_completion_tokens": 400, **sampling}


def test_parse_returns_20_of_20_objects(cluster: Cluster) -> None:
    async def run() -> list:
        async with _async_client(cluster) as aclient:
            return await asyncio.gather(*(aclient.beta.chat.completions.parse(**_args(i))
                                          for i in range(NUM_REQUESTS)))

    completions = asyncio.run(run())
    parsed = [c.choices[0].message.parsed for c in completions]
    assert all(isinstance(p, Person) for p in parsed), [c.choices[0] for c in completions]
    assert all(c.choices[0].finish_reason == "stop" for c in completions)
    assert len({p.model_dump_json() for p in parsed}) > 1  # the sampled ones differ
    cluster.check_integrity()


def test_streamed_parse_returns_20_of_20_objects(cluster: Cluster) -> None:
    async def one(aclient: AsyncOpenAI, i: int) -> tuple[Person | None, int]:
        num_chunks = 0
        async with aclient.beta.chat.completions.stream(**_args(i)) as stream:
            async for event in stream:
                num_chunks += event.type == "content.delta"
            final = await stream.get_final_completion()
        return final.choices[0].message.parsed, num_chunks

    async def run() -> list:
        async with _async_client(cluster) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(NUM_REQUESTS)))

    results = asyncio.run(run())
    assert all(isinstance(p, Person) for p, _ in results), results
    assert all(n > 1 for _, n in results)  # streamed in pieces, not in one chunk
    cluster.check_integrity()


def test_completions_take_the_guided_aliases(client: OpenAI) -> None:
    pattern = r"[a-z]{2,5}@[0-9]{3}"
    out = client.completions.create(model=MODEL, prompt="id: ", max_tokens=40,
                                    temperature=1.0, seed=3,
                                    extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    choice = client.completions.create(model=MODEL, prompt="ok? ", max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["n"]}
    documented = client.completions.create(
        model=MODEL, prompt="n: ", max_tokens=40, temperature=0.0,
        extra_body={"structured_outputs": {"json": schema}})
    assert re.fullmatch(r'\{"n": ?[0-9]\}', documented.choices[0].text)


def test_over_long_generation_is_length_with_what_was_produced(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "p", "schema": Person.model_json_schema()}})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith("{") and out.usage.completion_tokens == 5


@pytest.mark.parametrize(("extra", "reason"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
     "only one output constraint"),
])
def test_bad_constraint_is_400_with_its_reason(client: OpenAI, cluster: Cluster, extra: dict,
                                               reason: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8,
                                       **extra)
    assert reason in err.value.message
    cluster.check_integrity()


def test_metrics_count_constrained_requests_and_cache_hits(cluster: Cluster) -> None:
    import httpx

    text = httpx.get(f"{cluster.url}/metrics", timeout=60).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenflow_edge_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    # The parse tests above sent 40 requests with one schema: compiled once, then hits.
    assert values["tokenflow_edge_constrained_requests_total"] >= 40
    assert values["tokenflow_edge_grammar_cache_hits_total"] >= 39
    assert values["tokenflow_edge_grammar_errors_total"] >= 2  # the bad schema, the grammar
    assert values["tokenflow_edge_grammar_compile_seconds_total"] > 0
