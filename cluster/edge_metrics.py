"""Structured-output and tool-call series of one ingress replica, appended to `/metrics`.

Unlike the controller's snapshot these are counted where the work happens, at the edge
(grammars compile while a request is prepared, calls are parsed from its finished text), so
each replica reports its own: the series carry `replica` and are summed across replicas
(`sum without (replica)`)."""

from __future__ import annotations

import os

from cluster.frontend import Frontend
from cluster.metrics import PREFIX


def render_edge(frontend: Frontend | None, replica: str | None = None) -> str:
    """Prometheus text lines (counters) for `frontend`'s grammar cache and tool parsing."""
    if frontend is None:
        return ""
    replica = replica or str(os.getpid())
    stats = frontend.grammar_stats()
    series = [
        ("constrained_requests", "Requests with an output constraint (response_format, "
         "structured_outputs, guided_*, tool_choice required or named).",
         frontend.num_constrained_requests),
        ("grammar_compiles", "Grammars compiled (cache misses).", stats.num_compiles),
        ("grammar_cache_hits", "Grammars found compiled in the cache.", stats.num_cache_hits),
        ("grammar_errors", "Grammars refused as invalid (answered 400).", stats.num_errors),
        ("grammar_compile_seconds", "Seconds spent compiling grammars.", stats.compile_s),
        ("tool_call_parse_failures", "Generated text that looked like tool calls and did "
         "not parse (returned as content).", frontend.num_tool_parse_failures),
    ]
    lines = []
    for name, help_text, value in series:
        full = f"{PREFIX}edge_{name}"
        lines += [f"# HELP {full}_total {help_text}", f"# TYPE {full}_total counter",
                  f'{full}_total{{replica="{replica}"}} {float(value)!r}']
    return "\n".join(lines) + "\n"
