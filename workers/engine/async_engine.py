"""`AsyncEngine`: the engine's step loop on its own thread, fed and drained from asyncio.

Only the loop thread touches the `Engine` (no locks inside it): callers post commands to an inbox
and receive `RequestOutput` chunks through per-request asyncio queues. A caller that stops
listening (client gone, task cancelled) aborts its request, which frees its pages at once. When a
step kills the engine every stream raises `EngineDeadError`, and so does every later request;
the loop lives on for the hand-offs' notifications (`Engine.poll`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from workers.engine.engine import Engine
from workers.engine_stats import EngineDeadError, EngineStats
from workers.protocol import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_stats: Callable[[EngineStats], object] | None = None,
        replica: str | None = None,
    ) -> None:
        """`on_stats` is called on the loop thread with every fresh stats snapshot; `replica`
        names the Serve replica in the `EngineDeadError`s raised here."""
        self.engine = engine
        self.replica = replica
        self.stream_interval_s = engine.cfg.stream_interval_ms / 1e3
        self._on_stats = on_stats
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._stats = engine.stats()
        self._stop = False
        self._step_began: float | None = None  # monotonic start of the step running now
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- asyncio side ----------------------------------------------------------------------
    def generate(self, req: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream `req`'s chunks; raises what `Engine.add_request` raised for a bad request."""
        return self.stream(req.request_id, lambda: self.engine.add_request(req))

    async def stream(
        self, request_id: str, admit: Callable[[], object], keepalive_s: float = 0.0,
        stall_s: float = math.inf,
    ) -> AsyncGenerator[RequestOutput, None]:  # fmt: skip
        """Run `admit` (which adds `request_id` to the engine) on the loop thread, then stream
        the request's chunks until it finishes. An exception from `admit` is raised here.
        With `stream_interval_s` a chunk that comes sooner than that after the last one sent
        waits, and the chunks behind it join it (one Ray message through the router instead of
        several; the request's first and last chunks never wait). With `keepalive_s`, a
        keepalive chunk (`RequestOutput.is_keepalive`) goes out after that long without one
        while the loop runs and no step of it has lasted `stall_s`: the caller tells a busy
        engine (a long queue or step) from a dead or stalled one."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (loop, chunks)
        self.call(lambda: self._admit(request_id, admit))
        finished = False
        sent_at = -math.inf
        try:
            while not finished:
                try:
                    async with asyncio.timeout(keepalive_s or None):
                        item = await chunks.get()
                except TimeoutError:
                    if self.progressing(stall_s):
                        yield RequestOutput(request_id=request_id)
                    continue
                if isinstance(item, BaseException):
                    raise item
                error = None
                if not _last(item) and sent_at + self.stream_interval_s > loop.time():
                    item, error = await _gather(item, chunks, sent_at + self.stream_interval_s)
                finished = _last(item)
                yield item
                if error is not None:
                    raise error
                sent_at = loop.time()
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.call(lambda: self.engine.abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop thread before its next step."""
        self._inbox.put(fn)
        self._wake.set()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop thread (engine state is only touched there) and await its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def call() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(done.set_exception, e)
            else:
                loop.call_soon_threadsafe(done.set_result, result)

        self.call(call)
        return await done

    def progressing(self, stall_s: float) -> bool:
        """Whether the loop thread lives, the engine too, and no step of it has run for
        `stall_s` or more."""
        began = self._step_began
        stalled = began is not None and time.monotonic() - began >= stall_s
        return self._thread.is_alive() and self.engine.dead is None and not stalled

    def check_alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop thread has died")
        if self.engine.dead is not None:
            raise self._dead_error()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- loop thread ------------------------------------------------------------------------
    def _admit(self, request_id: str, admit: Callable[[], object]) -> None:
        if self.engine.dead is not None:
            self._deliver(request_id, self._dead_error())
            return
        try:
            admit()
        except Exception as e:  # noqa: BLE001 - hand the rejection to the caller
            self._deliver(request_id, e)

    def _dead_error(self) -> EngineDeadError:
        """A fresh error (one per caller: each raise sets its traceback) naming the replica."""
        error = EngineDeadError(str(self.engine.dead))
        error.replica = self.replica
        return error

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, chunks = stream
            loop.call_soon_threadsafe(chunks.put_nowait, item)

    def _refresh_stats(self) -> None:
        self._stats = self.engine.stats()
        if self._on_stats is not None:
            try:
                self._on_stats(self._stats)
            except Exception:  # noqa: BLE001 - stats are best effort; serving goes on
                logger.exception("posting engine stats failed")

    def _run(self) -> None:
        while not self._stop:
            while not self._inbox.empty():
                try:
                    self._inbox.get()()
                except Exception:  # noqa: BLE001 - a bad command must not stop the loop
                    logger.exception("engine command failed")
            for out in self.engine.poll():
                self._deliver(out.request_id, out)
            if self.engine.dead is not None or not self.engine.has_work():
                self._refresh_stats()
                self._wake.wait(self.engine.idle_wait_s())
                self._wake.clear()
                continue
            self._step_began = time.monotonic()
            try:
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
            except EngineDeadError:
                self._refresh_stats()  # the death on the stats board before anyone hears of it
                for request_id in list(self._streams):  # their requests were aborted
                    self._deliver(request_id, self._dead_error())
            except Exception:  # noqa: BLE001 - the loop must outlive any one step
                logger.exception("engine step failed")
            finally:
                self._step_began = None
            self._refresh_stats()


def _last(item: RequestOutput) -> bool:
    return item.finished or item.kv is not None  # handed off: not ours


async def _gather(
    item: RequestOutput, chunks: asyncio.Queue[Any], due: float
) -> tuple[RequestOutput, BaseException | None]:
    """`item` merged with the chunks that arrive before loop time `due`, or up to the last one
    or an exception (the engine died), which comes second."""
    try:
        async with asyncio.timeout_at(due):
            while not _last(item):
                later = await chunks.get()
                if isinstance(later, BaseException):
                    return item, later
                item = item.then(later)
    except TimeoutError:
        pass
    return item, None
