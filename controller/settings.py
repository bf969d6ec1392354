"""Settings fields for the components' stdlib dataclass configs.

`setting()` keeps a field's description and bounds in its metadata: the pydantic edge
(`cluster/config.py`) reads them as `Field(...)` arguments when it validates the nested
config, and `check_settings()` applies the same bounds when code builds a config directly.
Pydantic-free, so the controller, the KV cache and the workers import no pydantic.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

# Forbid unknown keys when pydantic validates one of these dataclasses (a plain dict is a
# valid pydantic ConfigDict).
FORBID_EXTRA = {"extra": "forbid"}

_BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
    "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def setting(default: Any = dataclasses.MISSING, *, description: str,
            default_factory: Any = dataclasses.MISSING, **bounds: float) -> Any:
    """A dataclass field with a description and optional ge/gt/le/lt bounds."""
    unknown = set(bounds) - set(_BOUNDS)
    if unknown:
        raise TypeError(f"unknown bounds {sorted(unknown)}")
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"description": description, **bounds})


def check_settings(config: Any) -> None:
    """Raise ValueError naming the first field outside its `setting()` bounds."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for key, (holds, sign) in _BOUNDS.items():
            if key in f.metadata and not holds(value, f.metadata[key]):
                raise ValueError(f"{type(config).__name__}.{f.name} must be {sign} "
                                 f"{f.metadata[key]}, got {value}")


def check_thread_count(name: str, num_threads: int | None) -> None:
    """A torch thread count as `worker.num_threads` counts them (N > 0 threads; -1 every
    core, -2 all but one, ...; None the process's default): 0 means nothing."""
    if num_threads == 0:
        raise ValueError(f"{name} must not be 0 (-1 means every core)")
