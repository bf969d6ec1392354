"""Tenant shares of a step's prefill budget. Torch-free.

Each tenant with prefill work this step gets `budget x weight / sum(weights of tenants
with work)`, `{tenant: {used, max}}` in the seed's words. A share a tenant cannot use is
lent to the others in a second pass, so isolation never wastes budget. Decodes are not
part of it: they are scheduled first, 1 token each, whoever they belong to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class TenantShare:
    max: int
    used: int = 0

    @property
    def left(self) -> int:
        return self.max - self.used


@dataclass
class TenantStats:
    """Per-tenant token counters, exported as metrics at the edge."""

    tenant_to_prefill_tokens: dict[str, int] = field(default_factory=dict)
    tenant_to_decode_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, tenant: str, num_tokens: int, is_prefill: bool) -> None:
        counts = self.tenant_to_prefill_tokens if is_prefill else self.tenant_to_decode_tokens
        counts[tenant] = counts.get(tenant, 0) + num_tokens


def split_budget(budget: int, tenants: Iterable[str],
                 weights: Mapping[str, float]) -> dict[str, TenantShare] | None:
    """Shares for the tenants with prefill work, or None when one tenant (or none) has
    work: then there is nothing to isolate and the plain order applies."""
    active = list(dict.fromkeys(tenants))
    if len(active) < 2:
        return None
    tenant_to_weight = {t: max(weights.get(t, 1.0), 0.0) for t in active}
    total = sum(tenant_to_weight.values()) or float(len(active))
    return {t: TenantShare(int(budget * w / total)) for t, w in tenant_to_weight.items()}


def seq_cap(max_num_seqs: int, tenant: str, active_tenants: Iterable[str],
            weights: Mapping[str, float]) -> int:
    """Running requests a tenant may hold while other tenants wait: its weighted share
    of `max_num_seqs`, at least one, so a flood cannot take every slot."""
    active = set(active_tenants) | {tenant}
    total = sum(max(weights.get(t, 1.0), 0.0) for t in active) or float(len(active))
    return max(1, int(max_num_seqs * max(weights.get(tenant, 1.0), 0.0) / total))
