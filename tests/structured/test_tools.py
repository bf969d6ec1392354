"""Tool calling without the cluster: `auto` renders the tools with the checkpoint's own chat
template (a copy of builtin:tiny whose template takes `tools`, Hermes style) and parses the
call a scripted sampler writes, through the real worker and engine; the parsers of the three
families; `required`'s grammar admits only calls of the listed functions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine
from cluster.frontend import CHAT, Frontend
from cluster.protocol.tool_stream import ToolCallStream
from cluster.protocol.tools import parse_tool_calls, tool_grammar, tool_plan
from workers.presets import resolve_model
from workers.tokenizer import Tokenizer

HERMES_TEMPLATE = (
    "{% if tools %}<|system|>\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "</tools>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['tool_calls'] is defined %}<|assistant|>\n"
    "{% for call in message['tool_calls'] %}<tool_call>{{ call['function'] | tojson }}"
    "</tool_call>{% endfor %}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {}}}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(resolve_model("builtin:tiny"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


class ScriptedSampler:
    """Writes the given ids, whatever the logits (the one row of a one-request batch)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = list(token_ids)

    def __call__(self, logits, rows) -> list[int]:
        assert len(rows) == 1
        return [self.token_ids[rows[0].num_output_tokens]]


def test_auto_renders_the_tools_and_parses_the_scripted_call(checkpoint: Path) -> None:
    config = TokenflowConfig(worker={"model": str(checkpoint), "telemetry": False,
                                     "max_model_len": 2048},
                             protections={"max_prefill_tokens": 2048})
    tokenizer = Tokenizer(checkpoint)
    frontend = Frontend(tokenizer, config, 512)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0}
    prepared = frontend.prepare(CHAT, body)
    rendered = tokenizer.encode(json.dumps(TOOLS[0], sort_keys=True))  # jinja tojson
    ids = prepared.prompt_token_ids
    assert any(ids[i: i + len(rendered)] == rendered for i in range(len(ids)))
    without = frontend.prepare(CHAT, {**body, "tool_choice": "none"}).prompt_token_ids
    assert len(without) < len(ids) and not any(
        without[i: i + len(rendered)] == rendered for i in range(len(without)))
    assert prepared.params.grammar_kind == ""  # auto does not constrain

    script = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' \
             '</tool_call>'
    engine = LocalEngine(config)
    engine.worker.sampler = ScriptedSampler([*tokenizer.encode(script), 2])  # then EOS
    done = engine.generate([prepared.prompt_token_ids], prepared.params)[0]
    stream = frontend.text_stream(prepared)
    stream.advance(done.output_token_ids, done.finish_reason, lambda: None)
    answer = frontend.response(prepared, done.request_id, stream, done.finish_reason)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")

    history = [*body["messages"], choice["message"],
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    again = frontend.prepare(CHAT, {**body, "messages": history}).prompt_token_ids
    call_text = tokenizer.encode('<tool_call>{"arguments": {"city": "Paris"}')
    assert any(again[i: i + len(call_text)] == call_text for i in range(len(again)))


PLAN = tool_plan(TOOLS, "auto", True)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None,
     [("get_time", "{}")]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', None,
     [("get_weather", '{"city": "Rome"}')]),
    ('[{"name": "get_time", "arguments": "{}"}, {"name": "get_time", "arguments": {}}]', None,
     [("get_time", "{}"), ("get_time", "{}")]),  # Mistral, its marker a dropped special
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    ('{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}', None,
     [("get_time", "{}"), ("get_time", "{}")]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "delete_all", "parameters": {}}', '{"name": "delete_all", "parameters": {}}',
     []),  # not one of the tools: text
])
def test_parsers(text: str, content: str | None, calls: list) -> None:
    got_content, got, failed = parse_tool_calls(text, PLAN)
    assert got_content == content and not failed
    assert [(c.name, c.arguments) for c in got] == calls


def test_broken_call_is_counted_and_kept_as_text() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {</tool_call>'
    assert parse_tool_calls(text, PLAN) == (text, [], True)


def test_required_grammar_lists_each_function() -> None:
    grammar = tool_grammar(tool_plan(TOOLS, "required", False))
    assert grammar is not None
    schema = json.loads(grammar.text)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert tool_grammar(tool_plan(TOOLS, "auto", True)) is None


STREAMED = [
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro\\"me"}}]',
    '[{"name": "get_time", "arguments": "{}"}, {"name": "get_time", "arguments": {}}]',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "n": [1, 2]}}',
    '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
    '{"parameters": {"city": "Oslo"}, "name": "get_weather"}',
    "It is sunny. <b>Very</b> sunny.",
    '{"name": "delete_all", "parameters": {}}',
    '{"answer": [1, 2, {"b": "<tool"}]}',
]


def _streamed(plan, text: str, step: int) -> tuple[str, list[dict]]:
    """`text` fed in pieces of `step` characters: (content, calls reassembled as the openai
    client does: by index, `arguments` concatenated)."""
    stream = ToolCallStream(plan)
    content, calls = "", {}
    for end in [*range(step, len(text), step), len(text)]:
        piece, deltas = stream.feed(text[:end], end == len(text))
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"arguments": ""})
            if "id" in delta:
                assert "name" not in call and delta["function"]["arguments"] == ""
                call.update(id=delta["id"], name=delta["function"]["name"])
            call["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_calls_reassemble_to_the_parsed_ones(text: str, step: int) -> None:
    content, calls, _ = parse_tool_calls(text, PLAN)
    got_content, got = _streamed(PLAN, text, step)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == \
        [(c.name, json.loads(c.arguments)) for c in calls]
    assert all(c["id"].startswith("call_") for c in got)
    assert got_content.split() == (content or "").split()  # the same words


def test_streamed_calls_announce_a_call_before_its_arguments_end() -> None:
    """The name goes out as soon as it is complete, the arguments as they are written."""
    plan = tool_plan(TOOLS, "required", True)
    stream = ToolCallStream(plan)
    assert stream.feed('[{"name": "get_weath', False) == ("", [])
    _, deltas = stream.feed('[{"name": "get_weather", "parameters": {"ci', False)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('[{"name": "get_weather", "parameters": {"city": "X"}}]', True) == \
        ("", [{"index": 0, "function": {"arguments": 'ty": "X"}'}}])
    named = ToolCallStream(tool_plan(TOOLS, {"type": "function",
                                             "function": {"name": "get_time"}}, True))
    _, deltas = named.feed("", False)
    assert deltas[0]["function"] == {"name": "get_time", "arguments": ""}
    assert named.feed(' {"a": 1', False)[1] == [{"index": 0, "function": {"arguments": '{"a": 1'}}]
