"""The pieces of logprobs and n that need no model: prompt log-probabilities gathered once
per position, choice seeds, the OpenAI shapes, and a refused choice aborting the others."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.protocol.logprobs import LogprobsFormatter
from controller.choices import choice_params, choice_request_id, choice_seed
from controller.logprobs import PromptLogprobs, TokenLogprob
from controller.messages import Delta, DeltaBatch, SamplingParams
from controller.routing import QueueFullError
from tests.unit.test_ingress import FakeClient, ids, make_client


def entry(token: int, lp: float = -1.0) -> TokenLogprob:
    return TokenLogprob(token, lp, (token, 9), (lp, -2.0))


def test_prompt_logprobs_keep_each_position_once() -> None:
    gathered = PromptLogprobs()
    gathered.add(1, [entry(5), entry(6)])
    gathered.add(1, [entry(5), entry(6), entry(7)])  # recomputed after a preemption
    assert [e.token_id for e in gathered.take()] == [5, 6, 7]
    assert gathered.take() == [] and gathered.num_received == 3
    with pytest.raises(ValueError, match="position 9"):
        gathered.add(9, [entry(1)])  # a gap would misplace every later entry


def test_choice_seeds_are_stable_and_distinct() -> None:
    params = SamplingParams(seed=7)
    assert choice_params(params, "r", 0) is params
    seeds = [choice_params(params, "r", i).seed for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds[1] == choice_seed(7, 1)  # a pure function of (seed, index)
    assert choice_params(params, "r", 2).prompt_shared_with == "r"
    assert choice_request_id("r", 0) == "r" and choice_request_id("r", 3) == "r-3"


def test_logprobs_survive_delta_merging_and_batches() -> None:
    a = Delta("r", 0, [1], logprobs=[entry(1)], prompt_logprobs=[entry(4)])
    b = Delta("r", 0, [2], logprobs=[entry(2)])
    merged = Delta.merge([a, b])
    assert [e.token_id for e in merged.logprobs or []] == [1, 2]
    assert [e.token_id for e in merged.prompt_logprobs or []] == [4]
    assert list(DeltaBatch.of([merged])) == [merged]
    assert Delta.merge([Delta("r", 0, [1]), Delta("r", 0, [2])]).logprobs is None


def test_openai_shapes() -> None:
    text = {5: "a", 6: "bc", 9: "é"}.__getitem__
    chat = LogprobsFormatter(text).chat([TokenLogprob(9, -0.5, (9, 5), (-0.5, -1.5))])
    assert chat == {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169],
                                 "top_logprobs": [
                                     {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                                     {"token": "a", "logprob": -1.5, "bytes": [97]}]}]}
    body = LogprobsFormatter(text).completion([None, TokenLogprob(6, -0.25, (6,), (-0.25,))],
                                              [5])
    assert body == {"tokens": ["a", "bc"], "token_logprobs": [None, -0.25],
                    "top_logprobs": [None, {"bc": -0.25}], "text_offset": [0, 1]}


class RefuseSecond(FakeClient):
    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str) -> Any:
        if self.started:
            raise QueueFullError("full")
        return await super().submit(prompt_token_ids, params, request_id, priority, tenant)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_refused_choice_aborts_the_admitted_ones() -> None:
    fake = RefuseSecond(ids("hello"))
    resp = make_client(fake).post("/v1/completions", json={
        "model": "builtin:tiny", "prompt": "hi", "max_tokens": 3, "n": 3})
    assert resp.status_code == 429
    assert fake.aborted == fake.started and len(fake.started) == 1


def test_batch_lines_take_several_choices_up_to_the_edge_limit() -> None:
    import json

    from cluster.batch_io import prepare_line
    from cluster.config import TokenflowConfig
    from cluster.frontend import Frontend, Prepared
    from workers.presets import resolve_model
    from workers.tokenizer import Tokenizer

    frontend = Frontend(Tokenizer(resolve_model("builtin:tiny")), TokenflowConfig(), 512)

    def line(n: int) -> str:
        return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "builtin:tiny", "prompt": "hi", "n": n}})

    custom_id, result = prepare_line(line(2), frontend)
    assert custom_id == "a" and isinstance(result, Prepared)
    _, result = prepare_line(line(99), frontend)  # over edge.max_choices
    assert getattr(result, "param", None) == "n"


def test_prompt_logprobs_sent_again_after_a_resume_are_taken_once() -> None:
    from cluster.frontend import TextStream
    from workers.presets import resolve_model
    from workers.tokenizer import Tokenizer

    text = TextStream(Tokenizer(resolve_model("builtin:tiny")), ())
    first = [entry(4), entry(5)]
    assert text.take_scores(Delta("r", 0, [7], logprobs=[entry(7)],
                                  prompt_logprobs=first)) == [7]
    text.take_scores(Delta("r", 0, [8], logprobs=[entry(8)], prompt_logprobs=list(first)))
    assert text.prompt_logprobs == first
    assert [e.token_id for e in text.logprobs] == [7, 8]
