"""Exception handlers: every error leaves as an OpenAI-shaped body, counted in ``pdserve_errors``."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ApiError, error_body
from .state import router_state

log = logging.getLogger(__name__)


async def api_error(request: Request, exc: ApiError):
    metrics = router_state(request).metrics
    metrics.errors.labels(f"http_{exc.status}").inc()
    if exc.status in (429, 503) and exc.headers:
        metrics.rejected.labels(str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(request: Request, exc: StarletteHTTPException):
    router_state(request).metrics.errors.labels(f"http_{exc.status_code}").inc()
    message = exc.detail if isinstance(exc.detail, str) else "invalid request"
    if exc.status_code == 400 and "parsing the body" in message:
        message = "request body is not valid JSON (UTF-8)"
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def invalid_request(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    detail = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    message = f"{'.'.join(loc) + ': ' if loc else ''}{detail}"
    log.info("400 for %s: %s", request.url.path, message)
    router_state(request).metrics.errors.labels("http_400").inc()
    return JSONResponse(error_body(400, message, param=".".join(loc) or None), status_code=400)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
