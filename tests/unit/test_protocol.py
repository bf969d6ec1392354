"""Unit tests for the OpenAI protocol layer: pure functions, no server."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from cluster.protocol import (
    SSE_DONE,
    BatchItem,
    BatchLineError,
    ChatCompletionRequest,
    CompletionRequest,
    Head,
    ProtocolError,
    StopStringMatcher,
    apply_stop_strings,
    batch_error_line,
    batch_output_line,
    chat_completion_chunk,
    chat_completion_response,
    check_limits,
    check_max_tokens,
    check_model,
    check_token_ids,
    completion_chunk,
    completion_response,
    error_body,
    models_response,
    new_chat_completion_id,
    new_completion_id,
    parse_batch_line,
    parse_request,
    request_class_for_url,
    sse,
    to_sampling_params,
    usage_chunk,
    validate_request,
)
from controller.messages import SamplingParams

CHAT_MSGS = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return validate_request({"model": "m", "prompt": "hello", **fields}, CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    return validate_request({"model": "m", "messages": CHAT_MSGS, **fields}, ChatCompletionRequest)


def expect_400(cls: type, body: dict[str, Any], param: str) -> ProtocolError:
    """The body is rejected with 400 and both `param` and the message name the parameter."""
    with pytest.raises(ProtocolError) as info:
        validate_request(body, cls)
    err = info.value
    assert err.status_code == 400
    assert err.type == "invalid_request_error"
    # Element errors may point inside the field (`stop_token_ids[0]`): still the same param.
    assert err.param == param or (err.param or "").startswith(param + "[")
    assert param.split(".")[-1].split("[")[0] in err.message
    return err


# ---------------------------------------------------------------------------------------------
# Errors


def test_error_body_shape() -> None:
    err = ProtocolError(404, "no such model", type="NotFoundError", param="model", code=404)
    assert error_body(err) == {
        "error": {
            "message": "no such model",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert ProtocolError(400, "x").type == "invalid_request_error"
    assert ProtocolError(503, "x").type == "server_error"
    assert ProtocolError(429, "x").type == "rate_limit_error"


# ---------------------------------------------------------------------------------------------
# Valid requests and normalization


def test_completion_prompt_forms_are_normalized() -> None:
    assert completion(prompt="abc").prompt == "abc"
    assert completion(prompt=["abc"]).prompt == "abc"
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=[[4, 5]]).prompt == [4, 5]
    req = completion(prompt=[7])
    assert req.prompt_token_ids == [7] and req.prompt_text is None
    req = completion(prompt="t")
    assert req.prompt_text == "t" and req.prompt_token_ids is None


def test_extra_fields_are_ignored() -> None:
    req = completion(frequency_penalty=0.5, some_future_field={"x": 1})
    assert not hasattr(req, "some_future_field")


def test_defaults() -> None:
    req = completion()
    assert req.max_tokens is None and req.temperature is None and req.stream is False
    assert req.n == 1 and req.priority == 0 and req.stop == [] and req.stop_token_ids == []
    assert not req.include_usage


def test_chat_content_parts_joined_and_conversation() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert req.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


def test_stop_normalization() -> None:
    assert completion(stop="x").stop == ["x"]
    assert completion(stop=["a", "b"]).stop == ["a", "b"]
    assert completion(stop=None).stop == []


def test_include_usage() -> None:
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage


def test_chat_max_completion_tokens_wins() -> None:
    req = chat(max_tokens=5, max_completion_tokens=7)
    assert req.requested_max_tokens == 7 and req.max_tokens_param == "max_completion_tokens"
    assert chat(max_tokens=5).requested_max_tokens == 5


# ---------------------------------------------------------------------------------------------
# Validation: every rule gives 400 naming the parameter

C = CompletionRequest
CH = ChatCompletionRequest
BASE_C: dict[str, Any] = {"model": "m", "prompt": "hello"}
BASE_CH: dict[str, Any] = {"model": "m", "messages": CHAT_MSGS}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", "16"),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("seed", 2**70),
        ("seed", "7"),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", 5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["x"]),
        ("best_of", 0),  # under n
        ("n", 0),
        ("logprobs", 6),
        ("logprobs", -1),
        ("echo", "yes"),
        ("max_tokens", 0),  # 0 only with echo
        ("priority", "high"),
        ("stream", "yes"),
        ("ignore_eos", 1),
        ("return_token_ids", "true"),
        ("user", 5),
    ],
)
def test_completion_field_rejected(field: str, value: Any) -> None:
    expect_400(C, {**BASE_C, field: value}, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("temperature", 3),
        ("top_p", -1.0),
        ("top_k", -5),
        ("n", -1),
        ("logprobs", "yes"),
        ("top_logprobs", 2),  # without logprobs
        ("top_logprobs", -1),
        ("stop", ["1", "2", "3", "4", "5"]),
    ],
)
def test_chat_field_rejected(field: str, value: Any) -> None:
    expect_400(CH, {**BASE_CH, field: value}, field)


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ("", "empty"),
        ([], "empty"),
        ([""], "empty"),
        ([[]], "empty"),
        (["a", "b"], "only one prompt per request is supported"),
        ([[1], [2]], "only one prompt per request is supported"),
        ([1, -2], ">= 0"),
        ([1, "a"], "token ids"),
        ([True, 1], "token ids"),
        (12, "string or a list of token ids"),
        ({"text": "x"}, "string or a list of token ids"),
    ],
)
def test_bad_prompt(prompt: Any, fragment: str) -> None:
    err = expect_400(C, {**BASE_C, "prompt": prompt}, "prompt")
    assert fragment in err.message


def test_missing_prompt() -> None:
    err = expect_400(C, {"model": "m"}, "prompt")
    assert "required" in err.message


@pytest.mark.parametrize(
    ("messages", "param", "fragment"),
    [
        ([], "messages", "at least one message"),
        ("hi", "messages", "list"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role", "must be one of"),
        ([{"role": "user"}], "messages[0].content", "required"),
        ([{"content": "x"}], "messages[0].role", "required"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content",
            "only 'text' content parts",
        ),
        ([{"role": "user", "content": 5}], "messages[0].content", "string"),
        (["hi"], "messages[0]", "must be a JSON object"),
    ],
)
def test_bad_messages(messages: Any, param: str, fragment: str) -> None:
    err = expect_400(CH, {**BASE_CH, "messages": messages}, param)
    assert fragment in err.message


def test_missing_messages() -> None:
    expect_400(CH, {"model": "m"}, "messages")


def test_stream_options_without_stream() -> None:
    err = expect_400(C, {**BASE_C, "stream_options": {"include_usage": True}}, "stream_options")
    assert "stream" in err.message


def test_error_message_is_readable_and_truncated() -> None:
    err = expect_400(C, {**BASE_C, "max_tokens": "x" * 500}, "max_tokens")
    assert len(err.message) < 200
    assert "pydantic" not in err.message and "errors.pydantic.dev" not in err.message


def test_several_errors_reported_together() -> None:
    with pytest.raises(ProtocolError) as info:
        validate_request({**BASE_C, "temperature": 9, "top_p": 9}, C)
    assert "temperature" in info.value.message and "top_p" in info.value.message


def test_logprobs_zero_and_echo_false_are_accepted() -> None:
    assert completion(logprobs=0, echo=False).echo is False
    assert chat(logprobs=False, top_logprobs=0).logprobs is False


# ---------------------------------------------------------------------------------------------
# parse_request


def test_parse_request_ok() -> None:
    req = parse_request(json.dumps({"prompt": [1, 2], "max_tokens": 3}).encode(), C)
    assert req.prompt == [1, 2] and req.max_tokens == 3 and req.model is None


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff\xfe\x00", "UTF-8"),
        (b"[1, 2]", "JSON object"),
        (b'"prompt"', "JSON object"),
    ],
)
def test_parse_request_malformed(raw: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(raw, C)
    assert info.value.status_code == 400 and fragment in info.value.message


def test_parse_request_nan_literal() -> None:
    # Python's json accepts the non-standard NaN literal; validation must still refuse it.
    with pytest.raises(ProtocolError) as info:
        parse_request(b'{"prompt": "x", "temperature": NaN}', C)
    assert info.value.param == "temperature"


# ---------------------------------------------------------------------------------------------
# Model-dependent limits


def test_check_max_tokens_ok_returns_room() -> None:
    assert check_max_tokens(completion(max_tokens=6), 10, 16) == 6
    assert check_max_tokens(completion(), 10, 16) == 6


def test_check_max_tokens_too_large() -> None:
    with pytest.raises(ProtocolError) as info:
        check_max_tokens(completion(max_tokens=10**12), 10, 16)
    err = info.value
    assert err.status_code == 400 and err.param == "max_tokens"
    assert "16" in err.message and "<= 6" in err.message


def test_check_max_tokens_names_chat_alias() -> None:
    with pytest.raises(ProtocolError) as info:
        check_max_tokens(chat(max_completion_tokens=100), 10, 16)
    assert info.value.param == "max_completion_tokens"


def test_prompt_too_long() -> None:
    with pytest.raises(ProtocolError) as info:
        check_max_tokens(chat(), 16, 16)
    assert info.value.status_code == 400 and info.value.param == "messages"


def test_check_token_ids() -> None:
    check_token_ids([0, 99], 100, "prompt")
    for bad in ([100], [-1], [5, 1000]):
        with pytest.raises(ProtocolError) as info:
            check_token_ids(bad, 100, "prompt")
        assert info.value.status_code == 400 and info.value.param == "prompt"
        assert "vocabulary" in info.value.message


def test_check_limits() -> None:
    assert check_limits(completion(prompt=[1, 2]), [1, 2], 10, 50) == 8
    with pytest.raises(ProtocolError) as info:
        check_limits(completion(prompt=[1, 60]), [1, 60], 10, 50)
    assert info.value.param == "prompt"
    with pytest.raises(ProtocolError) as info:
        check_limits(completion(stop_token_ids=[50]), [1], 10, 50)
    assert info.value.param == "stop_token_ids"
    with pytest.raises(ProtocolError) as info:
        check_limits(completion(), [], 10, 50)
    assert "empty" in info.value.message


def test_check_model() -> None:
    assert check_model(None, ["a", "b"]) == "a"
    assert check_model("b", ["a", "b"]) == "b"
    with pytest.raises(ProtocolError) as info:
        check_model("zzz", ["a"])
    err = info.value
    assert err.status_code == 404 and err.type == "NotFoundError" and err.param == "model"
    assert "zzz" in err.message


# ---------------------------------------------------------------------------------------------
# SamplingParams


def test_to_sampling_params_defaults() -> None:
    sp = to_sampling_params(completion(), default_max_tokens=33)
    assert sp == SamplingParams(max_tokens=33, temperature=1.0, top_p=1.0, top_k=0)


def test_to_sampling_params_full() -> None:
    req = completion(
        max_tokens=5,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=42,
        stop=["\n", "END"],
        stop_token_ids=[2, 3],
        ignore_eos=True,
    )
    sp = to_sampling_params(req, default_max_tokens=100)
    assert sp == SamplingParams(
        max_tokens=5,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        seed=42,
        ignore_eos=True,
        stop_token_ids=(2, 3),
        stop=("\n", "END"),
    )
    assert sp.is_greedy and isinstance(sp.stop, tuple) and isinstance(sp.stop_token_ids, tuple)
    assert to_sampling_params(completion(top_k=40), 1).top_k == 40


def test_to_sampling_params_chat_uses_max_completion_tokens() -> None:
    assert to_sampling_params(chat(max_completion_tokens=9), 100).max_tokens == 9


def test_to_sampling_params_nan_safe() -> None:
    # model_construct skips validation; conversion must still refuse NaN.
    req = CompletionRequest.model_construct(**{**completion().__dict__, "temperature": math.nan})
    with pytest.raises(ProtocolError) as info:
        to_sampling_params(req, 16)
    assert info.value.param == "temperature"


def test_to_sampling_params_no_room() -> None:
    with pytest.raises(ProtocolError):
        to_sampling_params(completion(), default_max_tokens=0)


# ---------------------------------------------------------------------------------------------
# Responses


def test_ids() -> None:
    a, b = new_completion_id(), new_chat_completion_id()
    assert a.startswith("cmpl-") and b.startswith("chatcmpl-")
    int(a.removeprefix("cmpl-"), 16)
    assert new_completion_id() != a


def test_completion_response_shape() -> None:
    body = completion_response(Head("cmpl-1", "m", 123), "hi there", "stop", 3, 2, None, None)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 123,
        "model": "m",
        "choices": [{"index": 0, "text": "hi there", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def test_completion_response_token_ids() -> None:
    body = completion_response(Head("cmpl-1", "m", 1), "x", "length", 2, 1, [9], [1, 2])
    assert body["choices"][0]["token_ids"] == [9]
    assert body["choices"][0]["prompt_token_ids"] == [1, 2]


def test_chat_completion_response_shape() -> None:
    body = chat_completion_response(Head("chatcmpl-1", "m", 5), "yo", "length", 4, 1, [7], [1, 2])
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "yo"}
    assert choice["finish_reason"] == "length" and choice["token_ids"] == [7]
    assert body["prompt_token_ids"] == [1, 2]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    plain = chat_completion_response(Head("chatcmpl-1", "m", 5), "yo", "stop", 4, 1)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completion_chunk() -> None:
    chunk = completion_chunk(Head("cmpl-1", "m", 1), "ab")
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]
    last = completion_chunk(Head("cmpl-1", "m", 1), "", "stop", token_ids=[3], include_usage=True)
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["token_ids"] == [3] and last["usage"] is None


def test_chat_chunks() -> None:
    first = chat_completion_chunk(Head("chatcmpl-1", "m", 1), first=True, prompt_token_ids=[1])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None and first["prompt_token_ids"] == [1]
    mid = chat_completion_chunk(Head("chatcmpl-1", "m", 1), "tok", token_ids=[5])
    assert mid["choices"][0]["delta"] == {"content": "tok"}
    assert mid["choices"][0]["token_ids"] == [5]
    end = chat_completion_chunk(Head("chatcmpl-1", "m", 1), None, "stop")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"


def test_usage_chunk() -> None:
    u = usage_chunk(Head("chatcmpl-1", "m", 1), 3, 4, chat=True)
    assert u["choices"] == [] and u["object"] == "chat.completion.chunk"
    assert u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert usage_chunk(Head("cmpl-1", "m", 1), 0, 0, chat=False)["object"] == "text_completion"


def test_models_response() -> None:
    body = models_response(["a", "b"], 10)
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["a", "b"]
    assert body["data"][0] == {"id": "a", "object": "model", "created": 10, "owned_by": "tokenflow"}


# ---------------------------------------------------------------------------------------------
# SSE


def test_sse_dict_roundtrip() -> None:
    data = {"text": "line1\nline2 ünï", "n": 1}
    frame = sse(data)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2  # the JSON itself never carries a raw newline
    assert json.loads(frame[len(b"data: ") : -2].decode()) == data


def test_sse_string_and_done() -> None:
    assert sse("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"
    assert sse("a\nb") == b"data: a\ndata: b\n\n"


# ---------------------------------------------------------------------------------------------
# StopStringMatcher


def run_matcher(stops: list[str], deltas: list[str]) -> tuple[list[str], bool, str]:
    m = StopStringMatcher(stops)
    emitted: list[str] = []
    stopped = False
    for d in deltas:
        out, stopped = m.feed(d)
        emitted.append(out)
        if stopped:
            break
    tail = m.flush()
    return emitted, stopped, "".join(emitted) + tail


def test_stop_string_split_over_three_deltas() -> None:
    emitted, stopped, text = run_matcher(["STOP"], ["Hello S", "T", "OP and more"])
    assert stopped and text == "Hello "
    # Nothing of the stop string ever leaves the matcher, even temporarily.
    assert emitted == ["Hello ", "", ""]


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.held == "E"
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)
    assert m.held == ""
    assert m.feed("E") == ("", False)
    assert m.flush() == "E"  # generation ended: the held prefix was real text


def test_false_start_overlapping_real_stop() -> None:
    # "aab" holds "a", then sees "aa" (false start of "ab" at the first a) and stops at "ab".
    _, stopped, text = run_matcher(["ab"], ["x", "a", "a", "b", "zzz"])
    assert stopped and text == "xa"


def test_multiple_stop_strings() -> None:
    m = StopStringMatcher(["###", "\n\n", "User:"])
    assert m.feed("answer\n") == ("answer", False)
    # "\n" is released (it can no longer become "\n\n"); "Us" may start "User:" so waits.
    assert m.feed("Us") == ("\n", False)
    assert m.held == "Us"
    out, stopped = m.feed("er: more")
    assert (out, stopped) == ("", True) and m.matched == "User:"
    assert m.feed("anything") == ("", True)
    assert m.flush() == ""


def test_first_completed_stop_wins() -> None:
    out, stopped = apply_stop_strings("xabcd", ["abcd", "bc"])
    assert stopped and out == "xa"
    out, stopped = apply_stop_strings("one two three", ["three", "two"])
    assert stopped and out == "one "


def test_stop_in_single_delta_and_no_stops() -> None:
    assert apply_stop_strings("abc<|end|>def", ["<|end|>"]) == ("abc", True)
    assert apply_stop_strings("no stop here", ["zzz"]) == ("no stop here", False)
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False) and m.flush() == ""


def test_stop_matcher_char_by_char_matches_one_shot() -> None:
    text = "The answer is 42.\nQ: next question\n"
    stops = ["\nQ:", "question"]
    _, stopped, streamed = run_matcher(stops, list(text))
    assert (streamed, stopped) == apply_stop_strings(text, stops) == ("The answer is 42.", True)


# ---------------------------------------------------------------------------------------------
# Batch format


def line(**fields: Any) -> str:
    base = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": CHAT_MSGS},
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...})


def test_parse_batch_line_ok() -> None:
    item = parse_batch_line(line())
    assert item == BatchItem("r1", "POST", "/v1/chat/completions", item.body)
    req = validate_request(item.body, request_class_for_url(item.url))
    assert isinstance(req, ChatCompletionRequest)
    item = parse_batch_line(line(url="/v1/completions", body={"prompt": "x"}) + "\n")
    assert request_class_for_url(item.url) is CompletionRequest


@pytest.mark.parametrize(
    ("raw", "param", "custom_id"),
    [
        ("{bad json", None, None),
        ("", None, None),
        ("[1]", None, None),
        (line(custom_id=...), "custom_id", None),
        (line(custom_id=5), "custom_id", None),
        (line(custom_id=""), "custom_id", None),
        (line(url="/v1/embeddings"), "url", "r1"),
        (line(url=...), "url", "r1"),
        (line(method="GET"), "method", "r1"),
        (line(body=...), "body", "r1"),
        (line(body="text"), "body", "r1"),
    ],
)
def test_parse_batch_line_malformed(raw: str, param: str | None, custom_id: str | None) -> None:
    with pytest.raises(BatchLineError) as info:
        parse_batch_line(raw)
    err = info.value
    assert isinstance(err, ProtocolError) and err.status_code == 400
    assert err.param == param and err.custom_id == custom_id
    if param:
        assert param in err.message


def test_request_class_for_unknown_url() -> None:
    with pytest.raises(ProtocolError):
        request_class_for_url("/v1/embeddings")


def test_batch_output_line_success() -> None:
    resp = completion_response(Head("cmpl-9", "m", 1), "x", "stop", 1, 1)
    out = batch_output_line("r1", resp, None, 200)
    assert out["id"].startswith("batch_req_") and out["custom_id"] == "r1"
    assert out["response"] == {"status_code": 200, "request_id": "cmpl-9", "body": resp}
    assert out["error"] is None
    json.dumps(out)


def test_batch_output_line_without_request() -> None:
    out = batch_output_line(None, None, {"code": "invalid_line", "message": "bad"}, None)
    assert out["response"] is None and out["error"]["code"] == "invalid_line"


def test_batch_error_line() -> None:
    err = ProtocolError(400, "'temperature' must be ...", param="temperature")
    out = batch_error_line("r2", err)
    assert out["custom_id"] == "r2"
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"] == error_body(err)
    assert out["response"]["request_id"].startswith("req_")
    assert out["error"] == {"code": "invalid_request_error", "message": err.message}
