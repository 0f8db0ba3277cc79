"""The page at `/` and its feed, `GET /v1/live`: the engine's step summaries as Server-Sent
Events, to every viewer, bounded.

The engine thread makes a summary (observability.summary(): ids, states, counts, timings; never
text) at most every 100 ms while someone watches, and once a second when nothing changes
(async_engine.Summaries); it is encoded once, there, and put on every viewer's queue here.
A viewer's queue holds QUEUE_SIZE summaries: one that falls that far behind (it reads too
slowly, or not at all, and its connection's buffers are full) is dropped and its stream
closed. Beyond those summaries only the connection's own buffers hold anything for a viewer:
the kernel's socket buffers and uvicorn's 64 KiB before it stops writing.

The page is three static files in page/, served without the API key (they hold no data);
its calls, /v1/live included, send the key like any client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gapless.server.endpoint import ServerState, draining_error
from gapless.server.protocol import APIError

log = logging.getLogger("gapless.server")

PATH = "/v1/live"
QUEUE_SIZE = 8  # summaries a viewer may fall behind before it is dropped (0.8 s at full rate)
MAX_VIEWERS = 32  # streams at once; more are refused with 503
FINAL_SEND_S = 1.0  # how long the closing event may wait on a full socket

PAGE_DIR = Path(__file__).parent / "page"
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/page/style.css": ("style.css", "text/css; charset=utf-8"),
}
# Everything the page loads or calls comes from this server.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


class Viewer:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_SIZE)
        self.cancel_scope: anyio.CancelScope | None = None  # its stream's, once it runs
        self.end: str | None = None  # why the feed ended its stream: dropped, shutdown

    def stop(self, reason: str) -> None:
        """Ends the stream where it waits (on its queue, or on a full socket)."""
        if self.end is None:
            self.end = reason
            if self.cancel_scope is not None:
                self.cancel_scope.cancel()


class LiveFeed:
    """The viewers of /v1/live, fed from the engine thread while there is at least one."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.viewers: set[Viewer] = set()
        self.dropped = 0  # viewers dropped for falling behind, ever
        self._loop: asyncio.AbstractEventLoop | None = None

    def subscribe(self) -> Viewer:
        if self.state.draining:
            raise draining_error()
        if len(self.viewers) >= MAX_VIEWERS:
            raise APIError(
                503,
                f"{MAX_VIEWERS} live viewers are connected already",
                "overloaded_error",
                code="too_many_viewers",
                headers={"Retry-After": "5"},
            )
        viewer = Viewer()
        self.viewers.add(viewer)
        self._loop = asyncio.get_running_loop()
        self.state.async_engine.watch(self._from_engine_thread)  # and asks for a summary now
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)
        if not self.viewers:
            self.state.async_engine.watch(None)

    def close(self, reason: str = "shutdown") -> None:
        """Ends every stream (on the event loop), e.g. when the server begins to drain."""
        for viewer in list(self.viewers):
            viewer.stop(reason)

    def _from_engine_thread(self, summary: dict[str, Any]) -> None:
        data = f"data: {json.dumps(summary, separators=(',', ':'))}\n\n".encode()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to tell
                self._loop.call_soon_threadsafe(self._publish, data)

    def _publish(self, data: bytes) -> None:
        for viewer in list(self.viewers):
            if viewer.end is not None:
                continue
            try:
                viewer.queue.put_nowait(data)
            except asyncio.QueueFull:
                self.dropped += 1
                log.info("live view: dropped a viewer %d updates behind", QUEUE_SIZE)
                viewer.stop("dropped")


class LiveResponse:
    """One viewer's stream: a comment at once (so the client sees the headers), then one
    `data:` event per summary, until the client leaves or the feed ends it with
    `event: end` and `data: {"reason": ...}`."""

    def __init__(self, feed: LiveFeed, viewer: Viewer) -> None:
        self.feed = feed
        self.viewer = viewer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        viewer = self.viewer
        try:
            async with anyio.create_task_group() as tg:
                viewer.cancel_scope = tg.cancel_scope
                if viewer.end is not None:  # ended before its stream began
                    tg.cancel_scope.cancel()
                tg.start_soon(_until_disconnect, receive, tg.cancel_scope)
                headers = [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await _body(send, b": live step summaries\n\n")
                while True:
                    await _body(send, await viewer.queue.get())
        except OSError:
            pass  # the client went away mid-write
        finally:
            self.feed.unsubscribe(viewer)
        # The end event, unless the client is gone (then send returns at once). A viewer whose
        # socket stays full for FINAL_SEND_S does not get it: uvicorn then closes the
        # connection (and logs that the response was cut short).
        end = json.dumps({"reason": viewer.end or "closed"})
        with anyio.move_on_after(FINAL_SEND_S), contextlib.suppress(OSError):
            await send(
                {
                    "type": "http.response.body",
                    "body": f"event: end\ndata: {end}\n\n".encode(),
                    "more_body": False,
                }
            )


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def events_handler(feed: LiveFeed):
    async def events(state: ServerState, request: Request) -> LiveResponse:
        return LiveResponse(feed, feed.subscribe())

    return events


def page_routes() -> list[Route]:
    """The page's files, read once: `/` and what it loads."""
    routes = []
    for path, (name, media_type) in PAGE_FILES.items():
        body = (PAGE_DIR / name).read_bytes()

        async def serve(request: Request, body: bytes = body, media_type: str = media_type):
            return Response(body, media_type=media_type, headers=PAGE_HEADERS)

        routes.append(Route(path, serve, methods=["GET"]))
    return routes
