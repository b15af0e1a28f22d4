"""Dynamic batching: requests from many connections share one model call.

The batcher lives on the server's event loop. A request waits in one FIFO queue; the batching loop takes
the oldest request, adds every queued request of the same group (the same mode, and seeded or not, see
:attr:`~wamkit.serve.policy.Request.group`) until ``max_batch`` observations. A
batch that is not full keeps gathering while requests keep coming: it closes when no request has
arrived for ``max_wait_ms``, when every connection is waiting for a reply (none can add more), or after
:data:`MAX_GATHER_WAITS` x ``max_wait_ms`` in all. (Timing from the *first* request instead split every
wave of replies from synchronous clients into a few small batches: their next requests arrive spread
over the time the event loop takes to decode them.) While a connection the previous model call answered
with one unbatched observation (openpi's form) has not sent again ("returning": a synchronous client
on its way back), the batch waits for it longer, up to :data:`RETURN_PATIENCE` of the previous call's
duration (within the same cap): a request left behind would cost a model call of its own, and a
launch-bound model costs nearly as much for one observation as for a full batch. Only a connection
whose next request could join this batch (the same group) and whose last turnaround (reply to
next request) brings it back within that time is waited for. Connections that send a batch axis (the
evaluator's stages, even of one env) batch for themselves and are never waited for.

Then the model runs on another thread than the event loop's, so the loop keeps reading, checking and
answering other connections meanwhile: a worker thread of its own by default, or, in ``wamkit serve``,
the process's main thread (:class:`CallerThreadExecutor`; the loop then runs in a thread): PyTorch's
intra-op parallel regions (OpenMP) started from a secondary thread cost far more than from the main one,
and with one intra-op thread the two are equal (the measured calls: docs/results-log.md, "Serving").
Results go back to each request's own future, in order, so replies are never mixed up. While the model
runs, new requests queue up and form the next batch: under load, batches fill without waiting.

A request larger than ``max_batch`` runs alone, whole (split it on the client if that is too big).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from wamkit.serve.metrics import ServerMetrics
from wamkit.serve.policy import Request

log = logging.getLogger(__name__)
MAX_GATHER_WAITS = 25  # a partial batch gathers for at most this many max_wait_ms in all
RETURN_PATIENCE = 0.5  # waiting for returning connections: at most this share of the last model call


class ModelError(RuntimeError):
    """The model raised while running a batch; every request of that batch gets this error."""


class CallerThreadExecutor(Executor):
    """Runs the submitted calls on the thread that calls :meth:`run`, one at a time, in order, until
    :meth:`shutdown`. ``wamkit serve`` runs the model on its main thread this way (see the module
    docstring for why); the batcher submits to it from the event loop's thread as to any executor."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # a call is queued only while open, and never after the drain
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise ModelError("server is shutting down")
            self._calls.put((future, fn, args, kwargs))
        return future

    def run(self, poll_s: float = 0.5) -> None:
        """Run calls until :meth:`shutdown`; waiting wakes every ``poll_s`` so that Ctrl-C is seen while
        idle too. However it ends (shut down, or a KeyboardInterrupt, which it raises on), the call it
        was running and every call still queued fail with :class:`ModelError`, and no more are taken:
        a request left unanswered would hold its connection, and the server's stop, forever.

        On the main thread, Ctrl-C (SIGINT) is taken between calls: the call running finishes and
        hands its result over, then run raises KeyboardInterrupt. An interrupt raised at any bytecode
        could land after a future is marked done but before its callbacks wake the waiting request,
        which would then wait forever. A second Ctrl-C during a call interrupts it at once."""
        interrupted = threading.Event()
        installed, previous = False, None
        if threading.current_thread() is threading.main_thread():

            def on_sigint(signum: int, frame: Any) -> None:
                if interrupted.is_set():  # the second: do not wait for the running call
                    raise KeyboardInterrupt
                interrupted.set()
                log.warning(
                    "interrupted: stopping after the model call running (Ctrl-C again to cut it short)"
                )

            previous, installed = signal.signal(signal.SIGINT, on_sigint), True
        future = None
        try:
            while True:
                if interrupted.is_set():
                    raise KeyboardInterrupt
                try:
                    item = self._calls.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if item is None:
                    return
                future, fn, args, kwargs = item
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args, **kwargs)
                    except Exception as err:  # noqa: BLE001 -- handed to the batcher, which fails the batch
                        future.set_exception(err)
                    else:
                        future.set_result(result)
                future = None
        finally:
            if installed:  # None: the previous handler was not set from Python; the default then
                signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
            if future is not None and not future.done():
                future.set_exception(ModelError("server is shutting down"))
            self.shutdown()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls and fail the queued ones; :meth:`run` returns after the call it is running
        (never waits itself: the thread running the calls may be the one that would wait)."""
        with self._lock:
            self._closed = True
            left = []
            with contextlib.suppress(queue.Empty):
                while True:
                    left.append(self._calls.get_nowait())
            self._calls.put(None)
        for item in left:
            if item is not None and not item[0].done():
                item[0].set_exception(ModelError("server is shutting down"))


@dataclass
class _Item:
    request: Request
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    """Gather :class:`Request` objects into model calls of ``run(requests) -> replies``."""

    def __init__(
        self,
        run: Callable[[list[Request]], list[dict[str, Any]]],
        max_batch: int = 32,
        max_wait_ms: float = 2.0,
        metrics: ServerMetrics | None = None,
        others_may_send: Callable[[], bool] | None = None,
        returning: Callable[[tuple, float], bool] | None = None,
        executor: Executor | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"serve.max_batch: expected at least 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"serve.max_wait_ms: expected a non-negative number, got {max_wait_ms}")
        self._run = run
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.metrics = metrics or ServerMetrics()
        # Waiting only pays when some client could still add to the batch: the server passes a check
        # "is there a connection with nothing in flight?", so a lone client never waits max_wait_ms.
        self._others_may_send = others_may_send or (lambda: True)
        # "is a connection the last call answered with one observation of this group on its way back,
        # expected by this time?" (see above)
        self._returning = returning or (lambda group, until: False)
        self.calls = 0  # model calls answered so far: the server marks each reply with it
        self._last_call_s = 0.0
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        # where model calls run: a worker thread of their own unless given (CallerThreadExecutor)
        self._pool = executor or ThreadPoolExecutor(1, thread_name_prefix="wamkit-model")
        self._deferred: collections.deque[_Item] = collections.deque()  # queued, set aside for a later batch
        self._stopped = False

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="wamkit-batcher")

    async def stop(self) -> None:
        """Stop batching; every request not answered yet, and every one queued after, fails with "server
        is shutting down". Safe to call twice; the model's executor is shut down even if the batching
        loop had died."""
        self._stopped = True
        try:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        finally:
            while self._queue is not None and not self._queue.empty():
                self._deferred.append(self._queue.get_nowait())
            for item in self._deferred:
                if not item.future.done():
                    item.future.set_exception(ModelError("server is shutting down"))
            self._pool.shutdown(wait=True)

    def enqueue(self, request: Request) -> asyncio.Future:
        """Queue ``request`` now; the future gives its reply and timing (queue_ms, infer_ms, batch_size).

        Synchronous on purpose: a caller that counts the request as in flight must also have it in the
        queue, or the batcher could see "every connection is waiting" with the request not yet queued and
        close a batch early.
        """
        if self._queue is None:
            raise RuntimeError("DynamicBatcher.start() was not called")
        future = asyncio.get_running_loop().create_future()
        if self._stopped:  # read by a connection after stop(): no loop is left to answer it
            future.set_exception(ModelError("server is shutting down"))
            return future
        self._queue.put_nowait(_Item(request, future))
        return future

    async def submit(self, request: Request) -> tuple[dict[str, Any], dict[str, float]]:
        """Queue ``request``; return its reply and timing (queue_ms, infer_ms, batch_size)."""
        return await self.enqueue(request)

    async def _next(self, deadline: float) -> _Item | None:
        assert self._queue is not None
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not self._others_may_send():
                return None
            try:
                return await asyncio.wait_for(self._queue.get(), remaining)
            except asyncio.TimeoutError:
                pass
            # The timer may fire after a request was queued: when the loop was busy longer than the
            # wait (answering the previous batch, decoding others' requests), both are ready together
            # and the timeout can win. A queued request is never left out for that.
            try:
                return self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return None

    def _gather(self) -> tuple[list[_Item], int]:
        """Start a batch from the set-aside requests (oldest first), taking every one that fits."""
        first = self._deferred.popleft()
        items, n, keep = [first], first.request.n, collections.deque()
        while self._deferred:
            item = self._deferred.popleft()
            if item.request.group == first.request.group and n + item.request.n <= self.max_batch:
                items.append(item)
                n += item.request.n
            else:
                keep.append(item)
        self._deferred = keep
        return items, n

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._deferred:
                self._deferred.append(await self._queue.get())
            self._deferred = collections.deque(
                i for i in self._deferred if not i.future.done()
            )  # clients gone
            if not self._deferred:
                continue
            items, n = self._gather()
            now = time.perf_counter()
            last_call = now + MAX_GATHER_WAITS * self.max_wait
            patient_until = min(now + RETURN_PATIENCE * self._last_call_s, last_call)
            try:
                while n < self.max_batch:
                    deadline = time.perf_counter() + self.max_wait
                    if self._returning(items[0].request.group, patient_until):
                        deadline = max(deadline, patient_until)
                    nxt = await self._next(min(deadline, last_call))
                    if nxt is None:
                        break
                    if nxt.future.done():
                        continue
                    if nxt.request.group != items[0].request.group or n + nxt.request.n > self.max_batch:
                        self._deferred.append(nxt)  # another group, or too big: it starts a later batch
                        continue
                    items.append(nxt)
                    n += nxt.request.n
            except asyncio.CancelledError:  # stop() while this batch gathered: its requests fail, not hang
                for item in items:
                    if not item.future.done():
                        item.future.set_exception(ModelError("server is shutting down"))
                raise
            start = time.perf_counter()
            try:
                replies = await loop.run_in_executor(self._pool, self._run, [i.request for i in items])
            except asyncio.CancelledError:  # stop(): this batch's requests fail, not hang
                for item in items:
                    if not item.future.done():
                        item.future.set_exception(ModelError("server is shutting down"))
                raise
            except Exception as err:  # noqa: BLE001 -- the model's failure goes to its requests, not the loop
                if isinstance(err, ModelError):  # the server is stopping: not the model's failure
                    log.info("model call with %d observations not run: %s", n, err)
                elif isinstance(err, ValueError):  # the model refused these inputs (e.g. a mode it lacks)
                    log.warning("model call with %d observations refused: %s", n, err)
                else:
                    log.exception("model call with %d observations failed", n)
                error = (
                    err
                    if isinstance(err, ModelError)
                    else ModelError(f"model failed: {type(err).__name__}: {err}")
                )
                for item in items:
                    if not item.future.done():
                        item.future.set_exception(error)
                self.calls += 1  # no one this call answered is waited for
                await asyncio.sleep(0)
                continue
            self._last_call_s = time.perf_counter() - start
            infer_ms = self._last_call_s * 1000.0
            self.calls += 1
            self.metrics.model_call(n)
            for item, reply in zip(items, replies):
                if not item.future.done():
                    timing = {
                        "queue_ms": (start - item.queued) * 1000.0,
                        "infer_ms": infer_ms,
                        "batch_size": n,
                    }
                    item.future.set_result((reply, timing))
            # let the answered requests' callbacks run (the server's in-flight counts, who returns)
            # before the next batch asks "may anyone still send?"
            await asyncio.sleep(0)
