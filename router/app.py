"""FastAPI application: the OpenAI-compatible endpoints, health and metrics."""
from __future__ import annotations

import asyncio
import hmac
import json
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
from .disagg import DisaggPolicy
from .errors import ApiError, error_body
from .limits import BodyLimit
from .metrics import Metrics
from .policy import make_policy
from .responses import SSE_DONE, Choice, Shaper, sse, usage_of
from .schemas import ChatRequest, CompletionRequest
from .service import Delta, Finished, Service, StreamError, new_rid
from .streams import merged
from .workers import WorkerClient, WorkerGroup

log = logging.getLogger(__name__)


def _client(cfg: RouterConfig, role: str, address: str, inboxes: dict, token: bytes | None) -> WorkerClient:
    return WorkerClient(address, role, inboxes, cfg.heartbeat_s, cfg.dead_after_s, token, cfg.stale_after_s)


def _groups(cfg: RouterConfig, inboxes: dict, token: bytes | None) -> dict:
    groups = {}
    for role in ("prefill", "decode", "colocated"):
        clients = [_client(cfg, role, a, inboxes, token) for a in getattr(cfg, role)]
        groups[role] = WorkerGroup(role, clients, make_policy(cfg.policy, cfg.kv_weight))
    return groups


class Membership:
    """Workers from ``workers_file`` (a deployment keeps it current): new addresses are connected, vanished ones
    closed (their requests fail over as when a worker dies)."""

    def __init__(self, cfg: RouterConfig, groups: dict, inboxes: dict, token: bytes | None):
        self.cfg, self.groups, self.inboxes, self.token = cfg, groups, inboxes, token
        self._seen = None

    def read(self) -> dict | None:
        try:
            with open(self.cfg.workers_file) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        return {role: [a for a in data.get(role) or [] if isinstance(a, str) and a.startswith("tcp://")]
                for role in ("prefill", "decode", "colocated")}

    def apply(self, ctx, wanted: dict) -> None:
        for role, addrs in wanted.items():
            group = self.groups[role]
            for client in [c for c in group.clients if c.address not in addrs]:
                log.info("%s worker %s left the deployment", role, client.address)
                client.fail_owned(f"{role} worker {client.address} left the deployment")
                client.close()
                group.clients.remove(client)
            known = {c.address for c in group.clients}
            for addr in addrs:
                if addr not in known:
                    log.info("%s worker %s joined the deployment", role, addr)
                    client = _client(self.cfg, role, addr, self.inboxes, self.token)
                    client.start(ctx)
                    group.clients.append(client)

    async def watch(self, ctx) -> None:
        while True:
            wanted = self.read()
            if wanted is not None and wanted != self._seen:
                self.apply(ctx, wanted)
                self._seen = wanted
            await asyncio.sleep(1.0)


def create_app(cfg: RouterConfig, token: bytes | None = None, api_key: str | None = None) -> FastAPI:
    """``token``: the cluster token for worker connections; ``api_key``: required as ``Authorization: Bearer``."""
    metrics = Metrics()
    inboxes: dict = {}
    groups = _groups(cfg, inboxes, token)
    admission = Admission(cfg.max_queue, cfg.queue_timeout_s)
    service = Service(groups, metrics, admission, cfg.first_timeout_s, cfg.token_timeout_s,
                      kv_aware=cfg.policy == "kv_aware", tokenizer=cfg.tokenizer or None, retries=cfg.retries,
                      retry_wait_s=cfg.retry_wait_s,
                      disagg=DisaggPolicy(cfg.disagg, cfg.disagg_local_tokens, cfg.disagg_prefill_queue))
    service.inboxes = inboxes

    def mode() -> str:
        return "colocated" if service.colocated else "disaggregated"
    membership = Membership(cfg, groups, inboxes, token)

    @asynccontextmanager
    async def lifespan(app):
        ctx = zmq.asyncio.Context()
        for group in groups.values():
            for client in group.clients:
                client.start(ctx)
        watcher = asyncio.create_task(membership.watch(ctx)) if cfg.workers_file else None

        async def admit_periodically():
            while True:
                await asyncio.sleep(0.2)
                admission.wake()
                metrics.queue.set(admission.queued)
                service.expire_waits()

        waker = asyncio.create_task(admit_periodically())
        yield
        waker.cancel()
        if watcher is not None:
            watcher.cancel()
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
        detail = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        message = f"{'.'.join(loc) + ': ' if loc else ''}{detail}"
        log.info("400 for %s: %s", request.url.path, message)
        metrics.errors.labels("http_400").inc()
        return JSONResponse(error_body(400, message, param=".".join(loc) or None), status_code=400)

    async def serve(endpoint: str, kind: str, req, payloads: list[dict], logprobs: bool):
        service.check_model(req.model)
        rid = new_rid()
        shaper = Shaper(kind, rid, req.model, logprobs)
        per_prompt = req.choices_per_prompt
        choices = [Choice(i, prompt_index=i // per_prompt) for i in range(len(payloads))]
        rids = [rid] if len(payloads) == 1 else [f"{rid}.{i}" for i in range(len(payloads))]
        streams = [service.generate(p, r) for p, r in zip(payloads, rids)]
        metrics.in_flight.inc()
        t0 = time.perf_counter()
        try:
            firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
            failure = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failure is not None:
                raise failure
        except BaseException as e:
            metrics.in_flight.dec()
            for s in streams:
                await s.aclose()
            if isinstance(e, StreamError):
                metrics.requests.labels(endpoint, "error").inc()
                raise ApiError(e.status, e.message, headers=retry_header(e)) from None
            raise
        metrics.ttft.labels(mode()).observe(time.perf_counter() - t0)
        if req.stream:
            opts = req.stream_options
            include_usage = bool(opts and opts.include_usage)
            shaper.running_usage = bool(include_usage and opts.continuous_usage_stats)
            return StreamingResponse(stream(endpoint, shaper, choices, firsts, streams, include_usage, t0,
                                            req.return_token_ids), media_type="text/event-stream")
        return await collect(endpoint, shaper, choices, firsts, streams, t0, req.return_token_ids)

    def absorb(choice: Choice, ev) -> tuple[str, list]:
        """Record an event on its choice; returns the text and logprob entries it adds."""
        if isinstance(ev, Finished):
            choice.finish_reason, choice.timing = ev.finish_reason, ev.timing
            choice.prompt_tokens, choice.completion_tokens = ev.prompt_tokens, ev.completion_tokens
            return "", []
        if ev.prompt_tokens is not None:
            choice.prompt_tokens = ev.prompt_tokens
        choice.completion_tokens += len(ev.ids)
        text, entries = ev.text, list(ev.logprobs or [])
        if ev.prompt_text is not None:
            text, entries = ev.prompt_text + text, list(ev.prompt_logprobs or []) + entries
        choice.text.append(text)
        choice.ids.extend(ev.ids)
        choice.logprobs.extend(entries)
        return text, entries

    async def collect(endpoint, shaper, choices, firsts, streams, t0, with_ids):
        async def one(choice, first, events):
            absorb(choice, first)
            async for ev in events:
                absorb(choice, ev)

        try:
            await asyncio.gather(*(one(c, f, s) for c, f, s in zip(choices, firsts, streams)))
        except StreamError as e:
            metrics.requests.labels(endpoint, "error").inc()
            raise ApiError(e.status, e.message, headers=retry_header(e)) from None
        finally:
            metrics.in_flight.dec()
            for s in streams:
                await s.aclose()
        for c in choices:
            finish(endpoint, c, t0)
        return JSONResponse(shaper.full(choices, usage_of(choices), with_ids))

    async def stream(endpoint, shaper, choices, firsts, streams, include_usage, t0, with_ids):
        def piece(choice, ev):
            text, entries = absorb(choice, ev)
            if not (text or with_ids or (shaper.with_logprobs and entries)):
                return None
            if not (with_ids or shaper.with_logprobs or shaper.running_usage):
                return shaper.text_event(choice, text)
            out = shaper.chunk(choice, text, ids=ev.ids if with_ids else None,
                               logprobs=entries if shaper.with_logprobs else None)
            if shaper.running_usage:
                out["usage"] = usage_of(choices)
            return sse(out)

        last, events, itl = time.perf_counter(), merged(choices, streams), metrics.itl.labels(mode())
        try:
            for choice, first in zip(choices, firsts):
                if shaper.chat:
                    yield sse(shaper.chunk(choice, None, role=True))
                if (out := piece(choice, first)) is not None:
                    yield out
            async for choice, ev in events:
                if isinstance(ev, Delta):
                    now = time.perf_counter()
                    itl.observe(now - last)
                    last = now
                    if (out := piece(choice, ev)) is not None:
                        yield out
                else:
                    absorb(choice, ev)
                    finish(endpoint, choice, t0)
                    final = shaper.chunk(choice, None, finish_reason=choice.finish_reason)
                    final["pdserve"] = choice.timing
                    yield sse(final)
            if include_usage:
                yield sse(shaper.usage_chunk(usage_of(choices), choices[0].timing))
            yield SSE_DONE
        except StreamError as e:
            metrics.requests.labels(endpoint, "error").inc()
            metrics.errors.labels(f"stream_{e.status}").inc()
            yield sse(error_body(e.status, e.message))
            yield SSE_DONE
        finally:
            metrics.in_flight.dec()
            await events.aclose()
            for s in streams:
                await s.aclose()

    def finish(endpoint, choice: Choice, t0):
        metrics.e2e.labels(mode()).observe(time.perf_counter() - t0)
        metrics.tokens.inc(choice.completion_tokens)
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
        try:
            payloads = req.fanout()
        except ValueError as e:
            raise ApiError(400, str(e), param="n") from None
        return await until_disconnected(request, serve("completions", "completion", req, payloads,
                                                       req.logprobs is not None))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            payloads = req.fanout()
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await until_disconnected(request, serve("chat", "chat", req, payloads, req.logprobs))

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
        problems = service.mismatches()
        return JSONResponse({"status": "ok" if ok else "unavailable", "mode": mode(), "workers": workers,
                             **({"problems": problems} if problems else {}),
                             "admission": {"queued": admission.queued, "in_flight": len(service.inboxes),
                                           "reserved": len(admission.reserved)}},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        metrics.observe_workers(groups)
        metrics.queue.set(admission.queued)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def retry_header(e: StreamError) -> dict | None:
    return {"Retry-After": str(int(e.retry_after))} if e.retry_after else None
