"""What every API dialect's endpoints share: reading the body, auth, admission into the engine
(and the engine's refusals in the request's field names), the response (streamed or whole)
with cancel-on-disconnect, cancellation by id, and errors.

A dialect module (e.g. anthropic.py) parses its requests into checked prompt ids and
SamplingParams (an embedding request: the prompt ids of its inputs, for embed()), renders
engine events with a Renderer subclass, shapes APIError with its own `error_body`, and lists
its ROUTES; app.py registers them with that shape (a Dialect record).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gapless.engine.admission import RequestError
from gapless.engine.async_engine import AsyncEngine
from gapless.engine.engine import Engine, EngineFailed, QueueFull
from gapless.engine.events import Event, TokenEvent
from gapless.engine.sampling_params import SamplingParams, SamplingParamsError
from gapless.model.describe import ModelDescription, describe
from gapless.server import protocol
from gapless.server.batch_store import BatchStore
from gapless.server.protocol import APIError
from gapless.server.response_store import ResponseStore
from gapless.server.settings import ServerSettings
from gapless.server.streaming import Renderer, json_body, stream_body
from gapless.server.tenants import CALLER, OverLimit, Tenant, Tenants

log = logging.getLogger("gapless.server")


# An APIError as one dialect's JSON error body.
ErrorBody = Callable[[APIError], dict[str, Any]]

# A request's names for the engine's fields where they differ (prompt -> messages, max_tokens
# -> num_predict, ...), so that an error names the field the client sent.
FieldNames = Mapping[str, str]


class ServerState:
    def __init__(
        self,
        engine: Engine,
        settings: ServerSettings,
        thread: ThreadPoolExecutor | None = None,
        tenants: Tenants | None = None,
        warming: Future | None = None,
        batch_store: BatchStore | None = None,
    ) -> None:
        """tenants: --api-keys' (then every API request needs one of its keys); warming: the
        start-up step's (GaplessServer's); batch_store: --data-dir's, for the Files and
        Batches API (app.py runs its jobs, as the app's `batch_jobs`)."""
        self.engine = engine
        self.warming = warming
        self.tenants = tenants
        self.batch_store = batch_store
        self.async_engine = AsyncEngine(engine, thread)
        self.settings = settings
        self.created = protocol.now()
        self.responses = ResponseStore(
            settings.response_store_entries, settings.response_store_bytes
        )
        self.draining = False
        self.live: set[str] = set()  # request ids whose response is still being written
        self.idle = asyncio.Event()
        self.idle.set()

    @functools.cached_property
    def description(self) -> ModelDescription:
        """The served model, as Ollama's and OpenAI's model endpoints describe it."""
        return describe(self.engine.decoder, self.engine.max_model_len)

    def request_started(self, request_id: str) -> None:
        self.live.add(request_id)
        self.idle.clear()

    def request_ended(self, request_id: str) -> None:
        self.live.discard(request_id)
        if not self.live:
            self.idle.set()


def error_response(error: APIError, error_body: ErrorBody) -> JSONResponse:
    return JSONResponse(error_body(error), error.status, headers=error.headers)


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class EngineResponse:
    """An ASGI response for one engine request, streaming or not.

    Nothing is sent until the body yields its first piece, so an error before then still
    becomes a proper status code. The client connection is watched throughout: if it goes
    away, the body is cancelled where it waits, which closes the engine stream and so cancels
    the request at the next step. (Starlette's StreamingResponse notices a disconnect only
    when a write fails, and does not close the body generator itself.)
    """

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        renderer: Renderer,
        events: AsyncIterator[Event],
        stream: bool,
        tenant: Tenant | None = None,
    ) -> None:
        """tenant: admitted by Tenants.admit; its count in flight ends with the response."""
        self.state = state
        self.tenant = tenant
        self.request_id = request_id
        self.renderer = renderer
        self.stream = stream
        # The shape of an error before the first byte: the dialect's of the route that
        # answers with this response (endpoint() sets it).
        self.error_body: ErrorBody | None = None
        self.body = (
            stream_body(renderer, events, request_id) if stream else json_body(renderer, events)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self._in_flight(), anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            await self._respond(scope, receive, send)
            tg.cancel_scope.cancel()

    async def read(self) -> dict[str, Any]:
        """The whole response's JSON object, for a caller in this server rather than a
        client (a batch job's line); an error is raised as the APIError a client would get."""
        assert not self.stream, "a stream has no whole body"
        async with self._in_flight():
            try:
                body = await anext(self.body)
            except APIError:
                raise
            except Exception as e:
                log.exception("request %s failed", self.request_id)
                raise protocol.server_error(f"{type(e).__name__}: {e}") from e
        return json.loads(body)

    @contextlib.asynccontextmanager
    async def _in_flight(self) -> AsyncIterator[None]:
        """The request counted in flight (the drain waits for it) while it is answered."""
        self.state.request_started(self.request_id)
        try:
            yield
        finally:
            # Shielded: a batch job's line is cancelled from outside, and the engine request
            # must still be cancelled and the count in flight end.
            with anyio.CancelScope(shield=True):
                await self.body.aclose()
            self.state.request_ended(self.request_id)
            if self.tenant is not None:
                self.state.tenants.ended(self.tenant)  # type: ignore[union-attr]

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(self.body)
        except Exception as e:  # never a bare 500 page, never a hang
            if not isinstance(e, APIError):
                log.exception("request %s failed", self.request_id)
                e = protocol.server_error(f"{type(e).__name__}: {e}")
            assert self.error_body is not None, "served by endpoint(), which sets it"
            await error_response(e, self.error_body)(scope, receive, send)
            return
        try:
            if not self.stream:
                await Response(first, media_type="application/json")(scope, receive, send)
                return
            headers = [
                (b"content-type", self.renderer.stream_media_type.encode()),
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


@contextlib.contextmanager
def admission_errors(names: FieldNames | None = None) -> Iterator[None]:
    """The engine's refusals of a request, by its checks while the request is parsed or at
    admission, as API errors naming the request's fields (`names`)."""
    try:
        yield
    except QueueFull as e:
        raise protocol.retry_later(503, str(e), "overloaded_error", "queue_full") from e
    except EngineFailed as e:
        raise APIError(503, f"the engine failed: {e}", "server_error", code="engine_failed") from e
    except (RequestError, SamplingParamsError) as e:
        message, param = str(e), e.param
        name = (names or {}).get(param, param)
        # A message that begins with the field's name (`top_k must be ...`) names it as the
        # request does; others speak of it in words (`the prompt has 9000 tokens, ...`).
        if name != param and message.startswith(f"{param} "):
            message = f"{name}{message[len(param) :]}"
        code = e.code if isinstance(e, RequestError) else None
        raise protocol.invalid(message, name, code) from e


T = TypeVar("T")


async def parse_off_loop(names: FieldNames, parse: Callable[[], T]) -> T:
    """A dialect's parse of a request, run in a thread: chat templating and tokenizing a long
    prompt take a while, and the event loop must stay free. The engine's refusals come out as
    API errors naming the request's fields."""
    with admission_errors(names):
        return await anyio.to_thread.run_sync(parse)


class Parsed(Protocol):
    """A dialect's parsed request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool


P = TypeVar("P", bound=Parsed)


async def generate(
    state: ServerState,
    names: FieldNames,
    parse: Callable[[], P],
    renderer: Callable[[P, str], Renderer],
) -> EngineResponse:
    """Parses a request (off the event loop), admits it into the engine and answers with its
    events, as renderer(parsed, request_id) shapes them. AsyncEngine.stream adds the request
    at once, so a refusal (queue full, params the engine rejects) is raised here, before the
    response exists; every refusal names the request's fields (`names`)."""
    if state.settings.task == "embed":
        raise APIError(
            400,
            "this server serves embeddings only (--task embed): use /v1/embeddings or /api/embed",
            code="embeddings_only",
        )
    parsed = await parse_off_loop(names, parse)
    if state.draining:
        raise draining_error()
    request_id = uuid.uuid4().hex
    shaped = renderer(parsed, request_id)
    tenant = _admit_caller(state, len(parsed.prompt_ids))
    params = parsed.params if tenant is None else replace(parsed.params, tenant=tenant.name)
    try:
        with admission_errors(names):
            events = state.async_engine.stream(parsed.prompt_ids, params, request_id)
    except BaseException:
        _caller_ended(state, tenant)
        raise
    if tenant is not None and tenant.tokens_per_minute is not None:
        events = _charged(events, state.tenants, tenant)  # type: ignore[arg-type]
    return EngineResponse(state, request_id, shaped, events, parsed.stream, tenant)


async def _charged(
    events: AsyncIterator[Event], tenants: Tenants, tenant: Tenant
) -> AsyncIterator[Event]:
    """The events, with each output token spent against the tenant's tokens_per_minute."""
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                tenants.spend(tenant, len(event.token_ids))
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # cancels the request if unfinished


def _admit_caller(state: ServerState, prompt_tokens: int) -> Tenant | None:
    """The caller's tenant, counted in flight (Tenants.admit; a 429 past its limits)."""
    tenant = CALLER.get()
    if tenant is not None:
        try:
            state.tenants.admit(tenant, prompt_tokens)  # type: ignore[union-attr]
        except OverLimit as e:
            raise protocol.retry_later(
                429, str(e), "rate_limit_error", "too_many_requests", e.retry_after_s
            ) from e
    return tenant


def _caller_ended(state: ServerState, tenant: Tenant | None) -> None:
    if tenant is not None:
        state.tenants.ended(tenant)  # type: ignore[union-attr]


class ParsedEmbedding(Protocol):
    """A dialect's parsed embedding request: the prompt ids of each of its inputs."""

    prompts: list[list[int]]


E = TypeVar("E", bound=ParsedEmbedding)


class PrefillOnlyRenderer(Renderer):
    """A request that prefills its inputs and samples nothing (embeddings, scores): each
    input's result, in the order of its inputs, once all are computed."""

    def results(self, field: str, what: str) -> list[Any]:
        """Each input's FinishedEvent `field` (what: their name in the error)."""
        by_index = {}
        for finished in self.finishes:
            if (result := getattr(finished, field)) is None:  # cancelled: the drain ran out
                raise APIError(
                    503,
                    f"the request was cancelled before its {what} were computed",
                    "overloaded_error",
                    code="cancelled",
                )
            by_index[finished.index] = result
        return [by_index[i] for i in range(len(by_index))]

    @property
    def prompt_tokens(self) -> int:
        return sum(f.prompt_tokens for f in self.finishes)


class EmbeddingRenderer(PrefillOnlyRenderer):
    """An embedding request's vectors, in the order of its inputs, once all are computed."""

    def vectors(self) -> list[list[float]]:
        return self.results("embedding", "embeddings")


async def embed(
    state: ServerState,
    names: FieldNames,
    parse: Callable[[], E],
    renderer: Callable[[E, str], Renderer],
    score: bool = False,
) -> EngineResponse:
    """As generate(), for an embedding request: every input is a sequence of one engine
    request, prefilled beside the running decodes; the response, once all have finished,
    holds their vectors. With `score`, the inputs are pair prompts, and the response holds
    their scores (rerank.py)."""
    parsed = await parse_off_loop(names, parse)
    if state.draining:
        raise draining_error()
    request_id = uuid.uuid4().hex
    shaped = renderer(parsed, request_id)
    tenant = _admit_caller(state, sum(map(len, parsed.prompts)))
    try:
        with admission_errors(names):
            submit = state.async_engine.score if score else state.async_engine.embed
            events = submit(parsed.prompts, request_id)
    except BaseException:
        _caller_ended(state, tenant)
        raise
    return EngineResponse(state, request_id, shaped, events, stream=False, tenant=tenant)


def draining_error() -> APIError:
    return protocol.retry_later(
        503, "the server is shutting down", "overloaded_error", "shutting_down"
    )


# -- requests -------------------------------------------------------------------------------


JSON = "application/json"


def accepts(media_type: str) -> Callable[[Handler], Handler]:
    """Marks a handler whose POST body is of `media_type` rather than JSON (an upload's
    multipart/form-data)."""

    def mark(handler: Handler) -> Handler:
        handler.media_type = media_type  # type: ignore[attr-defined]
        return handler

    return mark


def _require_media_type(request: Request, media_type: str) -> None:
    """POST bodies must be declared JSON (or the media type the handler accepts). Beyond
    clarity, this is what keeps a web page from driving a server on localhost: a browser
    sends text/plain or form bodies cross-origin without asking, but application/json only
    after a CORS preflight, which we never grant. A form body (an upload) is refused when a
    browser says it comes from another origin."""
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != media_type:
        raise APIError(
            415,
            f"the Content-Type must be {media_type}, got {declared or 'none'!r}",
            code="unsupported_media_type",
        )
    origin = request.headers.get("origin")
    if media_type != JSON and origin is not None and urlsplit(origin).netloc != request.url.netloc:
        raise APIError(403, f"uploads from {origin} are refused", code="cross_origin")


def max_json_values(max_model_len: int) -> int:
    """Every list item or object member a request holds costs at least one token of its
    context (prompt ids, messages, tool schemas that the template renders) or is one of a
    few dozen bounded fields, so a body with more than this many is refused unparsed:
    parsing builds one Python object per value while holding the GIL, which a million stop
    strings turned into a half-second stall of every stream."""
    return 2 * max_model_len + 1024


async def read_json(state: ServerState, request: Request, contexts: int = 1) -> dict[str, Any]:
    """The request's JSON object body (json_object), read no further than the size limit."""
    limit = state.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise _too_large(limit)
    return json_object(state, bytes(data), contexts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def json_object(state: ServerState, data: bytes, contexts: int = 1) -> dict[str, Any]:
    """A request's JSON object (a body, or a batch job's line), bounded in bytes and values
    before it is parsed: values for what fits in `contexts` contexts (a batch of embedding
    inputs, more than one)."""
    limit, max_model_len = state.settings.max_body_bytes, state.engine.max_model_len
    if len(data) > limit:
        raise _too_large(limit)
    # A comma separates two values: counting them bounds the values without parsing.
    values, most = data.count(b",") + 1, max_json_values(max_model_len * contexts)
    if values > most:
        fits = f"the {max_model_len}-token context"
        if contexts > 1:
            fits = f"{contexts} times {fits} (send a larger batch in parts)"
        raise APIError(
            413,
            f"the request body holds about {values} JSON values; no request that fits "
            f"{fits} needs more than {most}",
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


def _authorize(state: ServerState, request: Request) -> Tenant | None:
    """The API key, as `Authorization: Bearer <key>` or (Anthropic's way) `x-api-key`: the
    one --api-key names, or one of --api-keys' (its tenant is returned)."""
    key = state.settings.api_key
    if key is None and state.tenants is None:
        return None
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(
                401,
                "no API key given; send it as `Authorization: Bearer <key>` or `x-api-key`",
                "authentication_error",
                code="invalid_api_key",
            )
    given = given.strip()
    if state.tenants is not None:
        tenant = state.tenants.identify(given)
        if tenant is not None:
            return tenant
    elif hmac.compare_digest(given.encode(), key.encode()):  # type: ignore[union-attr]
        return None
    raise APIError(401, "incorrect API key", "authentication_error", code="invalid_api_key")


Handler = Callable[[ServerState, Request], Awaitable[Response]]


def cancel_endpoint(id_prefixes: Iterable[str]) -> Handler:
    """POST /v1/cancel/{request_id}: cancels a live request of any dialect, named by its bare
    id or by the id its response carries, a dialect's prefix (`id_prefixes`) and all."""
    prefixes = tuple(id_prefixes)

    async def cancel(state: ServerState, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        for prefix in prefixes:
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

    return cancel


def endpoint(
    state: ServerState, handler: Handler, error_body: ErrorBody
) -> Callable[[Request], Awaitable[Response]]:
    """A route's handler behind authorization, with errors in its dialect's shape."""

    async def run(request: Request) -> Response:
        try:
            CALLER.set(_authorize(state, request))
            if request.method == "POST":
                _require_media_type(request, getattr(handler, "media_type", JSON))
            response = await handler(state, request)
            if isinstance(response, EngineResponse):
                response.error_body = error_body
            return response
        except APIError as e:
            return error_response(e, error_body)
        except ClientDisconnect:  # any client can do this: one line, no traceback
            log.info("client hung up before sending all of its request to %s", request.url.path)
            return Response(status_code=400)

    return run
