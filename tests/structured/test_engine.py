"""Constrained decoding in the engine (builtin:tiny, random weights, CPU): every output
parses and validates, whatever the weights, greedy and seeded; the worker's matchers follow
a request through preemption (a pool small enough to preempt gives the tokens of a roomy
one) and async scheduling; an over-long generation ends with "length" and its prefix."""

from __future__ import annotations

import json
import random

import pytest

from cluster.engine import LocalEngine
from controller.messages import SamplingParams, TokenLogprob
from tests.structured.schemas import Person
from workers.structured import spec as s
from workers.tokenizer import Tokenizer

SCHEMA = s.canonical_json(Person.model_json_schema())


def _engine(num_kv_blocks: int = 64, is_async: bool = False) -> LocalEngine:
    return LocalEngine(worker={"model": "builtin:tiny", "telemetry": False},
                       cache={"num_kv_blocks": num_kv_blocks, "block_size": 8},
                       scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 6,
                                  "max_chunk_tokens": 32, "async_scheduling": is_async})


def _params(i: int, kind: str = s.JSON_SCHEMA, spec: str = SCHEMA,
            max_tokens: int = 200) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=i,
                              grammar_kind=kind, grammar_spec=spec)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar_kind=kind,
                          grammar_spec=spec)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 259) for _ in range(rng.choice((4, 20, 45)))] for _ in range(n)]


def _run(engine: LocalEngine, params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    done = engine.generate(_prompts(len(params)), params)
    engine.check_integrity()
    return [(c.output_token_ids, c.finish_reason) for c in done]


def _text(engine: LocalEngine, ids: list[int]) -> str:
    return Tokenizer(engine.worker.model_path).decode(ids)


def test_json_schema_outputs_validate_and_survive_preemption() -> None:
    params = [_params(i) for i in range(6)]
    roomy = _engine()
    want = _run(roomy, params)
    for ids, reason in want:
        assert reason == "stop", _text(roomy, ids)
        Person.model_validate_json(_text(roomy, ids))
    tight = _engine(num_kv_blocks=32)
    got = _run(tight, params)
    assert tight.scheduler.stats.num_preemptions > 0
    assert got == want
    assert _run(_engine(is_async=True), params) == want


def test_unconstrained_output_would_not_parse() -> None:
    """The check above could fail: the same model without the grammar writes no JSON."""
    engine = _engine()
    ids, _ = _run(engine, [SamplingParams(max_tokens=60, temperature=0.0)])[0]
    with pytest.raises(ValueError):
        json.loads(_text(engine, ids))


@pytest.mark.parametrize(("kind", "spec", "check"), [
    (s.REGEX, r"[a-z]{3}-[0-9]{2,4}", lambda t: __import__("re").fullmatch(
        r"[a-z]{3}-[0-9]{2,4}", t) is not None),
    (s.CHOICE, json.dumps(["yes", "no", "maybe \"so\""]),
     lambda t: t in ("yes", "no", "maybe \"so\"")),
    (s.GRAMMAR, 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"',
     lambda t: t.startswith("(") and t.endswith(")")),
])
def test_other_kinds(kind: str, spec: str, check) -> None:
    engine = _engine()
    for ids, reason in _run(engine, [_params(i, kind, spec, 60) for i in range(2)]):
        text = _text(engine, ids)
        assert reason == "stop" and check(text), text


def test_json_object_is_an_object_or_its_prefix() -> None:
    """A free-form object (random weights: strings run long) within 60 tokens: a finished
    one parses as an object, a cut one starts like one."""
    engine = _engine()
    outputs = _run(engine, [_params(i, s.JSON_OBJECT, "", 60) for i in range(2)])
    for ids, reason in outputs:
        text = _text(engine, ids)
        assert text.startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_over_long_generation_ends_with_length_and_its_prefix() -> None:
    engine = _engine()
    ids, reason = _run(engine, [_params(0, max_tokens=7)])[0]
    assert reason == "length" and len(ids) == 7
    assert _text(engine, ids).startswith("{")


def _scored(engine: LocalEngine, prompt: list[int], params: SamplingParams
            ) -> tuple[list[int], list[TokenLogprob], list[TokenLogprob]]:
    """One request run to its end: (output ids, their log-probabilities, the prompt's)."""
    request_id = engine.add_request(prompt, params)
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    finished = False
    while not finished:
        for out in engine.step():
            assert out.request_id == request_id
            ids += out.new_token_ids
            logprobs += out.logprobs or []
            prompt_logprobs += out.prompt_logprobs or []
            finished = out.finish_reason is not None
    return ids, logprobs, prompt_logprobs


def test_logprobs_of_a_constrained_request_are_the_raw_models() -> None:
    """A request may ask for both: its log-probabilities are the model's, before the grammar
    mask. The same tokens echoed as an unconstrained prompt score the same, and greedy
    decoding under the grammar picks tokens the raw model does not rank first."""
    prompt = _prompts(1)[0]
    ids, logprobs, _ = _scored(_engine(), prompt, SamplingParams(
        max_tokens=40, temperature=0.0, logprobs=3, grammar_kind=s.JSON_SCHEMA,
        grammar_spec=SCHEMA))
    assert [e.token_id for e in logprobs] == ids
    _, _, echoed = _scored(_engine(), prompt + ids, SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=3))
    raw = echoed[len(prompt) - 1 :]
    assert [e.token_id for e in raw] == ids
    for got, want in zip(logprobs, raw, strict=True):
        assert got.top_ids == want.top_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)
    assert any(e.top_ids[0] != e.token_id for e in logprobs)  # the mask did steer
