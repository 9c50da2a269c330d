"""FastAPI application: the OpenAI-compatible endpoints, health and metrics."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

import zmq.asyncio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .admission import Admission
from .config import RouterConfig
from .errors import ApiError, error_body
from .limits import BodyLimit
from .metrics import Metrics
from .policy import make_policy
from .responses import SSE_DONE, Shaper, sse, usage
from .schemas import ChatRequest, CompletionRequest
from .service import Delta, Finished, Service, StreamError, new_rid
from .workers import WorkerClient, WorkerGroup

log = logging.getLogger(__name__)


def _groups(cfg: RouterConfig, inboxes: dict, token: bytes | None) -> dict:
    groups = {}
    for role in ("prefill", "decode", "colocated"):
        clients = [WorkerClient(a, role, inboxes, cfg.heartbeat_s, cfg.dead_after_s, token) for a in getattr(cfg, role)]
        groups[role] = WorkerGroup(role, clients, make_policy(cfg.policy))
    return groups


def create_app(cfg: RouterConfig, token: bytes | None = None, api_key: str | None = None) -> FastAPI:
    """``token``: the cluster token for worker connections; ``api_key``: required as ``Authorization: Bearer``."""
    metrics = Metrics()
    inboxes: dict = {}
    groups = _groups(cfg, inboxes, token)
    admission = Admission(cfg.max_queue, cfg.queue_timeout_s)
    service = Service(groups, metrics, admission, cfg.first_timeout_s, cfg.token_timeout_s)
    service.inboxes = inboxes
    mode = "colocated" if cfg.colocated else "disaggregated"

    @asynccontextmanager
    async def lifespan(app):
        ctx = zmq.asyncio.Context()
        for group in groups.values():
            for client in group.clients:
                client.start(ctx)

        async def admit_periodically():
            while True:
                await asyncio.sleep(0.2)
                admission.wake()
                metrics.queue.set(admission.queued)

        waker = asyncio.create_task(admit_periodically())
        yield
        waker.cancel()
        for group in groups.values():
            for client in group.clients:
                client.close()
        ctx.term()

    def check_key(request: Request):
        if api_key is None or request.url.path in ("/health", "/metrics"):
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    app = FastAPI(title="pdserve router", lifespan=lifespan, dependencies=[Depends(check_key)])
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.state.service, app.state.metrics = service, metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        metrics.errors.labels(f"http_{exc.status}").inc()
        if exc.status in (429, 503) and exc.headers:
            metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        metrics.errors.labels(f"http_{exc.status_code}").inc()
        message = exc.detail if isinstance(exc.detail, str) else "invalid request"
        if exc.status_code == 400 and "parsing the body" in message:
            message = "request body is not valid JSON (UTF-8)"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
        metrics.errors.labels("http_400").inc()
        return JSONResponse(error_body(400, message, param=".".join(loc) or None), status_code=400)

    async def serve(endpoint: str, kind: str, req, payload: dict):
        service.check_model(req.model)
        rid = new_rid()
        shaper = Shaper(kind, rid, req.model)
        events = service.generate(payload, rid)
        metrics.in_flight.inc()
        t0 = time.perf_counter()
        try:
            first = await events.__anext__()
        except StreamError as e:
            metrics.in_flight.dec()
            metrics.requests.labels(endpoint, "error").inc()
            raise ApiError(e.status, e.message, headers=retry_header(e)) from None
        except BaseException:
            metrics.in_flight.dec()
            raise
        metrics.ttft.labels(mode).observe(time.perf_counter() - t0)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(endpoint, shaper, first, events, include_usage, t0, req.return_token_ids),
                                     media_type="text/event-stream")
        return await collect(endpoint, shaper, first, events, t0, req.return_token_ids)

    async def collect(endpoint, shaper, first, events, t0, with_ids):
        parts, ids, result = [first.text], list(first.ids), None
        try:
            async for ev in events:
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    ids.extend(ev.ids)
                else:
                    result = ev
        except StreamError as e:
            metrics.requests.labels(endpoint, "error").inc()
            raise ApiError(e.status, e.message, headers=retry_header(e)) from None
        finally:
            metrics.in_flight.dec()
        finish(endpoint, result, t0)
        body = shaper.full("".join(parts), result.finish_reason, usage(result.prompt_tokens, result.completion_tokens),
                           result.timing, ids if with_ids else None)
        return JSONResponse(body)

    async def stream(endpoint, shaper, first, events, include_usage, t0, with_ids):
        last = time.perf_counter()
        try:
            if shaper.chat:
                yield sse(shaper.chunk(None, role=True))
            if first.text or with_ids:
                yield sse(shaper.chunk(first.text, ids=first.ids if with_ids else None))
            async for ev in events:
                if isinstance(ev, Delta):
                    now = time.perf_counter()
                    metrics.itl.labels(mode).observe(now - last)
                    last = now
                    if ev.text or with_ids:
                        yield sse(shaper.chunk(ev.text, ids=ev.ids if with_ids else None))
                else:
                    finish(endpoint, ev, t0)
                    final = shaper.chunk(None, finish_reason=ev.finish_reason)
                    final["pdserve"] = ev.timing
                    yield sse(final)
                    if include_usage:
                        yield sse(shaper.usage_chunk(usage(ev.prompt_tokens, ev.completion_tokens), ev.timing))
            yield SSE_DONE
        except StreamError as e:
            metrics.requests.labels(endpoint, "error").inc()
            metrics.errors.labels(f"stream_{e.status}").inc()
            yield sse(error_body(e.status, e.message))
            yield SSE_DONE
        finally:
            metrics.in_flight.dec()
            await events.aclose()

    def finish(endpoint, result: Finished, t0):
        metrics.e2e.labels(mode).observe(time.perf_counter() - t0)
        metrics.tokens.inc(result.completion_tokens)
        metrics.requests.labels(endpoint, "ok").inc()

    async def until_disconnected(request: Request, work):
        """Run ``work``; if the client goes away first, cancel it (which aborts the request on its workers)."""
        task = asyncio.ensure_future(work)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        metrics.errors.labels("client_disconnected").inc()
        return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await until_disconnected(request, serve("completions", "completion", req,
                                                       {"prompt": req.prompt, "params": req.params(16)}))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            messages = req.plain_messages()
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await until_disconnected(request, serve("chat", "chat", req,
                                                       {"messages": messages, "params": req.params(None)}))

    @app.get("/v1/models")
    async def models():
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdserve"} for m in sorted(service.models())]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        workers = {role: [{"address": c.address, "healthy": c.healthy, "outstanding": c.outstanding, **c.info}
                          for c in g.clients] for role, g in groups.items() if g.clients}
        metrics.observe_workers(groups)
        ok = service.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable", "mode": mode, "workers": workers,
                             "admission": {"queued": admission.queued, "in_flight": len(service.inboxes)}},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        metrics.observe_workers(groups)
        metrics.queue.set(admission.queued)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def retry_header(e: StreamError) -> dict | None:
    return {"Retry-After": str(int(e.retry_after))} if e.retry_after else None
