"""What bounds one server's resources against many or slow clients: requests in flight, pixels being decoded,
the time a request body may take, and the response headers every answer carries.

`Limits` is a plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would read bodies through a
task of its own): it answers 503 with Retry-After beyond `max_concurrency` requests in flight, and makes
reading a body that has not arrived in full after `body_timeout_s` raise a 408 (FastAPI re-raises an
HTTPException met while reading the form, so the route never runs). A body is bounded by the bytes that arrive,
not the bytes announced: a request with a `Transfer-Encoding` (chunked, or beside a Content-Length, where h11
reads the chunks and ignores the length) is refused with 411 before any of it is read, and a body that grows
past `max_body_bytes` or its own Content-Length raises a 413 while it is read. uvicorn's own `limit_concurrency` counts
idle keep-alive connections too and sends no Retry-After; its `timeout_keep_alive` does not apply while a body
is being received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Collection, Iterator

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

RETRY_AFTER_S = 1


class Busy(Exception):
    """The server is at a limit now; the client should retry shortly."""


class PixelBudget:
    """Pixels decoded at once, over all requests (threads): `hold(n)` raises `Busy` when n more would exceed
    `limit`, unless nothing is held (one image under serve.max_pixels always gets through, alone)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        with self._lock:
            if self.used and self.used + pixels > self.limit:
                raise Busy(f"{self.used} pixels are being decoded; {pixels} more would exceed {self.limit}")
            self.used += pixels
        try:
            yield
        finally:
            with self._lock:
                self.used -= pixels


class Limits:
    """See the module docstring. `exempt`: paths never refused for concurrency (a probe must see a busy
    server as alive)."""

    def __init__(self, app: ASGIApp, max_concurrency: int, body_timeout_s: float,
                 exempt: Collection[str] = (), max_body_bytes: int | None = None) -> None:
        self.app, self.max_concurrency, self.body_timeout_s = app, max_concurrency, body_timeout_s
        self.max_body_bytes = max_body_bytes
        self.exempt = frozenset(exempt)
        self.in_flight = 0  # only touched on the event loop: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":  # no response is to be read as another type
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-content-type-options", b"nosniff")]
            await send(message)

        counted = scope["path"] not in self.exempt
        if counted and self.in_flight >= self.max_concurrency:
            await _json(send_nosniff, 503, f"the server is busy ({self.max_concurrency} requests in flight): "
                        f"retry in {RETRY_AFTER_S} s", [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        headers = dict(scope.get("headers") or [])
        if b"transfer-encoding" in headers:
            await _json(send_nosniff, 411, "a request body must be sent with a Content-Length, not a "
                        "Transfer-Encoding", [(b"connection", b"close")])
            return
        declared = headers.get(b"content-length", b"")
        limit = min(int(declared), self.max_body_bytes or int(declared)) if declared.isdigit() else \
            self.max_body_bytes
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        body_done, received = False, 0

        async def receive_by_deadline() -> Message:
            nonlocal body_done, received
            if body_done:  # later calls wait for a disconnect while a response streams: not the body's time
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0))
            except TimeoutError:
                # Connection: close makes uvicorn drop the connection after the 408, body unread.
                raise HTTPException(408, f"the request body did not arrive within {self.body_timeout_s} s",
                                    headers={"Connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit is not None and received > limit:
                    raise HTTPException(413, f"the request body passed {limit} bytes",
                                        headers={"Connection": "close"})
            return message

        self.in_flight += counted
        try:
            await self.app(scope, receive_by_deadline, send_nosniff)
        finally:
            self.in_flight -= counted


async def _json(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
