"""``/v1/completions`` and ``/v1/chat/completions``: parse, hand the request to a ``router.reply.Reply``, return
its response. A client that disconnects cancels its request, which aborts it on its workers."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..errors import ApiError
from ..reply import Reply
from ..schemas import ChatRequest, CompletionRequest
from .state import RouterState, router_state

routes = APIRouter()


@routes.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, st: RouterState = Depends(router_state)):
    try:
        payloads = req.fanout()
    except ValueError as e:
        raise ApiError(400, str(e), param="n") from None
    reply = Reply(st, "completions", "completion", req, req.logprobs is not None)
    return await until_disconnected(st, request, reply.serve(payloads))


@routes.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request, st: RouterState = Depends(router_state)):
    try:
        payloads = req.fanout()
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    reply = Reply(st, "chat", "chat", req, req.logprobs)
    return await until_disconnected(st, request, reply.serve(payloads))


async def until_disconnected(st: RouterState, request: Request, work):
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
    st.metrics.errors.labels("client_disconnected").inc()
    return Response(status_code=499)
