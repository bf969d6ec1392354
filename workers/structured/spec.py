"""A request's constraint as (kind, text), torch-free and Ray-free.

The pair travels in `SamplingParams` (`grammar_kind`, `grammar_spec`) through the controller,
its journal and every worker, and is the key compiled grammars are cached by: equal requests
give equal text (JSON is dumped with sorted keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
CHOICE = "choice"  # spec: a JSON list of the allowed strings
GRAMMAR = "grammar"  # spec: EBNF (GBNF) text with a `root` rule
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def choice_to_ebnf(choices: list[str]) -> str:
    """One alternative per allowed string; each literal escaped as a JSON string, whose
    escapes (\\", \\\\, \\n, \\uXXXX) EBNF string literals share."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


@dataclass
class GrammarStats:
    """A grammar cache's counters (workers/structured/compiler.py)."""

    num_compiles: int = 0
    num_cache_hits: int = 0
    num_errors: int = 0
    compile_s: float = 0.0  # total seconds spent compiling
