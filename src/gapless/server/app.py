"""The HTTP server: every API dialect's routes over one AsyncEngine, and graceful shutdown.

Each API dialect is one module (OpenAI's, one per endpoint) listing its ROUTES, and one
Dialect record in DIALECTS; what their endpoints share is endpoint.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gapless.engine.engine import Engine
from gapless.server import (
    anthropic,
    live,
    ollama,
    openai_batches,
    openai_chat,
    openai_common,
    openai_completions,
    openai_embeddings,
    openai_files,
    protocol,
    rerank,
    responses,
    tokenization,
)
from gapless.server.batch_jobs import BatchJobs
from gapless.server.batch_store import BatchStore
from gapless.server.endpoint import (
    ErrorBody,
    Handler,
    ServerState,
    cancel_endpoint,
    endpoint,
    error_response,
    max_json_values,
)
from gapless.server.kv_events import KVEventPublisher
from gapless.server.metrics import CONTENT_TYPE, render_metrics
from gapless.server.protocol import APIError
from gapless.server.settings import ServerSettings
from gapless.server.tenants import Tenants

__all__ = ["GaplessServer", "build_app", "max_json_values"]

log = logging.getLogger("gapless.server")

# After the engine failed, the server answers 503 this long before it exits.
FAILED_LINGER_S = 2.0


@dataclass(frozen=True)
class Dialect:
    """An API dialect: its routes, the shape of its errors on them (and on a wrong method on
    its paths), and the prefixes of the ids its responses carry, by which a live request is
    cancelled too. Adding one is its module and a line in DIALECTS."""

    routes: list[tuple[str, str, Handler]]
    error_body: ErrorBody
    id_prefixes: tuple[str, ...] = ()


DIALECTS = (
    Dialect(
        [
            *openai_common.ROUTES,
            *openai_chat.ROUTES,
            *openai_completions.ROUTES,
            *openai_embeddings.ROUTES,
            *rerank.ROUTES,
            *openai_files.ROUTES,
            *openai_batches.ROUTES,
            *responses.ROUTES,
            *tokenization.ROUTES,
        ],
        openai_common.error_body,
        (openai_chat.ID_PREFIX, openai_completions.ID_PREFIX, responses.ID_PREFIX),
    ),
    Dialect(anthropic.ROUTES, anthropic.error_body, (anthropic.ID_PREFIX,)),
    Dialect(ollama.ROUTES, ollama.error_body),
)

# A live request of any dialect is cancelled by its id, or the id its response carries.
CANCEL_ROUTE = (
    "POST",
    "/v1/cancel/{request_id}",
    cancel_endpoint(prefix for dialect in DIALECTS for prefix in dialect.id_prefixes),
)


def build_app(state: ServerState) -> Starlette:
    async def health(request: Request) -> Response:
        if state.async_engine.failure is not None:
            return JSONResponse({"status": "failed"}, 503)
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        if state.warming is not None and not state.warming.done():
            # Requests queue meanwhile, but would wait behind the step: a readiness probe
            # should send them elsewhere (llama-server answers 503 "Loading model" too).
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(state.engine, state.tenants), media_type=CONTENT_TYPE)

    feed = live.LiveFeed(state)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        # The page at / (no key: it holds no data) and its feed (behind the key, as the API).
        *live.page_routes(),
        Route(
            live.PATH,
            endpoint(state, live.events_handler(feed), openai_common.error_body),
            methods=["GET"],
        ),
    ]
    # A wrong method on a dialect's path gets that dialect's error shape; anything else, OpenAI's.
    error_bodies = {}
    served = [(dialect.routes, dialect.error_body) for dialect in DIALECTS]
    for dialect_routes, error_body in [*served, ([CANCEL_ROUTE], openai_common.error_body)]:
        for method, path, handler in dialect_routes:
            routes.append(Route(path, endpoint(state, handler, error_body), methods=[method]))
            error_bodies[path] = error_body

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error_body = error_bodies.get(request.url.path, openai_common.error_body)
        return error_response(APIError(exc.status_code, str(exc.detail), kind), error_body)

    async def server_error(request: Request, exc: Exception) -> Response:
        error = protocol.server_error(f"{type(exc).__name__}: {exc}")
        return error_response(error, error_bodies.get(request.url.path, openai_common.error_body))

    jobs = None if state.batch_store is None else BatchJobs(state, state.batch_store)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        kv_events = _kv_events(state)
        state.async_engine.start()
        if jobs is not None:
            await jobs.resume()  # the jobs a stopped server left unfinished
        yield
        if jobs is not None:
            await jobs.stop()
        if kv_events is not None:
            state.engine.kv.pool.events = None
            kv_events.close()

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.live_feed = feed
    app.state.batch_jobs = jobs  # openai_batches starts and cancels them
    return app


def _kv_events(state: ServerState) -> KVEventPublisher | None:
    """--kv-events-endpoint's publisher, told of group 0's cache (the one every layer group's
    reuse starts from: kv/manager.py), or None without the flag."""
    endpoint = state.settings.kv_events_endpoint
    if endpoint is None:
        return None
    kv = state.engine.kv
    publisher = KVEventPublisher(endpoint, state.settings.kv_events_topic or "", kv.block_size)
    kv.pool.events = publisher
    return publisher


# -- running and stopping -------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, owner: GaplessServer) -> None:
        super().__init__(config)
        self.owner = owner

    def handle_exit(self, sig: int, frame: Any) -> None:
        # uvicorn would stop at once and re-raise the signal on exit (exit status 143). Here a
        # first signal drains; a second cuts the drain short, cancelling what is in flight
        # so every stream still ends properly; a third gives up on that too.
        if self.owner.cut_short.is_set():
            self.should_exit = self.force_exit = True
        elif self.owner.state.draining:
            self.owner.stop_now()
        else:
            self.owner.shutdown()


class GaplessServer:
    """The app on uvicorn. run() blocks until shut down (SIGTERM, SIGINT or shutdown())."""

    def __init__(
        self,
        engine: Engine,
        settings: ServerSettings,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "info",
        engine_thread: ThreadPoolExecutor | None = None,
        tenants: Tenants | None = None,
        warming: Future | None = None,
        batch_store: BatchStore | None = None,
    ) -> None:
        """engine_thread: the thread the engine was loaded on (async_engine.engine_thread);
        tenants: --api-keys' (read before the model loads, so a bad file stops the start);
        warming: the start-up step's, queued on that thread (/health is 503 until it is done);
        batch_store: --data-dir's (opened before the model loads, as tenants are)."""
        self.state = ServerState(engine, settings, engine_thread, tenants, warming, batch_store)
        self.app = build_app(self.state)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            # Streams are finished or cancelled by the drain; this only bounds stragglers.
            timeout_graceful_shutdown=5,
        )
        self.uvicorn = _Uvicorn(config, self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.cut_short = asyncio.Event()  # the drain is to cancel everything now
        self.state.async_engine.on_failure = self._engine_failed

    def run(self, sockets: list[socket.socket] | None = None) -> int:
        """Serves until stopped; 0 after a drain, 1 when a second signal cut it short or the
        engine failed."""
        asyncio.run(self.serve(sockets))
        return 1 if self.cut_short.is_set() or self.state.async_engine.failure else 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.state.tenants is not None and threading.current_thread() is threading.main_thread():
            self._loop.add_signal_handler(signal.SIGHUP, self.state.tenants.reload)
        try:
            await self.uvicorn.serve(sockets)
        finally:
            # Here rather than in the lifespan, which uvicorn skips on a forced exit: the
            # engine thread must end before the event loop closes (it posts events to it), and
            # before the interpreter exits (a thread still inside torch then aborts it).
            await anyio.to_thread.run_sync(self.state.async_engine.stop)

    def shutdown(self) -> None:
        """Stops admission and drains in-flight requests, then the server. Thread-safe."""
        if self._loop is None:
            return
        # A closed loop means the server has already stopped.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _engine_failed(self) -> None:
        """Stops the server a moment after the engine failed: in that moment new requests
        get a 503 rather than a refused connection. Thread-safe."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(
                    self._loop.call_later, FAILED_LINGER_S, self._begin_drain
                )

    def stop_now(self) -> None:
        """Ends the drain early: in-flight requests are cancelled at once. Thread-safe."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.cut_short.set)

    def _begin_drain(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        self.app.state.live_feed.close("shutdown")  # its streams never end by themselves
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        state = self.state
        grace = state.settings.shutdown_grace_s
        log.info("shutting down: %d request(s) in flight, %.0f s to finish", len(state.live), grace)
        if not await self._until_idle(grace, or_cut_short=True):
            log.warning("cancelling %d request(s) still running", len(state.live))
            for request_id in list(state.live):
                state.async_engine.cancel(request_id)
            if not await self._until_idle(5):
                log.error("%d request(s) did not end after cancellation", len(state.live))
        self.uvicorn.should_exit = True

    async def _until_idle(self, timeout: float, or_cut_short: bool = False) -> bool:
        """Waits up to timeout for no request to be in flight; True if none is."""
        waits = [asyncio.ensure_future(self.state.idle.wait())]
        if or_cut_short:
            waits.append(asyncio.ensure_future(self.cut_short.wait()))
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        return self.state.idle.is_set()
