"""What the ingress lets in: bodies up to a size, and a bounded number of requests not yet
answered with a first token.

- `BodyLimit` (pure ASGI, outermost) answers 413 before anything parses the body: at once when
  `Content-Length` is over the limit, else once the streamed bytes pass it. It buffers what it
  reads (at most the limit, which FastAPI would read anyway) and replays it to the app.
- `Admission` counts the requests that arrived and have no first token yet; beyond
  `max_queued` it answers 429 with `Retry-After`, so a burst waits in the clients, not in the
  engines' queues where every accepted request's time to first token would grow with it.
  A worker pool's own bound of queued calls (`PoolConfig.max_queued_requests`, Serve's
  `max_queued_requests`) surfaces as `PoolFullError` (`router.generation.as_api_error`);
  `Admission` answers it the same way: 429 with `Retry-After`, counted by reason ("queue_full",
  "pool_full").
A router replica counts its own requests: with R replicas the bound is R x `max_queued`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import APIError, error_response


@dataclass(frozen=True)
class IngressLimits:
    max_request_bytes: int
    max_queued_requests: int
    retry_after_s: int


class TooManyRequestsError(APIError):
    status = 429
    reason = "queue_full"  # the label of `pdserve:request_rejected_total`


class PoolFullError(TooManyRequestsError):
    """A worker pool turned a call away: it had as many calls queued as its bound."""

    reason = "pool_full"


class BodyLimit:
    """413 with an OpenAI error body for a request body over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the app sees it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over the limit of {self.max_bytes} bytes"
        await error_response(413, message)(scope, receive, send)


class Admission:
    """The requests of a router replica that have arrived and have no first token yet;
    `max_queued` None: no bound. `on_reject(reason)` is called for each request turned away."""

    def __init__(
        self,
        max_queued: int | None = None,
        retry_after_s: int = 1,
        on_reject: Callable[[str], object] | None = None,
    ) -> None:
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.on_reject = on_reject
        self.queued = 0

    @contextmanager
    def slot(self) -> Iterator[Slot]:
        """A place in the queue for the block's request (429 when none is left); the request
        gives it up at its first token (`Slot.release`) or when the block ends. A pool's
        refusal in the block is answered as the queue's own."""
        if self.max_queued is not None and self.queued >= self.max_queued:
            raise self._refuse(
                TooManyRequestsError.reason,
                f"the server has {self.queued} requests waiting for their first token, its limit",
            )
        slot = Slot(self)
        self.queued += 1
        try:
            yield slot
        except PoolFullError as e:
            raise self._refuse(e.reason, e.message) from e
        finally:
            slot.release()

    def _refuse(self, reason: str, why: str) -> TooManyRequestsError:
        if self.on_reject is not None:
            self.on_reject(reason)
        return TooManyRequestsError(
            f"{why}: retry after {self.retry_after_s} s",
            headers={"Retry-After": str(self.retry_after_s)},
        )


class Slot:
    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.queued -= 1
            self._admission = None
