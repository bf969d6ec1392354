"""The elastic worker pool: workers join and leave a running controller.

A worker is added by creating one more named worker actor (Ray places it where its
resources are free, or keeps it pending until a node that has them joins); it is
`loading` until its model has loaded and it answered `info`, then it becomes a slot of its
own (the next index: indices never shift) and takes new requests. A drained worker takes
no new request; the ones it has run to their end, or, past the drain timeout, move to the
other workers by the path a dead worker's requests take (recomputed, the same tokens).
Then its step loop stops and its actor is killed for good, which returns its resources to
Ray. Neither needs a restart of the controller or of the ingress.

Ray-free: the actor hands in how to spawn a worker and how to kill one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from controller.autoscale import SCALE_REASONS, Direction
from controller.core import ControllerCore
from controller.messages import RequestOutput
from controller.worker_loop import WorkerSlot

logger = logging.getLogger(__name__)

# Every state `tokenflow_workers{state}` reports, 0 included, from the first scrape.
WORKER_STATES = ("loading", "serving", "draining")
OPERATOR = "operator"
# Every (direction, reason) of `tokenflow_scale_events_total`: the policy's and an operator's.
SCALE_EVENT_LABELS: tuple[tuple[Direction, str], ...] = (
    *SCALE_REASONS, ("up", OPERATOR), ("down", OPERATOR))


class PoolHost(Protocol):
    """What the pool needs of the controller actor."""

    core: ControllerCore | None
    slots: list[WorkerSlot]

    def attach_worker(self, handle: Any, info: Any, name: str) -> Awaitable[WorkerSlot]:
        """Build, open and start the slot of a worker that has loaded."""
        ...

    def deliver(self, outputs: list[RequestOutput]) -> None: ...

    def wake(self, workers: list[int]) -> None: ...


@dataclass
class LoadingWorker:
    name: str
    handle: Any
    reason: str
    task: asyncio.Task[None] | None = None
    error: str | None = None


class ElasticPool:
    def __init__(self, host: PoolHost, spawn: Callable[[int], Any],
                 kill: Callable[[Any], None], first_name_index: int,
                 name_of: Callable[[int], str]) -> None:
        self.host = host
        self.spawn = spawn  # creates the worker actor named by an index
        self.kill = kill  # kills a worker actor for good (its resources go back to Ray)
        self.name_of = name_of
        self.next_name_index = first_name_index  # never reused: a name is one actor
        self.loading: dict[str, LoadingWorker] = {}
        self.draining: dict[int, asyncio.Task[dict[str, Any]]] = {}
        self.removed: set[int] = set()
        self.worker_to_name: dict[int, str] = {}
        self.event_to_count: dict[tuple[str, str], int] = dict.fromkeys(SCALE_EVENT_LABELS, 0)
        self.changed = asyncio.Event()  # set on every join and removal, for waiters

    # -- state ------------------------------------------------------------------------
    def state_of(self, worker: int) -> str:
        if worker in self.removed:
            return "removed"
        return "draining" if worker in self.draining else "serving"

    def state_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(WORKER_STATES, 0)
        counts["loading"] = sum(1 for w in self.loading.values() if w.error is None)
        for slot in self.host.slots:
            state = self.state_of(slot.index)
            if state in counts:
                counts[state] += 1
        return counts

    def serving(self) -> list[int]:
        return [s.index for s in self.host.slots if self.state_of(s.index) == "serving"]

    def count(self, direction: str, reason: str) -> None:
        key = (direction, reason)
        self.event_to_count[key] = self.event_to_count.get(key, 0) + 1

    def listing(self) -> list[dict[str, Any]]:
        """One row per worker, removed ones included (for `tokenflow workers list`)."""
        core = self.host.core
        rows: list[dict[str, Any]] = []
        for slot in self.host.slots:
            sched = core.scheduler(slot.index) if core is not None else None
            rows.append({
                "worker": slot.index, "name": self.worker_to_name.get(slot.index, ""),
                "state": self.state_of(slot.index), "node": getattr(slot.info, "node_id", ""),
                "pid": slot.info.pid, "device": slot.info.device,
                "is_up": bool(core and core.workers[slot.index].is_up),
                "num_running": len(sched.running) if sched else 0,
                "num_waiting": sched.num_waiting if sched else 0})
        for loading in self.loading.values():
            rows.append({"worker": None, "name": loading.name,
                         "state": "failed" if loading.error else "loading",
                         "error": loading.error, "node": "", "pid": None, "device": "",
                         "is_up": False, "num_running": 0, "num_waiting": 0})
        return rows

    # -- joining ----------------------------------------------------------------------
    def add(self, reason: str = OPERATOR) -> LoadingWorker:
        """Create one more worker actor; it joins routing once its model has loaded."""
        index = self.next_name_index
        self.next_name_index += 1
        name = self.name_of(index)
        loading = LoadingWorker(name, self.spawn(index), reason)
        self.loading[name] = loading
        self.count("up", reason)
        # A fresh context: the caller going away must not cancel the join (see actor.py).
        loading.task = asyncio.get_running_loop().create_task(
            self._join(loading), name=f"join-{name}", context=contextvars.Context())
        logger.info("adding worker %s (%s)", name, reason)
        return loading

    async def _join(self, loading: LoadingWorker) -> None:
        try:
            info = await loading.handle.info.remote()
            await loading.handle.reset.remote()  # a reused name may hold an old controller's
            self.check_compatible(info)
            slot = await self.host.attach_worker(loading.handle, info, loading.name)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the worker could not start: say so, keep serving
            loading.error = f"{type(err).__name__}: {err}"
            logger.error("worker %s could not join: %s", loading.name, loading.error)
            self.kill(loading.handle)
            self.changed.set()
            return
        del self.loading[loading.name]
        self.worker_to_name[slot.index] = loading.name
        logger.info("worker %s joined as worker %d on node %s", loading.name, slot.index,
                    getattr(info, "node_id", "") or "?")
        self.changed.set()

    def check_compatible(self, info: Any) -> None:
        """A joining worker must run the model the pool serves, with room for its limits."""
        core = self.host.core
        assert core is not None
        if core.vocab_size is not None and info.vocab_size != core.vocab_size:
            raise ValueError(f"vocab size {info.vocab_size} differs from the pool's "
                             f"{core.vocab_size}: another model")
        if core.max_model_len is not None and info.max_model_len < core.max_model_len:
            raise ValueError(f"max_model_len {info.max_model_len} is below the pool's "
                             f"{core.max_model_len}")

    async def wait_joined(self, name: str, timeout_s: float) -> int:
        """The index of worker `name` once it serves; raises if it failed to join."""
        async with asyncio.timeout(timeout_s):
            while True:
                self.changed.clear()
                for worker, known in self.worker_to_name.items():
                    if known == name:
                        return worker
                loading = self.loading.get(name)
                if loading is None or loading.error is not None:
                    raise RuntimeError(f"worker {name} did not join: "
                                       f"{loading.error if loading else 'unknown'}")
                await self.changed.wait()

    async def add_answer(self, wait: bool, timeout_s: float) -> dict[str, Any]:
        """`add` for an operator: the new worker's name, and with `wait` its index and
        node once it serves."""
        loading = self.add()
        if not wait:
            return {"name": loading.name, "state": "loading"}
        worker = await self.wait_joined(loading.name, timeout_s)
        return {"name": loading.name, "state": "serving", "worker": worker,
                "node": getattr(self.host.slots[worker].info, "node_id", "")}

    # -- draining ---------------------------------------------------------------------
    async def drain_answer(self, worker: int, timeout_s: float, wait: bool
                           ) -> dict[str, Any]:
        """`drain` for an operator: with `wait`, the report once the worker is removed."""
        task = self.drain(worker, timeout_s)
        if not wait:
            return {"worker": worker, "state": "draining"}
        return await asyncio.shield(task)

    def drain(self, worker: int, timeout_s: float, reason: str = OPERATOR
              ) -> asyncio.Task[dict[str, Any]]:
        """Stop routing to `worker`, let its requests finish (or move them after
        `timeout_s`), then remove it. Raises ValueError for a worker that is not serving
        or the last serving one."""
        core = self.host.core
        if core is None or not 0 <= worker < len(self.host.slots):
            raise ValueError(f"no worker {worker}")
        if self.state_of(worker) != "serving":
            raise ValueError(f"worker {worker} is {self.state_of(worker)}, not serving")
        if self.serving() == [worker]:
            raise ValueError(f"worker {worker} is the last serving worker")
        core.workers[worker].is_draining = True
        self.count("down", reason)
        logger.info("draining worker %d (%s, timeout %.0f s)", worker, reason, timeout_s)
        task = asyncio.get_running_loop().create_task(
            self._drain(worker, timeout_s), name=f"drain-{worker}",
            context=contextvars.Context())
        self.draining[worker] = task
        return task

    async def _drain(self, worker: int, timeout_s: float) -> dict[str, Any]:
        core, slot = self.host.core, self.host.slots[worker]
        assert core is not None
        num_unfinished = len(core.scheduler(worker).requests)
        is_finished = await self._wait_empty(slot, timeout_s)
        await slot.stop()
        slot.loop.forget_in_flight()
        outbox = core.take_outbox(worker)
        num_left = len(core.scheduler(worker).requests)
        moved_to, ended = core.evacuate(worker)
        self.host.deliver(outbox + ended)
        self.host.wake(moved_to)
        state = core.workers[worker]
        state.is_up, state.is_removed = False, True
        slot.up.clear()
        slot.transport.close()
        self.kill(slot.handle)
        self.removed.add(worker)
        del self.draining[worker]
        self.changed.set()
        report = {"worker": worker, "name": self.worker_to_name.get(worker, ""),
                  "num_unfinished_at_drain": num_unfinished, "finished": is_finished,
                  "num_moved": num_left - len(ended),
                  "moved_to": moved_to, "num_ended": len(ended)}
        logger.info("worker %d removed: %s", worker, report)
        return report

    async def _wait_empty(self, slot: WorkerSlot, timeout_s: float) -> bool:
        """Whether every request of the slot finished within `timeout_s`; woken by the
        slot's steps, no polling."""
        sched = slot.core.scheduler(slot.index)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while sched.has_unfinished():
                    slot.stepped.clear()
                    await slot.stepped.wait()
                return True
        return False
