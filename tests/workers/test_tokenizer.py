"""Builtin byte-level tokenizer, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from workers.presets import NUM_SPECIAL_TOKENS
from workers.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

TEXTS = (
    "Hello, world!",
    "héllo wörld — naïve café",
    "你好，世界。日本語のテキスト",
    "emoji 🙂👍🏽 and zwj 👩‍👩‍👧",
    "tabs\tand\nnewlines  and   spaces ",
    "",
)


@pytest.fixture(scope="module")
def tokenizer(tiny_path: Path) -> Tokenizer:
    return Tokenizer(tiny_path)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # no merges: one token per byte
    assert tokenizer.decode(ids) == text


def test_vocab_layout(tokenizer):
    assert tokenizer.vocab_size == 512
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("A") == [NUM_SPECIAL_TOKENS + ord("A")]
    assert tokenizer.encode("<s>hi</s>") == [1, *tokenizer.encode("hi"), 2]
    # Every id decodes to something; fillers read as `<id>`.
    for token_id in range(tokenizer.vocab_size):
        assert tokenizer.decode([token_id], skip_special_tokens=False) != ""
    assert tokenizer.decode([300]) == "<300>"
    assert tokenizer.decode([1, 300, 2]) == "<300>"  # specials skipped by default


def test_default_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False) == (
        "<|user|>\nHi\n"
    )


def test_custom_and_missing_chat_template(tiny_path, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tiny_path / "tokenizer.json", folder)
    bare = Tokenizer(folder)  # no tokenizer_config.json at all
    assert bare.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|user|>\nx\n<|assistant|>\n"
    )
    config = {
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "default",
             "template": "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]"
                         "{{ eos_token }}{% endfor %}"},
        ],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    custom = Tokenizer(folder)
    text = custom.apply_chat_template([{"role": "user", "content": "a"}])
    assert text == "<s>[a]</s>"
    assert custom.encode(text)[0] == 1 and custom.encode(text)[-1] == 2


def test_incremental_detokenizer_matches_full_decode(tokenizer):
    text = " ".join(TEXTS)
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        detok = IncrementalDetokenizer(tokenizer)
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            deltas.append(detok.push(ids[i : i + n]))
            i += n
        assert all(REPLACEMENT_CHAR not in d for d in deltas)
        assert "".join(deltas) + detok.flush() == text
        assert detok.flush() == ""


def test_incremental_detokenizer_holds_back_partial_characters(tokenizer):
    ids = tokenizer.encode("世")  # three UTF-8 bytes, one token each
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:2]) == ""
    assert detok.push(ids[2:]) == "世"
    assert detok.push([2]) == ""  # eos is a special token: skipped
    # A stream that ends on invalid bytes still gets them out at flush.
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == REPLACEMENT_CHAR
