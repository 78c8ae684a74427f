"""The ASGI app: OpenAI's chat and completions endpoints, models, health and metrics.

Request path: auth -> body (size, read timeout) -> JSON (depth, then parse)
-> fields -> prompt (tokenize, vocabulary, positions) -> queue (429 when
full) -> the model worker, which streams text deltas back through an
asyncio queue. A client that goes away sets the job's cancel flag: a queued
job is skipped, a running one stops at its next decoding step. Every error
is a JSON response in OpenAI's error format; store faults never are (the
loader recomputes, the metrics count them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from cachegen.engine.completion import Completion
from cachegen.errors import CachegenError, ConfigError
from cachegen.serve.config import ServeConfig
from cachegen.serve.errors import APIError, error_body, error_response
from cachegen.serve.limits import parse_json, read_body
from cachegen.serve.metrics import Metrics
from cachegen.serve.protocol import ParsedRequest, ResponseBuilder, parse
from cachegen.serve.worker import Job, ModelWorker, QueueFull
from cachegen.store.url import redact

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


class _Stream:
    """Events from the model worker to one request's coroutine (thread-safe put)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.q: asyncio.Queue = asyncio.Queue()

    def put(self, kind: str, value: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, (kind, value))


def create_app(engine, config: ServeConfig | None = None) -> _Guard:
    cfg = config or ServeConfig()
    worker = ModelWorker(cfg.max_queue)
    metrics = Metrics(engine, worker)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="cachegen", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics, app.state.config = engine, worker, metrics, cfg

    # -- errors ------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = f"no such endpoint: {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
        return JSONResponse(
            error_body(e.status_code, msg, "not_found" if e.status_code == 404 else None), status_code=e.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(e), "invalid_request"), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        log.error("internal error on %s: %s", request.url.path, redact(f"{type(e).__name__}: {e}"))
        return JSONResponse(error_body(500, "internal server error", "internal_error"), status_code=500)

    # -- endpoints -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        store: dict[str, Any] = {
            "url": redact(getattr(engine.store.backend, "url", "") or ""),
            "chunk_tokens": engine.store.chunk_tokens,
        }
        try:
            stats = await asyncio.wait_for(asyncio.to_thread(engine.store.backend.stats), timeout=3.0)
            store.update(state="ok", stats=stats.to_json())
        except TimeoutError:
            store.update(state="unavailable", error="the store did not answer within 3 s")
        except (CachegenError, OSError) as e:
            store.update(state="unavailable", error=redact(f"{type(e).__name__}: {e}"))
        w = engine.writer
        return JSONResponse(
            {
                "status": "ok" if store["state"] == "ok" else "degraded",
                "model": cfg.model_name,
                "store": store,
                "queue": {"waiting": worker.waiting, "running": worker.running, "max": cfg.max_queue},
                "writer": {
                    "depth": w.depth(),
                    "dropped": w.stats.dropped,
                    "failed": w.stats.failed,
                    "errors": [redact(x) for x in w.stats.errors],
                },
            }
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "cachegen"}],
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, "completion")

    # -- one generation ----------------------------------------------------------------
    async def _handle(request: Request, kind: str) -> Response:
        endpoint = request.url.path
        raw = await read_body(request, cfg.max_body_bytes, cfg.read_timeout_s)
        body = parse_json(raw, cfg.max_json_depth)
        req = parse(body, kind, cfg.default_max_tokens, cfg.slo_s)
        messages, prompt = _prompt(req)
        try:
            engine.check_prompt(prompt, req.params.max_tokens)
        except ConfigError as e:
            raise APIError(
                400,
                str(e),
                "context_length_exceeded" if "positions" in str(e) else "invalid_value",
                "messages" if kind == "chat" else "prompt",
            ) from None
        stream = _Stream(asyncio.get_running_loop())
        job = Job(lambda j: _run(j, req, prompt, messages, stream, endpoint))
        try:
            worker.submit(job)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy ({e}); retry later",
                "server_busy",
                headers={"Retry-After": str(cfg.retry_after_s)},
            ) from None
        out = ResponseBuilder(kind, req.model or cfg.model_name)
        if req.stream:
            return StreamingResponse(
                _sse(request, job, stream, out, req, endpoint),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            run = await _wait_done(request, job, stream)
        finally:
            job.cancel()  # no-op once done; stops the job if this coroutine was cancelled
        if run is None:  # the client went away; nobody reads this
            return JSONResponse(error_body(499, "client closed the request"), status_code=499)
        return JSONResponse(out.full(run))

    def _prompt(req: ParsedRequest) -> tuple[list[dict] | None, list[int]]:
        try:
            if req.kind == "chat":
                return engine.chat_prompt(req.messages)
            if req.prompt_ids is not None:
                return None, req.prompt_ids
            ids = engine.tokenizer(req.prompt_text, add_special_tokens=True)["input_ids"]
            if not ids:
                raise ConfigError("the prompt is empty")
            return None, ids
        except ConfigError as e:
            raise APIError(400, str(e), "invalid_value", "messages" if req.kind == "chat" else "prompt") from None

    def _run(job: Job, req: ParsedRequest, prompt: list[int], messages, stream: _Stream, endpoint: str) -> None:
        """In the model worker: generate, pushing deltas; then store the answer."""
        run = None
        try:
            run = engine.start(prompt, req.params, req.opts, messages=messages, cancelled=job.cancelled.is_set)
            for delta in run:
                stream.put("delta", delta)
            metrics.observe(endpoint, run)
            stream.put("done", run)
        except Exception as e:
            log.error("generation failed: %s", redact(f"{type(e).__name__}: {e}"))
            stream.put("error", e)
            return
        try:
            run.finish()
        except Exception as e:
            log.warning("storing the answer failed: %s", redact(f"{type(e).__name__}: {e}"))

    async def _wait_done(request: Request, job: Job, stream: _Stream) -> Completion | None:
        while True:
            try:
                kind, value = await asyncio.wait_for(stream.q.get(), timeout=_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None
                continue
            if kind == "done":
                return value
            if kind == "error":
                raise APIError(500, "the generation failed on the server", "internal_error")

    async def _sse(
        request: Request, job: Job, stream: _Stream, out: ResponseBuilder, req: ParsedRequest, endpoint: str
    ) -> AsyncIterator[bytes]:
        def event(obj: dict) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        try:
            first = True
            checked = time.monotonic()
            while True:
                try:
                    kind, value = await asyncio.wait_for(stream.q.get(), timeout=_POLL_S)
                except TimeoutError:
                    kind, value = "", None
                if time.monotonic() - checked >= _POLL_S:  # also while deltas flow: sends to a gone client may not fail
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if kind == "delta":
                    yield event(out.chunk(value, first=first))
                    first = False
                elif kind == "done":
                    if first:  # the role chunk, for an empty answer
                        yield event(out.chunk("", first=True))
                    yield event(out.chunk(None, run=value))
                    if req.include_usage:
                        yield event(out.usage_chunk(value))
                    yield b"data: [DONE]\n\n"
                    return
                elif kind == "error":
                    yield event(error_body(500, "the generation failed on the server", "internal_error"))
                    return
        finally:
            job.cancel()

    return _Guard(app, cfg, metrics)


class _Guard:
    """Pure ASGI middleware: the API key, and requests counted by endpoint and status.

    (Not Starlette's BaseHTTPMiddleware: it buffers streamed responses and
    hides client disconnects from them.)"""

    def __init__(self, app: FastAPI, cfg: ServeConfig, metrics: Metrics):
        self.app, self.cfg, self.metrics = app, cfg, metrics
        self.state = app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        t = time.perf_counter()
        status = {"code": 500}

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.cfg.api_key and path != "/health" and not _authorized(scope, self.cfg.api_key):
                resp = error_response(
                    APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'", "invalid_api_key")
                )
                await resp(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            if endpoint.endswith("completions"):
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t)


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _authorized(scope, key: str) -> bool:
    got = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), "")
    scheme, _, token = got.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
