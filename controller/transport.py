"""How a step's plan reaches a worker actor (`cluster.worker_transport`).

`ActorCallTransport` makes one Ray actor call per step. `CompiledGraphTransport` sends the
plans through a Ray Compiled Graph bound to the worker's `execute`: the plan goes over a
shared-memory channel to a loop already running in the worker, with no task submission,
scheduling or object store per step, which cuts Ray's round trip several times (the step
itself does not change: one plan in, one `StepResult` out, in order).

Either way `send(plan)` returns an awaitable at once (the plan is on its way, so the
async-scheduling plan-ahead overlaps the running step), and any failure of the call comes
out of that awaitable, where the step loop turns it into `WorkerCallError`. A worker that
fails is killed and restarted; the slot calls `close()` then (the graph is torn down on a
thread: Ray's teardown blocks) and `reopen()` once the new incarnation answers `info`.

A graph runs the worker's `execute` on Ray's system thread of that actor, beside the thread
of its ordinary calls (`info`, `reset`, ...), so the slot `drain()`s the graph before a
call that changes the worker's state. A worker whose graph cannot be built falls back to
actor calls (logged once): compiling fails (no compiled graphs in this Ray, a worker that
is no Ray actor), or the empty probe step finds no loop answering, as when the worker was
bound to the graph of a controller that died (its loop still holds the actor's system
thread); it tries again after its next restart.

Ray is imported here only by the compiled graph, lazily: the controller's core stays
importable without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from controller.messages import StepPlan, StepResult, decode_result, encode_message

logger = logging.getLogger(__name__)
ACTOR_CALL = "actor_call"
COMPILED_GRAPH = "compiled_graph"
# Steps a graph may have sent and not yet answered: the step in flight, the one planned
# ahead, and room for the probe (more raises RayCgraphCapacityExceeded).
MAX_INFLIGHT = 4
PROBE_STEP_ID = -1  # the empty step that checks a new graph end to end
# Ray runs a graph's loop on this concurrency group of the actor (one thread), which every
# actor has; a loop that holds it (a dead controller's) keeps any new graph from starting.
GRAPH_THREAD_GROUP = "_ray_system"
TEARDOWN_WAIT_S = 10.0  # a reopen waits this long for the previous graph's teardown


class WorkerTransport(Protocol):
    # Why steps go by actor call although a compiled graph was asked for; None otherwise.
    fallback_reason: str | None

    @property
    def kind(self) -> str:
        """The transport steps take now (a compiled graph may have fallen back)."""

    def send(self, plan: StepPlan) -> Awaitable[StepResult]:
        """Send `plan` now; the awaitable gives its result or raises the call's failure."""

    async def reopen(self, handle: Any, incarnation: str) -> None:
        """Start (again) on `handle`'s process `incarnation`; never raises for the
        transport's own failure (a compiled graph falls back to actor calls)."""

    def close(self) -> None:
        """Stop using the worker (it failed or shuts down); returns at once."""

    async def drain(self, timeout_s: float) -> None:
        """Wait until no step is running on the worker's side (at most `timeout_s`)."""

    def after_reset(self) -> None:
        """The worker dropped its state (`reset`), which retired the numbering of the
        steps sent so far (workers/step_gate.py): number the next ones afresh."""


class ActorCallTransport:
    """One Ray actor call per step. The actor takes two calls at once, so that Ray's work
    on the next call overlaps the running step; the calls carry this transport's name and
    a number, by which the actor runs them in order (workers/step_gate.py)."""

    kind = ACTOR_CALL

    def __init__(self, handle: Any, incarnation: str) -> None:
        self.fallback_reason: str | None = None
        self._open(handle, incarnation)

    def _open(self, handle: Any, incarnation: str) -> None:
        self.handle, self.incarnation = handle, incarnation
        self.after_reset()

    def after_reset(self) -> None:
        # A new sender for the worker's gate: numbering starts again at 0.
        self.sender, self._seq = uuid.uuid4().hex, itertools.count()

    def send(self, plan: StepPlan) -> Awaitable[StepResult]:
        try:  # the plan as bytes: the worker answers in bytes (controller/messages.py)
            call = self.handle.execute.remote(encode_message(plan), self.incarnation,
                                              self.sender, next(self._seq))
        except Exception as err:  # Ray may refuse a call at once: raised where awaited
            # The number is spent: the failure restarts the worker, and the gate with it.
            return _failed(err)
        decoded = asyncio.ensure_future(_decoded(call))
        decoded.add_done_callback(_retrieve)  # a step dropped unawaited logs nothing
        return decoded

    async def reopen(self, handle: Any, incarnation: str) -> None:
        self._open(handle, incarnation)

    def close(self) -> None:
        pass

    async def drain(self, timeout_s: float) -> None:
        # Nothing to wait for: a step sent before a `reset` runs before it, or is refused
        # after it (the reset retires its sender, workers/step_gate.py).
        pass


# Builds the compiled graph of one worker: (actor handle, incarnation) -> compiled graph.
GraphCompiler = Callable[[Any, str], Any]


def compile_worker_graph(handle: Any, incarnation: str) -> Any:
    """`execute(plan, incarnation)` of one worker actor as an asyncio compiled graph. The
    incarnation is a constant of the graph: a graph is built per worker process."""
    from ray.dag import InputNode

    with InputNode() as plan:
        node = handle.execute.bind(plan, incarnation)
    return node.experimental_compile(enable_asyncio=True,
                                     _max_inflight_executions=MAX_INFLIGHT)


class CompiledGraphTransport:
    """Steps through a Ray Compiled Graph; actor calls while none is built."""

    def __init__(self, handle: Any, incarnation: str, probe_timeout_s: float,
                 first_step_timeout_s: float = 60.0,
                 compile_graph: GraphCompiler | None = None, name: str = "worker") -> None:
        self.calls = ActorCallTransport(handle, incarnation)
        self.probe_timeout_s = probe_timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.compile_graph = compile_graph or compile_worker_graph
        self.name = name
        self.graph: _Graph | None = None
        self.fallback_reason: str | None = None  # why steps go by actor call, if they do
        self._teardown: asyncio.Future[None] | None = None
        self._has_warned = False

    @property
    def kind(self) -> str:
        return COMPILED_GRAPH if self.graph is not None else ACTOR_CALL

    def send(self, plan: StepPlan) -> Awaitable[StepResult]:
        graph = self.graph
        return graph.send(plan) if graph is not None else self.calls.send(plan)

    async def reopen(self, handle: Any, incarnation: str) -> None:
        self.close()
        await self.calls.reopen(handle, incarnation)
        teardown = self._teardown
        if teardown is not None:  # compiling on actors still in a teardown is not safe
            await asyncio.wait({teardown}, timeout=TEARDOWN_WAIT_S)
        try:
            await asyncio.wait_for(_graph_thread_call(handle), self.probe_timeout_s)
        except Exception as err:  # TimeoutError included
            self._fall_back(f"the worker's graph thread does not answer (held by an earlier "
                            f"controller's graph?): {type(err).__name__}: {err}")
            return
        try:
            # On the event loop: Ray binds the asyncio graph to the loop that compiles it.
            # It blocks the loop for the set-up calls (a fraction of a second, once per
            # worker start), on a worker that has just answered twice.
            dag = self.compile_graph(handle, incarnation)
        except Exception as err:
            self._fall_back(f"compiling failed: {type(err).__name__}: {err}")
            return
        graph = _Graph(dag)
        start = time.perf_counter()
        try:  # the first step starts the worker's loop: a second or so on a busy machine
            await asyncio.wait_for(graph.send(StepPlan(step_id=PROBE_STEP_ID)),
                                   self.first_step_timeout_s)
        except Exception as err:  # TimeoutError included
            self._teardown = graph.teardown()
            self._fall_back(f"the graph's first step failed: {type(err).__name__}: {err}")
            return
        self.graph, self.fallback_reason = graph, None
        logger.info("%s: steps go through a compiled graph (first step %.3f s)", self.name,
                    time.perf_counter() - start)

    def close(self) -> None:
        graph, self.graph = self.graph, None
        if graph is not None:
            self._teardown = graph.teardown()

    async def drain(self, timeout_s: float) -> None:
        if self.graph is not None:
            await self.graph.drain(timeout_s)

    def after_reset(self) -> None:
        self.calls.after_reset()  # the graph's steps carry no numbers

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log = logger.info if self._has_warned else logger.warning
        self._has_warned = True
        log("%s: steps go by actor call, no compiled graph: %s", self.name, reason)


class _Graph:
    """One built graph: its sends, and a watch on the worker's graph loop, whose end
    (the actor died, or the graph was torn down) fails every step still waiting: Ray's
    own reader may never answer them then."""

    def __init__(self, dag: Any) -> None:
        self.dag = dag
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task[StepResult]] = set()
        self.waiting: set[asyncio.Future[StepResult]] = set()
        self.ended: Exception | None = None
        ref = _graph_loop_ref(dag)
        self.watch = self.loop.create_task(self._watch(ref)) if ref is not None else None

    def send(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        out: asyncio.Future[StepResult] = self.loop.create_future()
        out.add_done_callback(_retrieve)  # a step dropped unawaited logs nothing
        if self.ended is not None:
            out.set_exception(self.ended)
            return out
        # A task per step: submitted in order (the graph's submission lock is FIFO) and
        # always awaited to the end, which Ray's count of steps in flight relies on.
        task = self.loop.create_task(self._execute(plan))
        self.tasks.add(task)
        self.waiting.add(out)
        task.add_done_callback(functools.partial(self._settle, out))
        return out

    async def _execute(self, plan: StepPlan) -> StepResult:
        future = await self.dag.execute_async(plan)
        return await future

    def _settle(self, out: asyncio.Future[StepResult], task: asyncio.Task[StepResult]
                ) -> None:
        self.tasks.discard(task)
        self.waiting.discard(out)
        err = RuntimeError("step cancelled") if task.cancelled() else task.exception()
        if out.done():  # the awaiter gave up (deadline), or the loop's end failed it
            return
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(task.result())

    async def _watch(self, ref: Any) -> None:
        try:
            await ref
            reason = "the worker's compiled-graph loop ended"
        except Exception as err:
            reason = f"the worker's compiled-graph loop failed: {type(err).__name__}: {err}"
        self._end(RuntimeError(reason))

    def _end(self, err: Exception) -> None:
        if self.ended is None:
            self.ended = err
        for out in list(self.waiting):
            if not out.done():
                out.set_exception(self.ended)
        self.waiting.clear()

    async def drain(self, timeout_s: float) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)

    def teardown(self) -> asyncio.Future[None]:
        """Stop the graph: steps still waiting fail now; Ray's teardown, which blocks (up
        to its own timeouts, or until a hung worker is killed), runs on a daemon thread.
        The returned future is done when it has."""
        self._end(RuntimeError("the compiled graph was torn down"))
        if self.watch is not None:
            self.watch.cancel()
        for task in list(self.tasks):
            task.cancel()
        done: asyncio.Future[None] = self.loop.create_future()

        def run() -> None:
            try:
                self.dag.teardown()
            except Exception as err:  # the worker may be gone already
                logger.info("compiled graph teardown: %s: %s", type(err).__name__, err)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self.loop.call_soon_threadsafe(_set_done, done)

        threading.Thread(target=run, name="graph-teardown", daemon=True).start()
        return done


def _graph_thread_call(handle: Any) -> Any:
    """A call that does nothing on the thread a graph's loop would run on."""
    call = handle.__ray_call__.options(concurrency_group=GRAPH_THREAD_GROUP)
    return call.remote(_nothing)


def _nothing(actor: Any) -> None:
    pass


def _graph_loop_ref(dag: Any) -> Any:
    """The object ref of the graph's loop on the worker, which fails as soon as the actor
    dies; Ray exposes no public handle for it. None: steps to a dead worker then end at
    the step deadline."""
    refs = getattr(dag, "worker_task_refs", None)
    if not isinstance(refs, dict) or len(refs) != 1:
        return None
    return next(iter(refs.values()))


async def _decoded(call: Awaitable[StepResult | bytes]) -> StepResult:
    return decode_result(await call)


def _failed(err: Exception) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(err)
    return future


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def make_transport(kind: str, handle: Any, incarnation: str, probe_timeout_s: float,
                   first_step_timeout_s: float, name: str = "worker") -> WorkerTransport:
    if kind == COMPILED_GRAPH:
        return CompiledGraphTransport(handle, incarnation, probe_timeout_s,
                                      first_step_timeout_s, name=name)
    return ActorCallTransport(handle, incarnation)
