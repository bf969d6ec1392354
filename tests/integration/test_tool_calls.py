"""Tool calls through the whole cluster with the real `openai` client (builtin:tiny, random
weights): `tool_choice="required"` and a named function return calls whose arguments
validate against the function's schema, streamed and not; the assistant's calls and the
tool's answer render back into the next turn; bad tools are a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Cluster

MODEL = "builtin:tiny"
WEATHER = {"type": "object", "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"]}
TIME = {"type": "object", "additionalProperties": False,
        "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# Parallel calls: a list whose length the (random) model picks; seed 0 closes it in time.
@pytest.mark.parametrize(("seed", "parallel"), [(0, True), (1, False), (2, False), (3, False)])
def test_required_returns_valid_calls(client: OpenAI, seed: int, parallel: bool) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", max_completion_tokens=400,
                                         temperature=1.0, seed=seed,
                                         parallel_tool_calls=parallel)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check(choice.message.tool_calls, {"get_weather", "get_time"})
    if not parallel:
        assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("seed", range(3))
def test_named_function_returns_its_call(client: OpenAI, seed: int) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_completion_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=seed)
    calls = out.choices[0].message.tool_calls
    _check(calls, {"get_weather"})
    assert len(calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_calls_arrive_as_openai_deltas(client: OpenAI, tool_choice) -> None:
    """Incremental: a call's first delta carries its id, type and name (empty arguments),
    the later ones only `arguments` fragments, over several chunks; the openai client's
    own stream accumulator reassembles calls that validate."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  max_completion_tokens=300, temperature=0.0, parallel_tool_calls=False)
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [call for event in stream if event.type == "chunk"
                  for call in event.chunk.choices[0].delta.tool_calls or []]
        final = stream.get_final_completion()
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name and deltas[0].function.arguments == ""
    fragments = [d.function.arguments for d in deltas[1:]]
    assert len(fragments) > 3 and all(d.id is None and d.function.name is None
                                      for d in deltas[1:])
    choice = final.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    _check(choice.message.tool_calls, {"get_weather", "get_time"})
    call = choice.message.tool_calls[0]
    assert call.id == deltas[0].id and call.function.arguments == "".join(fragments)
    # The same request unstreamed: the same call.
    out = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    assert out.function.name == call.function.name
    assert json.loads(out.function.arguments) == json.loads(call.function.arguments)


def test_tool_turns_render_back_in(client: OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_completion_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", max_completion_tokens=4,
                                         temperature=0.0)
    assert out.choices[0].message.tool_calls is None
    # The builtin template renders roles and contents: the tool's answer is in the prompt.
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + len("12:00")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tools_are_400(client: OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4,
                                       **extra)
    assert err.value.body["param"] == param
