"""The HTTP server: OpenAI-compatible endpoints over one AsyncEngine, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gapless.engine.async_engine import AsyncEngine
from gapless.engine.engine import Engine, QueueFull, RequestError
from gapless.engine.events import Event, FinishedEvent, ProgressEvent, TokenEvent
from gapless.server import protocol
from gapless.server.metrics import CONTENT_TYPE, render_metrics
from gapless.server.protocol import APIError, ParsedRequest

log = logging.getLogger("gapless.server")

RETRY_AFTER_S = "1"


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    # On SIGTERM, in-flight requests get this long to finish before they are cancelled.
    shutdown_grace_s: float = 30.0


class ServerState:
    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.settings = settings
        self.created = protocol.now()
        self.draining = False
        self.live: set[str] = set()  # request ids whose response is still being written
        self.idle = asyncio.Event()
        self.idle.set()

    def request_started(self, request_id: str) -> None:
        self.live.add(request_id)
        self.idle.clear()

    def request_ended(self, request_id: str) -> None:
        self.live.discard(request_id)
        if not self.live:
            self.idle.set()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.to_dict(), error.status, headers=error.headers)


def _sse_data(obj: dict[str, Any] | str) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def _progress_comment(event: ProgressEvent) -> bytes:
    info = json.dumps({"processed": event.processed, "total": event.total})
    return f": prefill_progress {info}\n\n".encode()


def _server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


# -- rendering engine events as OpenAI objects ----------------------------------------------


class _Renderer:
    """One request's engine events as OpenAI chunks (streaming) or one response object."""

    id_prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
        self.tokenizer = state.engine.tokenizer
        self.model = state.settings.served_model_name
        self.parsed = parsed
        self.id = f"{self.id_prefix}-{request_id}"
        self.created = protocol.now()
        self.text: list[str] = []
        self.logprobs: list = []

    def envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = self.envelope([choice], self.chunk_object)
        if self.parsed.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last has usage null
        return out

    def usage_chunk(self, finished: FinishedEvent) -> dict[str, Any]:
        out = self.envelope([], self.chunk_object)
        out["usage"] = self.usage(finished)
        return out

    def usage(self, finished: FinishedEvent) -> dict[str, Any]:
        return protocol.usage(
            finished.prompt_tokens, finished.completion_tokens, finished.cached_prompt_tokens
        )

    def absorb(self, event: TokenEvent) -> None:
        self.text.append(event.text)
        self.logprobs += event.logprobs or []

    # Endpoint-specific parts.
    def opening(self) -> list[dict[str, Any]]:
        return []

    def token_choice(self, event: TokenEvent) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice(self, finished: FinishedEvent) -> dict[str, Any]:
        raise NotImplementedError

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        raise NotImplementedError


class _ChatRenderer(_Renderer):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        return protocol.chat_logprobs(self.tokenizer, entries)

    def opening(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]

    def token_choice(self, event: TokenEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {"content": event.text},
            "logprobs": self._logprobs(event.logprobs or []),
            "finish_reason": None,
        }

    def final_choice(self, finished: FinishedEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": finished.finish_reason,
        }

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(self.text)}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(self.logprobs),
            "finish_reason": finished.finish_reason,
        }
        out = self.envelope([choice], self.object_name)
        out["usage"] = self.usage(finished)
        return out


class _CompletionRenderer(_Renderer):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
        super().__init__(state, parsed, request_id)
        # Generated tokens' text_offset points into prompt + completion text.
        self.offset = len(parsed.prompt_text)

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        out = protocol.completion_logprobs(self.tokenizer, entries, [], self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def opening(self) -> list[dict[str, Any]]:
        if not self.parsed.echo:
            return []
        choice = {"index": 0, "text": self.parsed.prompt_text, "logprobs": None}
        return [self.chunk({**choice, "finish_reason": None})]

    def token_choice(self, event: TokenEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "text": event.text,
            "logprobs": self._logprobs(event.logprobs or []),
            "finish_reason": None,
        }

    def final_choice(self, finished: FinishedEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": finished.finish_reason,
        }

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        p = self.parsed
        text = "".join(self.text)
        logprobs = None
        if p.logprobs is not None and p.echo:
            prompt = protocol.completion_logprobs(
                self.tokenizer, finished.prompt_logprobs or [], p.prompt_ids, 0
            )
            # Offsets then count the `tokens` strings throughout, special tokens included.
            self.offset = sum(len(t) for t in prompt["tokens"])
            generated = self._logprobs(self.logprobs)
            logprobs = {k: prompt[k] + generated[k] for k in prompt}
        elif p.logprobs is not None:
            logprobs = self._logprobs(self.logprobs)
        if p.echo:
            text = p.prompt_text + text
        choice = {"index": 0, "text": text, "logprobs": logprobs}
        out = self.envelope(
            [{**choice, "finish_reason": finished.finish_reason}], "text_completion"
        )
        out["usage"] = self.usage(finished)
        return out


# -- response bodies ------------------------------------------------------------------------


@contextlib.contextmanager
def _admission_errors(prompt_param: str) -> Iterator[None]:
    """The engine's refusals of a new request as API errors."""
    try:
        yield
    except QueueFull as e:
        raise APIError(
            503,
            str(e),
            "overloaded_error",
            code="queue_full",
            headers={"Retry-After": RETRY_AFTER_S},
        ) from e
    except RequestError as e:
        param = prompt_param if e.param == "prompt" else e.param
        raise protocol.invalid(str(e), param, e.code) from e


async def _first_event(events: AsyncIterator[Event], prompt_param: str) -> Event:
    """The first event: AsyncEngine.stream adds the request on the first step of its
    iteration, so admission errors surface here, before any byte is sent."""
    with _admission_errors(prompt_param):
        return await anext(events)


def _error_chunk(message: str) -> bytes:
    return _sse_data(_server_error(message).to_dict())


async def _sse_body(
    renderer: _Renderer, events: AsyncIterator[Event], prompt_param: str
) -> AsyncIterator[bytes]:
    event = await _first_event(events, prompt_param)
    try:
        for chunk in renderer.opening():
            yield _sse_data(chunk)
        while True:
            if isinstance(event, ProgressEvent):
                yield _progress_comment(event)
            elif isinstance(event, TokenEvent):
                yield _sse_data(renderer.chunk(renderer.token_choice(event)))
            elif isinstance(event, FinishedEvent):
                if event.finish_reason == "error":
                    yield _error_chunk(event.error or "the request failed in the engine")
                else:
                    yield _sse_data(renderer.chunk(renderer.final_choice(event)))
                    if renderer.parsed.include_usage:
                        yield _sse_data(renderer.usage_chunk(event))
                break
            event = await anext(events)
    except Exception as e:  # this request fails alone; its stream still ends properly
        log.exception("request %s failed", renderer.id)
        yield _error_chunk(f"{type(e).__name__}: {e}")
    finally:
        await events.aclose()
    yield _sse_data("[DONE]")


async def _json_body(
    renderer: _Renderer, events: AsyncIterator[Event], prompt_param: str
) -> AsyncIterator[bytes]:
    event = await _first_event(events, prompt_param)
    try:
        while not isinstance(event, FinishedEvent):
            if isinstance(event, TokenEvent):
                renderer.absorb(event)
            event = await anext(events)
    finally:
        await events.aclose()
    if event.finish_reason == "error":
        raise _server_error(event.error or "the request failed in the engine")
    yield json.dumps(renderer.response(event), ensure_ascii=False).encode()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class EngineResponse:
    """An ASGI response for one engine request, streaming or not.

    Nothing is sent until the body yields its first piece, so admission errors still become
    proper status codes. The client connection is watched throughout: if it goes away, the
    body is cancelled where it waits, which closes the engine stream and so cancels the request
    at the next step. (Starlette's StreamingResponse notices a disconnect only when a write
    fails, and does not close the body generator itself.)
    """

    def __init__(
        self, state: ServerState, request_id: str, body: AsyncIterator[bytes], stream: bool
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.body = body
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.state.request_started(self.request_id)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                await self._respond(scope, receive, send)
                tg.cancel_scope.cancel()
        finally:
            await self.body.aclose()
            self.state.request_ended(self.request_id)

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(self.body)
        except APIError as e:
            await error_response(e)(scope, receive, send)
            return
        except Exception as e:  # never a bare 500 page, never a hang
            log.exception("request %s failed", self.request_id)
            await error_response(_server_error(f"{type(e).__name__}: {e}"))(scope, receive, send)
            return
        try:
            if not self.stream:
                await Response(first, media_type="application/json")(scope, receive, send)
                return
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for piece in self.body:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-write; the finally in __call__ cleans up


# -- endpoints ------------------------------------------------------------------------------


def _require_json(request: Request) -> None:
    """POST bodies must be declared JSON. Beyond clarity, this is what keeps a web page from
    driving a server on localhost: a browser sends text/plain or form bodies cross-origin
    without asking, but application/json only after a CORS preflight, which we never grant."""
    declared = request.headers.get("content-type", "")
    media_type = declared.partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            415,
            f"the Content-Type must be application/json, got {declared or 'none'!r}",
            code="unsupported_media_type",
        )


def max_json_values(max_model_len: int) -> int:
    """Every list item or object member a request holds costs at least one token of its
    context (prompt ids, messages, tool schemas that the template renders) or is one of a
    few dozen bounded fields, so a body with more than this many is refused unparsed:
    parsing builds one Python object per value while holding the GIL, which a million stop
    strings turned into a half-second stall of every stream."""
    return 2 * max_model_len + 1024


async def _read_json(request: Request, limit: int, max_model_len: int) -> dict[str, Any]:
    too_large = APIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise too_large
    # A comma separates two values: counting them bounds the values without parsing.
    values, most = data.count(b",") + 1, max_json_values(max_model_len)
    if values > most:
        raise APIError(
            413,
            f"the request body holds about {values} JSON values; no request that fits the "
            f"{max_model_len}-token context needs more than {most}",
            code="request_too_large",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise protocol.invalid(f"the request body is not valid UTF-8: {e}") from e
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise protocol.invalid(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise protocol.invalid("the request body must be a JSON object")
    protocol.check_unicode(text, body)
    return body


def _authorize(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise APIError(
            401,
            "no API key given; send it as `Authorization: Bearer <key>`",
            "authentication_error",
            code="invalid_api_key",
        )
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "incorrect API key", "authentication_error", code="invalid_api_key")


def _draining_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down",
        "overloaded_error",
        code="shutting_down",
        headers={"Retry-After": RETRY_AFTER_S},
    )


Handler = Callable[[ServerState, Request], Awaitable[Any]]


def _api(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Any]]:
    """Authorization and OpenAI-shaped errors for an /v1 endpoint."""

    async def endpoint(request: Request) -> Any:
        try:
            _authorize(state, request)
            if request.method == "POST":
                _require_json(request)
            return await handler(state, request)
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:  # any client can do this: one line, no traceback
            log.info("client hung up before sending all of its request to %s", request.url.path)
            return Response(status_code=400)

    return endpoint


def _check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    name = state.settings.served_model_name
    # A missing model is allowed: one model is served, so there is nothing to choose.
    if model is None or model == name:
        return
    if not isinstance(model, str):
        raise protocol.invalid("model must be a string", "model")
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {name!r}",
        "not_found_error",
        "model",
        "model_not_found",
    )


async def _generate(state: ServerState, request: Request, chat: bool) -> Any:
    if state.draining:
        raise _draining_error()
    body = await _read_json(request, state.settings.max_body_bytes, state.engine.max_model_len)
    _check_model(state, body)
    parse = protocol.parse_chat if chat else protocol.parse_completion
    # Chat templating and tokenizing a long prompt take a while: keep the event loop free.
    parsed = await anyio.to_thread.run_sync(
        parse, body, state.engine.tokenizer, state.engine.max_model_len
    )
    request_id = uuid.uuid4().hex
    renderer = (_ChatRenderer if chat else _CompletionRenderer)(state, parsed, request_id)
    prompt_param = "messages" if chat else "prompt"
    # Also here, in case stream() ever adds the request eagerly.
    with _admission_errors(prompt_param):
        events = state.async_engine.stream(parsed.prompt_ids, parsed.params, request_id)
    make_body = _sse_body if parsed.stream else _json_body
    return EngineResponse(
        state, request_id, make_body(renderer, events, prompt_param), parsed.stream
    )


async def chat_completions(state: ServerState, request: Request) -> Any:
    return await _generate(state, request, chat=True)


async def completions(state: ServerState, request: Request) -> Any:
    return await _generate(state, request, chat=False)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.settings.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "gapless",
        "max_model_len": state.engine.max_model_len,
    }


async def list_models(state: ServerState, request: Request) -> Any:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(state: ServerState, request: Request) -> Any:
    _check_model(state, {"model": request.path_params["model"]})
    return JSONResponse(_model_card(state))


async def cancel(state: ServerState, request: Request) -> Any:
    request_id = request.path_params["request_id"]
    for prefix in ("chatcmpl-", "cmpl-"):
        request_id = request_id.removeprefix(prefix)
    if not state.async_engine.cancel(request_id):
        raise APIError(
            404,
            f"no live request {request_id!r}",
            "not_found_error",
            "request_id",
            "request_not_found",
        )
    return JSONResponse({"id": request_id, "object": "cancellation", "cancelled": True})


def build_app(state: ServerState) -> Starlette:
    async def health(request: Request) -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(state.engine), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(_server_error(f"{type(exc).__name__}: {exc}"))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.async_engine.start()
        yield

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", _api(state, list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _api(state, get_model), methods=["GET"]),
        Route("/v1/chat/completions", _api(state, chat_completions), methods=["POST"]),
        Route("/v1/completions", _api(state, completions), methods=["POST"]),
        Route("/v1/cancel/{request_id}", _api(state, cancel), methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )


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
    ) -> None:
        self.state = ServerState(engine, settings)
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

    def run(self, sockets: list[socket.socket] | None = None) -> int:
        """Serves until stopped; 0 after a drain, 1 when a second signal cut it short."""
        asyncio.run(self.serve(sockets))
        return 1 if self.cut_short.is_set() else 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
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

    def stop_now(self) -> None:
        """Ends the drain early: in-flight requests are cancelled at once. Thread-safe."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.cut_short.set)

    def _begin_drain(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
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
