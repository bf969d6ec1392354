"""Triton JIT compiles as they happen, by benchmark phase.

The worker compiles its kernels and captures its graphs at start-up, so that no step pays a
compile: a compile inside a timed phase is a start-up hole (a specialisation the warm-up did
not reach) and costs that step about a second. Triton calls `knobs.runtime.jit_cache_hook`
before each compile and `jit_post_compile_hook` after; both are set here and only record.
Where Triton is missing, nothing is recorded and `installed` is False."""

from __future__ import annotations

import time
from typing import Any

# The phases that time steps of a started worker: a compile there is a start-up hole.
SERVING_PHASES = ("smoke_decode", "decode", "mixed", "prefill", "offline", "scene")


class JitLog:
    def __init__(self) -> None:
        self.phase: str | None = None
        self.events: list[dict[str, Any]] = []
        self.installed = False
        self._started: dict[str, float] = {}

    def install(self) -> JitLog:
        try:
            from triton import knobs
        except ImportError:
            return self
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        self.installed = True
        return self

    def _before(self, *, key: Any, **_: Any) -> bool:
        self._started[str(key)] = time.perf_counter()
        return False  # True would skip the compile

    def _after(self, *, key: Any, repr: str, fn: Any, **_: Any) -> bool:
        start = self._started.pop(str(key), None)
        self.events.append({
            "phase": self.phase, "kernel": getattr(fn, "name", str(fn)),
            "signature": repr[:400],
            "compile_s": None if start is None else time.perf_counter() - start})
        return False

    def report(self) -> dict[str, Any]:
        by_phase: dict[str, int] = {}
        for event in self.events:
            by_phase[str(event["phase"])] = by_phase.get(str(event["phase"]), 0) + 1
        serving = [e for e in self.events if e["phase"] in SERVING_PHASES]
        return {"installed": self.installed, "num_compiles": len(self.events),
                "by_phase": by_phase, "num_serving_compiles": len(serving),
                "serving_compiles": serving,
                "compile_s": sum(e["compile_s"] or 0.0 for e in self.events)}
