"""The OpenAI-compatible HTTP server: one more client of the gateway (no engine of its own).

    app = create_app(ServerConfig(client_address, model="smollm2-135m-instruct"))
    uvicorn.run(app)

Routes: GET /v1/models, POST /v1/chat/completions and /v1/completions (streamed as SSE when
"stream": true), GET /health (503 until every stage is ready), GET /metrics (Prometheus), and the
web chat at /. Every response carries x-request-id (the client's own if it sent a usable one);
the same id names the request in the pipeline and in the logs.

Admission: a body over `max_body_mb` gets 413 before it is read (its Content-Length) or as soon as
its bytes pass the limit; at most `max_concurrency` requests are in the pipeline; up to `max_queue`
more wait for a place; beyond that a request gets 429 with Retry-After. A request ends at its
`timeout` (body field, else the server's); a client that goes away cancels its request in every
stage. A request that waits or runs longer than REPORT_S is logged with where it is.

The routes are this module's; what they share is one ServerState in app.state.server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specsot_mq.client import Client
from specsot_mq.errors import SpecSotError
from specsot_mq.messages import Answer, AnswerText, Failed, MergePlan
from specsot_mq.sampling_params import REPEAT_STOP, SamplingParams
from specsot_mq.server import api
from specsot_mq.server.api import ApiError
from specsot_mq.server.metrics import Metrics

log = logging.getLogger("specsot.server")
STATIC = Path(__file__).parent / "static"
_RID = re.compile(r"[A-Za-z0-9._-]{1,64}")
REPORT_S = 5.0  # a request waiting or running this long is logged with where it is (then at each doubling)


@dataclass(slots=True)
class ServerConfig:
    client_address: str  # the gateway's
    model: str  # the id clients name in "model"
    api_keys: list[str] = field(default_factory=list)  # none: no authentication
    max_concurrency: int = 8  # requests in the pipeline at once
    max_queue: int = 64  # requests waiting beyond those
    timeout: float = 600.0  # seconds a request may take (a body's "timeout" overrides it)
    budget: int | None = None  # tokens per hour per API key (per client address without keys)
    max_tokens: int = 256  # default per phase
    repeat_stop: int = REPEAT_STOP
    watch: Callable[[], list[str]] | None = None  # called every second: a local launch restarting dead stages
    curve: dict | None = None  # the run's CURVE keys, when the gateway listens on tcp
    max_body_mb: float = 4.0  # a larger request body gets 413


class RequestId:
    """Every request's id (the client's x-request-id when usable, else a new one) in
    request.state.rid and in the response's x-request-id header. Plain ASGI: a BaseHTTPMiddleware
    would hide a client's disconnect from the route."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _RID.fullmatch(given) else uuid.uuid4().hex[:24]
        scope.setdefault("state", {})["rid"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimit:
    """413 for a request body over `limit_mb`: at once when its Content-Length says so, before any
    of it is read, else as soon as the bytes streamed in pass the limit (a chunked body). Plain
    ASGI, like RequestId."""

    def __init__(self, app, limit_mb: float):
        self.app, self.limit_mb, self.limit = app, limit_mb, int(limit_mb * 2**20)

    def error(self, what: str) -> ApiError:
        return ApiError(413, f"the request body {what}, over this server's limit of {self.limit_mb:g} MB: send a "
                             "shorter one (the limit is `specsot serve --max-body-mb`)", code="body_too_large")  # fmt: skip

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            error = self.error(f"is {int(length)} bytes")
            log.info("%s rejected 413: %s", scope.get("state", {}).get("rid", "-"), error.message)
            return await JSONResponse(error.body(), error.status)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # the route reading the body gets this error, as its 413
                raise self.error(f"passed {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


class Admission:
    """At most `limit` requests run; `queue` more wait; the next one is refused (429)."""

    def __init__(self, limit: int, queue: int, metrics: Metrics):
        self.sem, self.limit, self.queue, self.metrics = asyncio.Semaphore(limit), limit, queue, metrics
        self.waiting = 0

    async def enter(self, rid: str) -> None:
        if self.sem.locked() and self.waiting >= self.queue:
            raise ApiError(429, f"the server is busy ({self.queue} requests already wait): retry shortly",
                           code="queue_full", kind="rate_limit_error", headers={"Retry-After": "2"})  # fmt: skip
        self.waiting += 1
        self.metrics.queue.set(self.waiting)
        report = asyncio.get_running_loop().call_later(
            REPORT_S, lambda: log.info("%s waits for a place: %d requests run, %d wait", rid, self.limit, self.waiting))
        try:
            await self.sem.acquire()
        finally:
            report.cancel()
            self.waiting -= 1
            self.metrics.queue.set(self.waiting)
        self.metrics.running.inc()

    def leave(self) -> None:
        self.sem.release()
        self.metrics.running.dec()


class Budget:
    """Tokens per hour per key, over a sliding hour."""

    def __init__(self, per_hour: int | None):
        self.per_hour = per_hour
        self.spent: dict[str, deque] = {}

    def check(self, key: str) -> None:
        if self.per_hour is None:
            return
        spent = self.spent.setdefault(key, deque())
        now = time.monotonic()
        while spent and now - spent[0][0] > 3600:
            spent.popleft()
        if sum(n for _, n in spent) >= self.per_hour:
            wait = int(3600 - (now - spent[0][0])) + 1
            raise ApiError(429, f"this key used its {self.per_hour} tokens for the hour: retry in {wait} s",
                           code="budget_exceeded", kind="rate_limit_error", headers={"Retry-After": str(wait)})  # fmt: skip

    def add(self, key: str, tokens: int) -> None:
        if self.per_hour is not None and tokens:
            self.spent.setdefault(key, deque()).append((time.monotonic(), tokens))


class ServerState:
    """What the routes share (app.state.server): the settings, the gateway client (from startup to
    shutdown), admission, the budget and the metrics."""

    def __init__(self, config: ServerConfig):
        self.config, self.metrics, self.client = config, Metrics(), None
        self.ready = False  # every stage has been ready once
        self.admission = Admission(config.max_concurrency, config.max_queue, self.metrics)
        self.budget = Budget(config.budget)
        self.defaults = SamplingParams(max_tokens=config.max_tokens, repeat_stop=config.repeat_stop)  # where a body says nothing

    async def check_ready(self) -> None:
        """503 until every stage has been ready once (after that, a request that needs a stage
        which is restarting waits for it at the gateway, or fails with the gateway's message)."""
        if not self.ready:
            try:
                self.ready = (await self.client.status(timeout=2.0)).ready
            except SpecSotError:
                pass
        if not self.ready:
            raise ApiError(503, "the stages are still starting: retry shortly (GET /health says when)",
                           code="starting", kind="server_error", headers={"Retry-After": "5"})  # fmt: skip

    def authorize(self, request: Request) -> str:
        """The caller's budget key; 401 when keys are set and the request has none of them."""
        if not self.config.api_keys:
            return request.client.host if request.client else "-"
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if token not in self.config.api_keys:
            why = "no API key given" if not token else "wrong API key"
            raise ApiError(401, f"{why}: send the header 'Authorization: Bearer <key>'", code="invalid_api_key",
                           kind="authentication_error")  # fmt: skip
        return token


@asynccontextmanager
async def lifespan(app: FastAPI):
    server: ServerState = app.state.server
    server.client = Client(server.config.client_address, keys=server.config.curve)
    watcher = asyncio.create_task(_watch(server.config.watch)) if server.config.watch else None
    yield
    if watcher is not None:
        watcher.cancel()
    server.client.close()


def create_app(config: ServerConfig) -> FastAPI:
    """The app: this module's routes over one ServerState."""
    app = FastAPI(title="SpecSoT-MQ", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = ServerState(config)
    app.add_middleware(BodyLimit, limit_mb=config.max_body_mb)
    app.add_middleware(RequestId)  # outermost: a 413 carries the request id too
    app.add_exception_handler(ApiError, _api_error)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


router = APIRouter()


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


def _model(server: ServerState) -> dict:
    return {"id": server.config.model, "object": "model", "created": 0, "owned_by": "specsot"}


@router.get("/v1/models")
async def models(request: Request):
    server: ServerState = request.app.state.server
    server.authorize(request)
    return {"object": "list", "data": [_model(server)]}


@router.get("/v1/models/{model:path}")
async def one_model(request: Request, model: str):
    server: ServerState = request.app.state.server
    server.authorize(request)
    api.check_model(model, server.config.model)
    return _model(server)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await complete(request, chat=True)


@router.post("/v1/completions")
async def completions(request: Request):
    return await complete(request, chat=False)


async def complete(request: Request, chat: bool):
    """One completion: admitted (or refused with an OpenAI-shaped error), then answered whole or
    streamed as SSE."""
    server: ServerState = request.app.state.server
    route, rid = "chat" if chat else "completions", request.state.rid
    try:
        key = server.authorize(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        req = api.parse(body, chat, server.config.model, server.defaults)
        await server.check_ready()
        server.budget.check(key)
        await server.admission.enter(rid)
    except ApiError as exc:
        server.metrics.requests.labels(route, "rejected").inc()
        log.info("%s %s rejected %d: %s", rid, route, exc.status, exc.message)
        raise
    run = Run(server, req, rid, key, route)
    try:
        first = await run.next()  # a request that fails at once fails as an HTTP error
        if isinstance(first, Failed):
            raise _http_error(first)
    except BaseException as exc:
        await run.close()
        run.finish("timeout" if run.timed_out else "failed", None, exc)
        raise
    if req.stream:
        return StreamingResponse(_sse(run, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    outcome, answer = "cancelled", None
    watch = asyncio.create_task(_disconnected(request))
    try:
        msg = first
        while not isinstance(msg, (Answer, Failed)):
            step = asyncio.create_task(run.next())
            await asyncio.wait({step, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():  # the client went away: nobody reads an answer
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                return Response(status_code=499)
            msg = step.result()
        if isinstance(msg, Failed):
            outcome = "timeout" if run.timed_out else "failed"
            raise _http_error(msg)
        outcome, answer = "completed", msg
        return api.body(req, _response_id(req, rid), msg)
    finally:
        watch.cancel()
        try:
            await run.close()
        finally:
            run.finish(outcome, answer)


@router.get("/health")
async def health(request: Request):
    try:
        status = await request.app.state.server.client.status(timeout=2.0)
    except SpecSotError as exc:
        return JSONResponse({"status": "unreachable", "error": str(exc)}, 503)
    down = [s["stage"] for s in status.stages if not s.get("up")]
    if status.ready:
        return {"status": "ok", "stages": len(status.stages)}
    return JSONResponse({"status": "starting" if status.stages else "unreachable", "not_ready": down}, 503)


@router.get("/metrics")
async def prometheus(request: Request):
    server: ServerState = request.app.state.server
    try:
        server.metrics.stages.status = await server.client.status(timeout=1.0)
    except SpecSotError:
        server.metrics.stages.status = None
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/")
async def index():
    return FileResponse(STATIC / "index.html")


class Run:
    """One admitted request: its messages from the gateway, each awaited within the request's
    deadline, a log line while it runs long (REPORT_S, then at each doubling of its age), and its
    end counted once (finish)."""

    def __init__(self, server: ServerState, req: api.Request, rid: str, key: str, route: str):
        self.server, self.req, self.rid, self.key, self.route = server, req, rid, key, route
        self.started = time.monotonic()
        self.deadline = self.started + (req.timeout or server.config.timeout)
        self.first_text: float | None = None
        self.timed_out = False
        self.heard = "nothing yet"  # the last message from the pipeline
        self.messages = server.client.ask(req.question, req.params, req.sot, rid=rid, history=req.history)
        self.reporter = asyncio.create_task(self._report())

    async def next(self):
        """The next message; a Failed when the deadline passes (the request is cancelled then)."""
        try:
            msg = await asyncio.wait_for(anext(self.messages), max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.timed_out = True
            await self.close()
            return Failed(self.rid, "the request timed out: raise its \"timeout\" (seconds) or the server's --timeout", "timeout")
        if isinstance(msg, AnswerText) and self.first_text is None:
            self.first_text = time.monotonic()
        self.heard = type(msg).__name__ + (f" (points on {', '.join(msg.branches)})" if isinstance(msg, MergePlan) else "")
        return msg

    async def _report(self) -> None:
        after = REPORT_S
        while True:
            await asyncio.sleep(self.started + after - time.monotonic())
            log.info("%s %s: running %.0f s, last heard from the pipeline: %s", self.rid, self.route, after, self.heard)
            after *= 2

    async def close(self) -> None:
        """Stop reading; a request still running is cancelled in every stage (Client.ask does it
        as its generator closes). Safe in a task being cancelled (a client that went away): a
        generator still running in a cancelled wait's task closes itself when that task ends."""
        self.reporter.cancel()
        try:
            await self.messages.aclose()
        except RuntimeError:  # "asynchronous generator is already running"
            pass

    def finish(self, outcome: str, answer: Answer | None, error: BaseException | None = None) -> None:
        """Count and log how the request ended, and give its place back."""
        server, seconds = self.server, time.monotonic() - self.started
        server.admission.leave()
        server.metrics.requests.labels(self.route, outcome).inc()
        if answer is not None:
            use = api.usage(answer)
            server.metrics.answered(answer, use)
            server.metrics.latency.observe(seconds)
            server.budget.add(self.key, use["completion_tokens"])
            log.info("%s %s %s: mode %s, %d points, %d+%d tokens, %.2f s", self.rid, self.route, outcome, answer.mode,
                     len(answer.points), use["prompt_tokens"], use["completion_tokens"], seconds)  # fmt: skip
        elif error is not None:
            log.info("%s %s %s: %s", self.rid, self.route, outcome, error)
        else:
            log.info("%s %s %s after %.2f s", self.rid, self.route, outcome, seconds)


async def _watch(check: Callable[[], list[str]]) -> None:
    while True:
        for report in check():
            log.warning(report)
        await asyncio.sleep(1.0)


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _sse(run: Run, first) -> AsyncIterator[str]:
    """The stream: answer text as content, the pipeline's progress in `specsot`, the finish
    chunk with the whole `specsot` record, usage if asked, then [DONE]. A failure after the first
    chunk (a timeout, a stage down) ends it with finish reason "abort", then an `error` event
    (OpenAI's shape), then [DONE]."""
    req, rid = run.req, _response_id(run.req, run.rid)
    outcome, answer = "cancelled", None
    try:
        yield _event(api.chunk(req, rid, role=True))
        msg = first
        while True:
            if isinstance(msg, Answer):
                outcome, answer = "completed", msg
                yield _event(api.chunk(req, rid, finish=msg.finish, ext=api.how(msg)))
                if req.include_usage:
                    yield _event(api.usage_chunk(req, rid, msg))
                break
            if isinstance(msg, Failed):  # the finish reason "abort", then the error (a client raises on it)
                outcome = "timeout" if run.timed_out else "failed"
                error = _http_error(msg)
                yield _event(api.chunk(req, rid, finish="abort", ext={"error": msg.error}))
                yield _event(error.body())
                break
            if isinstance(msg, AnswerText):
                yield _event(api.chunk(req, rid, text=msg.text))
            elif (ext := api.progress(msg)) is not None:
                yield _event(api.chunk(req, rid, ext=ext))
            msg = await run.next()
        yield "data: [DONE]\n\n"
    finally:
        if run.first_text is not None:
            run.server.metrics.ttft.observe(run.first_text - run.started)
        try:
            await run.close()
        finally:
            run.finish(outcome, answer)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _response_id(req: api.Request, rid: str) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{rid}"


def _http_error(failed: Failed) -> ApiError:
    """A pipeline failure as an HTTP error, by its code (messages.FailCode): a request the model
    cannot take 400 (a prompt longer than the cache: OpenAI's code context_length_exceeded), one
    cancelled by another client with its id 499, no stage to take it 503, a timeout 504, anything
    else 500."""
    error, code = failed.error, failed.code
    if code == "too_long":
        return ApiError(400, error, code="context_length_exceeded")
    if code == "invalid":
        return ApiError(400, error, code="invalid_request")
    if code == "cancelled":
        return ApiError(499, error, code="cancelled")
    if code == "unavailable":
        return ApiError(503, error, code="unavailable", kind="server_error", headers={"Retry-After": "5"})
    if code == "timeout":
        return ApiError(504, error, code="timeout", kind="timeout_error")
    return ApiError(500, error, code="internal_error", kind="server_error")
