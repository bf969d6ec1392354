"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled with xgrammar and
the per-request matchers whose token masks constrain sampling.

- `spec`: what a request asks for, as (kind, text): the key grammars are cached by;
- `compiler`: `GrammarCache`, compiled grammars by their key, with hit/compile counters;
- `mask`: `GrammarMasks`, the worker's matchers and the step's batched bitmask.
"""
