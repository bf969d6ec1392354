"""Log-probabilities through the real `openai` client and the two-worker cluster: chat's
`logprobs`/`top_logprobs` and completions' `logprobs`/`echo`/`max_tokens=0`, streamed and
not, equal to transformers' `log_softmax` of the same checkpoint (fp32, within 1e-4)."""

from __future__ import annotations

import random

import pytest
import torch
from openai import OpenAI

from tests.integration.conftest import Cluster
from workers.presets import resolve_model
from workers.tokenizer import Tokenizer

MODEL = "builtin:tiny"
TOL = 1e-4


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    """ids -> [len, vocab] log-probabilities: row i scores token i + 1."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(resolve_model(MODEL),
                                                    dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_chat_logprobs_match_transformers(client: OpenAI, reference) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}],
                  max_tokens=10, temperature=0.9, seed=5, logprobs=True, top_logprobs=3,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    ids = choice.token_ids  # type: ignore[attr-defined]
    content = choice.logprobs.content
    assert len(content) == len(ids) == resp.usage.completion_tokens == 10
    rows = reference(resp.prompt_token_ids + ids)[len(resp.prompt_token_ids) - 1 :]  # type: ignore[attr-defined]
    for i, item in enumerate(content):
        assert abs(item.logprob - rows[i, ids[i]].item()) < TOL
        assert item.bytes == list(item.token.encode())
        top = rows[i].topk(3)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top.values.tolist(),
                                                                      abs=TOL)
    # Streamed: the same seed gives the same tokens and the same log-probabilities, to fp32's
    # last bits: the repeat may hit the prefix cache (or the other worker's), so its prompt
    # runs in GEMMs of another shape, summed in another order.
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs
                for item in c.choices[0].logprobs.content]
    assert [s.token for s in streamed] == [c.token for c in content]
    assert [s.logprob for s in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)


def test_chat_without_logprobs_has_none(client: OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert resp.choices[0].logprobs is None


def test_completion_logprobs_and_text_offsets(client: OpenAI, reference) -> None:
    prompt = prompt_ids(1, 12)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
                                      logprobs=2, extra_body={"return_token_ids": True,
                                                              "ignore_eos": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    ids = choice.token_ids  # type: ignore[attr-defined]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) == 8
    rows = reference(prompt + ids)[len(prompt) - 1 :]
    for i, token_id in enumerate(ids):
        assert abs(lp.token_logprobs[i] - rows[i, token_id].item()) < TOL
        assert len(lp.top_logprobs[i]) <= 2  # a dict: two tokens may share a text
        assert max(lp.top_logprobs[i].values()) == pytest.approx(rows[i].max().item(), abs=TOL)
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scores_the_prompt_with_max_tokens_zero(client: OpenAI, reference,
                                                     stream: bool) -> None:
    """The evaluation harness's call: echo, logprobs, max_tokens=0. The second call's prompt
    is in the prefix cache (a plain request cached it) and must still score every prompt
    token. (Chunked prompts: tests/reference/test_logprobs_vs_transformers.py.)"""
    prompt = prompt_ids(2 + stream, 70)
    rows = reference(prompt)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    for attempt in range(2):
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            tokens = [t for lp in lps for t in lp.tokens]
            token_logprobs = [x for lp in lps for x in lp.token_logprobs]
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            resp = client.completions.create(**kwargs)
            choice = resp.choices[0]
            text, tokens = choice.text, choice.logprobs.tokens
            token_logprobs = choice.logprobs.token_logprobs
            assert resp.usage.prompt_tokens == 70 and resp.usage.completion_tokens == 0
            assert choice.logprobs.top_logprobs[0] is None
        assert len(tokens) == 70 and token_logprobs[0] is None
        for pos in range(1, 70):
            assert abs(token_logprobs[pos] - rows[pos - 1, prompt[pos]].item()) < TOL
        assert text == Tokenizer(resolve_model(MODEL)).decode(prompt)  # nothing generated
        if attempt == 0:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)


def test_echo_with_generation(client: OpenAI, reference) -> None:
    prompt = prompt_ids(4, 10)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True,
                                      logprobs=1, temperature=0.0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    ids = choice.token_ids  # type: ignore[attr-defined]
    lp = choice.logprobs
    assert len(lp.tokens) == 14 and resp.usage.completion_tokens == 4
    rows = reference(prompt + ids)
    full = prompt + ids
    for pos in range(1, 14):
        assert abs(lp.token_logprobs[pos] - rows[pos - 1, full[pos]].item()) < TOL
    prompt_text = Tokenizer(resolve_model(MODEL)).decode(prompt)
    assert choice.text.startswith(prompt_text)
    assert lp.text_offset[10] == len(prompt_text)


def test_logprob_limits_are_400(client: OpenAI) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="hi", logprobs=6)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
