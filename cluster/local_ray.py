"""`ray.init` of the local cluster that `make serve` starts, without Ray's whole-second wait
for its own raylet.

Why: after starting its processes, `ray.init` asks the GCS for the new node's info through
a call that checks once a second until the raylet has registered (Ray's
GlobalStateAccessor). The raylet registers ~1-2 s after it starts, so `ray.init` took 2.6 s
or 3.6 s on a 2-core Xeon, depending on where the registration fell between two checks.
Here that call is preceded by a poll of the GCS's node table every `POLL_S`, so it runs
once the node is there and answers at once. 6 interleaved starts each: `ray.init` 2.23-3.20
s (median 2.37) against 2.61-3.63 (3.62); a warm `make serve` to /health 200, 6 each:
6.91-8.06 s (median 7.45) against 7.06-8.40 (7.84).

The poll uses Ray's private GCS client; any error in it (another Ray's API) leaves the wait
to Ray's own call, which then behaves as without it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

# Ray is imported inside the functions, not here: cluster/serve.py sets environment that Ray
# reads when it is first imported, after importing this module.

POLL_S = 0.05  # between two looks at the GCS's node table
WAIT_S = 30.0  # Ray's own limit for a new raylet to register


def node_table(gcs_address: str) -> Callable[[str], bool]:
    """A look at the node table of the GCS at `gcs_address`: node id (hex) -> whether it is
    alive. One client for all looks (not a new connection each). Ray's private client:
    raises where this Ray has another API."""
    from ray._raylet import GcsClient, NodeID
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    client = GcsClient(address=gcs_address)

    def is_alive(node_id: str) -> bool:
        alive = client.get_all_node_info(timeout=1,
                                         state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
        return NodeID.from_hex(node_id) in alive

    return is_alive


def wait_until_alive(gcs_address: str, node_id: str,
                     table: Callable[[str], Callable[[str], bool]] = node_table,
                     poll_s: float = POLL_S, wait_s: float = WAIT_S) -> bool:
    """Polls until the node is alive (True), `wait_s` passes or the poll fails (False)."""
    deadline = time.monotonic() + wait_s
    try:
        is_alive = table(gcs_address)
        while time.monotonic() < deadline:
            if is_alive(node_id):
                return True
            time.sleep(poll_s)
    except Exception:  # any failure: Ray's own call waits instead
        return False
    return False


@contextlib.contextmanager
def node_wait_polled(services: ModuleType | Any,
                     table: Callable[[str], Callable[[str], bool]] | None = None
                     ) -> Iterator[None]:
    """Within the block, `services.get_node` (Ray's call that `ray.init` waits on) first
    polls for the node in `table` (`node_table`); restored on exit. A `services` without
    it: as is."""
    original = getattr(services, "get_node", None)
    if original is None:
        yield
        return
    look = table if table is not None else node_table

    def get_node(gcs_address: str, node_id: str) -> Any:
        wait_until_alive(gcs_address, node_id, look)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def init_local(**kwargs: Any) -> None:
    """`ray.init(address="local", **kwargs)`: a new local cluster, never another one's."""
    import ray

    services = getattr(getattr(ray, "_private", None), "services", None)
    with node_wait_polled(services) if services is not None else contextlib.nullcontext():
        ray.init(address="local", **kwargs)
