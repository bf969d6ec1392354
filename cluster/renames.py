"""Settings that moved to another name: each old name fails at start with a message that
names its new home (never silently ignored, never half-applied). The table is the one in
docs/architecture.md ("Renamed settings")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# old `section.field` -> where it lives now
OLD_TO_NEW: dict[str, str] = {
    "batch.ready_wait_s": "batch.start_timeout_s",
    "calibration.itl_slo_ms": "slo.itl_ms",
    "metrics.ttft_slo_s": "slo.ttft_s",
    "protections.slo_headroom_quantile": "slo.headroom_quantile",
    "protections.slo_headroom_window": "slo.headroom_window",
    "protections.max_slo_headroom": "slo.max_headroom",
    "batch.max_num_batched_tokens": "batch.overrides.scheduler.max_num_batched_tokens",
    "batch.max_concurrent_chunks": "batch.overrides.scheduler.max_concurrent_chunks",
    "batch.worker_num_threads": "batch.overrides.worker.num_threads",
}


def moved(old: str) -> str:
    """The message for an old dotted name."""
    return f"{old} is now {OLD_TO_NEW[old]}"


def moved_in(data: Mapping[str, Any]) -> list[str]:
    """A message per old name that `data` (sections as mappings: keyword arguments,
    serve.yaml `args`, the environment merged in) sets."""
    found = []
    for old in OLD_TO_NEW:
        section, _, name = old.partition(".")
        values = data.get(section)
        if isinstance(values, Mapping) and name in values:
            found.append(moved(old))
    return found


def check_moved(data: Any) -> None:
    """Raise ValueError naming every old name `data` sets and its new home."""
    found = moved_in(data) if isinstance(data, Mapping) else []
    if found:
        raise ValueError(f"renamed setting(s): {'; '.join(found)}")


def moved_env(name: str, prefix: str, delimiter: str) -> str | None:
    """`name is now NEW` for a `TOKENFLOW_SECTION__FIELD` variable of an old name."""
    old = name[len(prefix):].lower().replace(delimiter, ".", 1)
    if old not in OLD_TO_NEW:
        return None
    new_env = prefix + OLD_TO_NEW[old].upper().replace(".", delimiter)
    return f"{name} ({moved(old)}: {new_env})"
