"""Who is calling the HTTP edge: API keys, the tenant a request is charged to, and the
`priority` values it may ask for.

With keys configured (`edge.api_keys`, `TOKENFLOW_API_KEYS`), every /v1 route needs
`Authorization: Bearer KEY` (/metrics too with `edge.metrics_require_api_key`; /health never),
and a request's tenant is its key's: a header the client
chooses cannot spend another tenant's share. Without keys (local use on loopback) the
`X-Tenant-Id` header names the tenant, as before. Either way `priority` must lie in the
caller's range (lower runs first and may preempt others). Keys are compared by their
SHA-256 digests and never logged or echoed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster import protocol as p
from cluster.config import ApiKey, EdgeConfig

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tenant-id"
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Caller:
    tenant: str
    min_priority: int
    max_priority: int

    def check_priority(self, priority: int) -> None:
        if not self.min_priority <= priority <= self.max_priority:
            raise p.ProtocolError(400, f"'priority' must be between {self.min_priority} and "
                                  f"{self.max_priority} for this caller, got {priority}",
                                  param="priority", code="priority_out_of_range")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Authenticator:
    def __init__(self, edge: EdgeConfig, keys: Sequence[ApiKey]) -> None:
        self.edge = edge
        # Digest -> key: a lookup leaks no timing about the secret itself.
        self._digest_to_key = {_digest(k.key.get_secret_value()): k for k in keys}

    @property
    def is_open(self) -> bool:
        """No keys configured: anyone may call (local use)."""
        return not self._digest_to_key

    def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a request with these headers; ProtocolError 401 (bad or missing
        key) or 400 (a malformed tenant header without keys)."""
        if self.is_open:
            tenant = headers.get(TENANT_HEADER, DEFAULT_TENANT)
            if not _TENANT.match(tenant):
                raise p.ProtocolError(400, "the X-Tenant-Id header must be 1-64 letters, "
                                      "digits, '.', '_' or '-'", code="invalid_tenant")
            return Caller(tenant, self.edge.min_priority, self.edge.max_priority)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise p.ProtocolError(401, "You didn't provide an API key: send it as "
                                  "'Authorization: Bearer YOUR_KEY'",
                                  type="invalid_request_error", code="missing_api_key")
        key = self._digest_to_key.get(_digest(token.strip()))
        if key is None:
            raise p.ProtocolError(401, "Incorrect API key provided",
                                  type="invalid_request_error", code="invalid_api_key")
        return Caller(key.tenant,
                      self.edge.min_priority if key.min_priority is None else key.min_priority,
                      self.edge.max_priority if key.max_priority is None else key.max_priority)
