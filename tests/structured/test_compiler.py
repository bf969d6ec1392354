"""The grammar cache on the builtin tokenizer: cached by text, clear reasons for bad
grammars, no control character or special token inside a JSON string."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from workers.presets import resolve_model
from workers.structured import spec as s
from workers.structured.compiler import GrammarCache, GrammarError, cache_for
from workers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    tokenizer = Tokenizer(resolve_model("builtin:tiny"))
    return cache_for(tokenizer, 512, [2])


def _allowed(cache: GrammarCache, kind: str, text: str, prefix: str) -> set[int]:
    matcher = xgr.GrammarMatcher(cache.compile(kind, text))
    assert matcher.accept_string(prefix)
    bitmask = xgr.allocate_token_bitmask(1, 512)
    matcher.fill_next_token_bitmask(bitmask)
    return {i for i in range(512) if (int(bitmask[0, i // 32]) >> (i % 32)) & 1}


def test_compiled_once_per_text(cache: GrammarCache) -> None:
    text = s.canonical_json({"type": "object", "properties": {"k": {"type": "integer"}}})
    before = (cache.stats.num_compiles, cache.stats.num_cache_hits)
    first = cache.compile(s.JSON_SCHEMA, text)
    assert cache.compile(s.JSON_SCHEMA, text) is first
    assert (cache.stats.num_compiles, cache.stats.num_cache_hits) == (before[0] + 1,
                                                                      before[1] + 1)
    assert cache.stats.compile_s > 0


@pytest.mark.parametrize(("kind", "text", "reason"), [
    (s.JSON_SCHEMA, '{"type": "objekt"}', "objekt"),
    (s.JSON_SCHEMA, "{not json", "json"),
    (s.REGEX, "[a-", ""),
    (s.GRAMMAR, "root ::= missing_rule", "missing_rule"),
])
def test_bad_grammar_names_its_reason(cache: GrammarCache, kind: str, text: str,
                                      reason: str) -> None:
    with pytest.raises(GrammarError) as err:
        cache.compile(kind, text)
    message = str(err.value)
    assert message and reason.lower() in message.lower()
    assert ".cc:" not in message  # no C++ source location


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 8}])
def test_json_strings_refuse_control_characters_and_specials(cache: GrammarCache,
                                                             schema: dict) -> None:
    allowed = _allowed(cache, s.JSON_SCHEMA, json.dumps(schema), '"')
    control_bytes = {3 + b for b in range(32)}  # builtin ids: bytes start at 3
    assert not allowed & control_bytes
    assert not allowed & {0, 1}  # <pad>, <s>: special, decoded as nothing
    assert 3 + ord("a") in allowed
    # A UTF-16 surrogate's UTF-8 form (ED A0..BF ..) is not text: refused after its lead.
    matcher = xgr.GrammarMatcher(cache.compile(s.JSON_SCHEMA, json.dumps(schema)))
    assert matcher.accept_string('"') and matcher.accept_token(3 + 0xED)
    assert not matcher.accept_token(3 + 0xA0)
    assert matcher.accept_token(3 + 0x9F) and matcher.accept_token(3 + 0xBF)  # U+D7FF


def test_choice_escapes_its_literals(cache: GrammarCache) -> None:
    text = json.dumps(['say "hi"', "back\\slash"])
    assert _allowed(cache, s.CHOICE, text, 'say "hi') == {3 + ord('"')}
    assert _allowed(cache, s.CHOICE, text, "back\\") == {3 + ord("s")}


def test_concurrent_requests_for_one_grammar_compile_it_once(cache: GrammarCache) -> None:
    from concurrent.futures import ThreadPoolExecutor

    text = s.canonical_json({"type": "array", "items": {"type": "integer"}, "maxItems": 7})
    before = cache.stats.num_compiles
    with ThreadPoolExecutor(8) as pool:
        grammars = list(pool.map(lambda _: cache.compile(s.JSON_SCHEMA, text), range(16)))
    assert cache.stats.num_compiles == before + 1
    assert all(g is grammars[0] for g in grammars)
