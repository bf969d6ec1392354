"""Compiled grammars by their (kind, text), one cache per process and vocabulary.

Compiling is CPU work (milliseconds for a small schema, more for a large vocabulary): the
edge compiles on its request-preparation executor (so a bad grammar is a 400 before
admission), a worker on its own thread pool as soon as it sees the request (`submit`)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from workers.structured import spec as s
from workers.structured.spec import GrammarStats
from workers.tokenizer import Tokenizer


class GrammarError(ValueError):
    """The grammar text is not valid (or not supported): the reason, for a 400."""


def tokenizer_info(backend_json: str, vocab: dict[str, int], vocab_size: int,
                   stop_token_ids: list[int], special_ids: set[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers` tokenizer: its vocabulary in id order and the byte
    encoding detected from the tokenizer's JSON. Special tokens (decoded as nothing) and ids
    the tokenizer lacks but the logits have are empty strings, which no grammar allows."""
    encoded = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size and token_id not in special_ids:
            encoded[token_id] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend_json)
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCache:
    """`compile(kind, text)`: thread-safe; at most `max_entries` grammars kept (LRU)."""

    def __init__(self, info: xgr.TokenizerInfo, max_entries: int = 256,
                 num_threads: int = 2) -> None:
        self.info = info
        self.max_entries = max_entries
        self._compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self._grammars: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        # Keys being compiled: a second request for one waits for it, not compiles it again.
        self._compiling: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.stats = GrammarStats()

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        key = (kind, text)
        while True:
            with self._lock:
                grammar = self._grammars.get(key)
                if grammar is not None:
                    self._grammars.move_to_end(key)
                    self.stats.num_cache_hits += 1
                    return grammar
                busy = self._compiling.get(key)
                if busy is None:
                    done = self._compiling[key] = threading.Event()
                    break
            busy.wait()  # then a hit, or (it failed) this thread's own try and error
        start = time.perf_counter()
        try:
            grammar = self._compile(kind, text)
        except (GrammarError, RuntimeError, ValueError, TypeError) as err:
            with self._lock:
                self.stats.num_errors += 1
                del self._compiling[key]
            done.set()
            if isinstance(err, GrammarError):
                raise
            raise GrammarError(_reason(err)) from None  # xgrammar's parse errors
        with self._lock:
            self.stats.num_compiles += 1
            self.stats.compile_s += time.perf_counter() - start
            self._grammars[key] = grammar
            while len(self._grammars) > self.max_entries:
                self._grammars.popitem(last=False)
            del self._compiling[key]
        done.set()
        return grammar

    def submit(self, kind: str, text: str) -> Future[xgr.CompiledGrammar]:
        """Compile on this cache's thread (one: compiles are already multi-threaded)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.compile, kind, text)

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        # Whitespace is not free inside JSON: a model (a random one above all) could spend
        # its whole budget on spaces between tokens.
        if kind in (s.JSON_SCHEMA, s.JSON_OBJECT):
            schema = text if kind == s.JSON_SCHEMA else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            return self._compiler.compile_grammar(_no_control_chars(str(grammar)))
        if kind == s.REGEX:
            return self._compiler.compile_regex(text)
        if kind == s.CHOICE:
            choices = json.loads(text)
            return self._compiler.compile_grammar(s.choice_to_ebnf(choices))
        if kind == s.GRAMMAR:
            return self._compiler.compile_grammar(text)
        raise GrammarError(f"unknown grammar kind {kind!r}")


# xgrammar 0.2.9's JSON strings: a string with maxLength/minLength repeats the first class,
# which lets raw control characters (U+0000-U+001F) through, and both classes take UTF-16
# surrogates (U+D800-U+DFFF, not valid in UTF-8 text: they decode as U+FFFD, so a string
# under maxLength would come back over it). JSON forbids both.
_STRING_CHAR_CLASSES = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _no_control_chars(ebnf: str) -> str:
    for char_class in _STRING_CHAR_CLASSES:
        ebnf = ebnf.replace(char_class, _JSON_STRING_CHAR)
    return ebnf


def _reason(err: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(err).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ".cc:" in text.split(" ", 1)[0]:
        text = text.split(" ", 1)[1] if " " in text else text
    return text[:300]


def cache_for(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
              num_threads: int = 2) -> GrammarCache:
    """A cache for a model: its tokenizer, its logits' width, its end-of-sequence ids."""
    info = tokenizer_info(tokenizer.backend_json(), tokenizer.vocab(), vocab_size,
                          stop_token_ids, tokenizer.special_token_ids())
    return GrammarCache(info, num_threads=num_threads)
