"""A response's owner: ``Reply`` holds the state of one request's answer (its choices, the tool calls held back
until they parse, usage, finish) from the service's streams to the JSON body or the SSE events.

A request fans out into one stream per choice (``n`` x prompts), each a ``Service.generate``. Their first events
are awaited together, so an error before any token (no worker, bad input, queue full) answers a plain HTTP error;
after that the response is either collected whole (JSON) or streamed as SSE, an error mid-stream ending it with an
error event and ``[DONE]``. ``choice`` keeps each choice's state, ``shaper`` writes the OpenAI objects."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import ApiError, error_body
from ..events import Delta
from ..service import StreamError, new_rid
from ..streams import merged
from ..tools.parse import Release, parse_auto, parse_forced
from .choice import Choice, absorb, usage_of
from .shaper import SSE_DONE, Shaper, sse

if TYPE_CHECKING:
    from ..routes.state import RouterState


def retry_header(e: StreamError) -> dict | None:
    return {"Retry-After": str(int(e.retry_after))} if e.retry_after else None


class Reply:
    """One request's response: its choices' streams, shaped as JSON or SSE."""

    def __init__(self, st: RouterState, endpoint: str, kind: str, req, logprobs: bool):
        self.st, self.metrics, self.endpoint, self.req = st, st.metrics, endpoint, req
        self.rid = new_rid()
        self.shaper = Shaper(kind, self.rid, req.model, logprobs)
        self.with_ids = req.return_token_ids
        self.tools = getattr(req, "tool_mode", "none")  # with tools the text is read for calls before it goes out
        self.releases: dict[int, Release] = {}  # auto, streamed: text goes out unless it may be a call
        self.choices, self.streams, self.firsts, self.t0, self.t1 = [], [], [], 0.0, 0.0  # start, first tokens

    async def serve(self, payloads: list[dict]):
        self.st.service.check_model(self.req.model)
        rid, per_prompt = self.rid, self.req.choices_per_prompt
        self.choices = [Choice(i, prompt_index=i // per_prompt) for i in range(len(payloads))]
        rids = [rid] if len(payloads) == 1 else [f"{rid}.{i}" for i in range(len(payloads))]
        self.streams = [self.st.service.generate(p, r) for p, r in zip(payloads, rids)]
        if self.st.traffic is not None:  # --roles-profile: the plan reads the requests' lengths
            self.streams = [self.st.traffic.watch(s) for s in self.streams]
        self.metrics.in_flight.inc()
        self.t0 = time.perf_counter()
        await self._firsts()
        self.t1 = time.perf_counter()
        self.metrics.ttft.labels(self.st.mode).observe(self.t1 - self.t0)
        if self.req.stream:
            opts = self.req.stream_options
            include_usage = bool(opts and opts.include_usage)
            self.shaper.running_usage = bool(include_usage and opts.continuous_usage_stats)
            return StreamingResponse(self._stream(include_usage), media_type="text/event-stream")
        return await self._collect()

    async def _firsts(self) -> None:
        """Every choice's first event; the first failure among them becomes the HTTP error."""
        try:
            self.firsts = await asyncio.gather(*(s.__anext__() for s in self.streams), return_exceptions=True)
            failure = next((f for f in self.firsts if isinstance(f, BaseException)), None)
            if failure is not None:
                raise failure
        except BaseException as e:
            self.metrics.in_flight.dec()
            await self._close()
            if isinstance(e, StreamError):
                self.metrics.requests.labels(self.endpoint, "error").inc()
                raise ApiError(e.status, e.message, headers=retry_header(e)) from None
            raise

    async def _close(self) -> None:
        for s in self.streams:
            await s.aclose()

    async def _collect(self):
        async def one(choice, first, events):
            absorb(choice, first)
            async for ev in events:
                absorb(choice, ev)

        try:
            await asyncio.gather(*(one(c, f, s) for c, f, s in zip(self.choices, self.firsts, self.streams)))
        except StreamError as e:
            self.metrics.requests.labels(self.endpoint, "error").inc()
            raise ApiError(e.status, e.message, headers=retry_header(e)) from None
        finally:
            self.metrics.in_flight.dec()
            await self._close()
        try:
            for c in self.choices:
                self._calls(c)
                self._finished(c)
        except StreamError as e:
            self.metrics.requests.labels(self.endpoint, "error").inc()
            raise ApiError(e.status, e.message) from None
        return JSONResponse(self.shaper.full(self.choices, usage_of(self.choices), self.with_ids))

    def _calls(self, choice: Choice) -> None:
        """Read the choice's text for tool calls (a request with tools)."""
        if self.tools == "none":
            return
        text, names = "".join(choice.text), self.req.tool_names
        if self.tools == "forced":
            choice.tool_calls, choice.content = parse_forced(text, names), None
            if not choice.tool_calls and choice.finish_reason != "length":  # never a required call as content
                raise StreamError(500, "the required tool call did not come out as a call of the given tools")
        else:
            choice.content, choice.tool_calls = parse_auto(text, names)
        if choice.tool_calls:
            choice.finish_reason = "tool_calls"

    def _piece(self, choice, ev) -> str | None:
        """The SSE event for ``ev`` (None when it adds nothing the client asked for)."""
        shaper = self.shaper
        text, entries = absorb(choice, ev)
        if self.tools != "none":  # held while it may be a call (all of it when forced, or with ids or logprobs)
            if self.tools != "auto" or self.with_ids or shaper.with_logprobs:
                return None
            text = self.releases.setdefault(choice.index, Release()).add(text)
            return shaper.text_event(choice, text) if text else None
        if not (text or self.with_ids or (shaper.with_logprobs and entries)):
            return None
        if not (self.with_ids or shaper.with_logprobs or shaper.running_usage):
            return shaper.text_event(choice, text)
        out = shaper.chunk(choice, text, ids=ev.ids if self.with_ids else None,
                           logprobs=entries if shaper.with_logprobs else None)
        if shaper.running_usage:
            out["usage"] = usage_of(self.choices)
        return sse(out)

    async def _stream(self, include_usage: bool):
        events = merged(self.choices, self.streams)
        try:
            for choice, first in zip(self.choices, self.firsts):
                if self.shaper.chat:
                    yield sse(self.shaper.chunk(choice, None, role=True))
                if (out := self._piece(choice, first)) is not None:
                    yield out
            async for out in self._events(events):
                yield out
            if include_usage:
                yield sse(self.shaper.usage_chunk(usage_of(self.choices), self.choices[0].timing))
            yield SSE_DONE
        except StreamError as e:
            self.metrics.requests.labels(self.endpoint, "error").inc()
            self.metrics.errors.labels(f"stream_{e.status}").inc()
            yield sse(error_body(e.status, e.message))
            yield SSE_DONE
        finally:
            self.metrics.in_flight.dec()
            await events.aclose()
            await self._close()

    async def _events(self, events):
        """SSE events of every choice after the first, each choice's last with its ``pdserve`` timing."""
        last, itl = time.perf_counter(), self.metrics.itl.labels(self.st.mode)
        async for choice, ev in events:
            if isinstance(ev, Delta):
                now = time.perf_counter()
                itl.observe(now - last)
                last = now
                if (out := self._piece(choice, ev)) is not None:
                    yield out
            else:
                absorb(choice, ev)
                for out in self._held(choice):
                    yield out
                self._finished(choice)
                final = self.shaper.chunk(choice, None, finish_reason=choice.finish_reason)
                final["pdserve"] = choice.timing
                yield sse(final)

    def _held(self, choice: Choice) -> list[bytes]:
        """A request with tools: its calls as tool-call deltas, or its text in one delta."""
        if self.tools == "none":
            return []
        release = self.releases.get(choice.index)
        if release is None:
            self._calls(choice)
            text = choice.content if choice.content is not None else "".join(choice.text)
        else:  # what went out already is content; the rest is read for calls
            text, choice.tool_calls = parse_auto(release.held, self.req.tool_names)
            if choice.tool_calls:
                choice.finish_reason = "tool_calls"
        out = [sse(self.shaper.chunk(choice, text))] if text else []
        if choice.tool_calls:
            out += [sse(c) for c in self.shaper.tool_call_chunks(choice)]
        return out

    def _finished(self, choice: Choice) -> None:
        now = time.perf_counter()
        self.metrics.e2e.labels(self.st.mode).observe(now - self.t0)
        if choice.completion_tokens > 1:
            self.metrics.tpot.labels(self.st.mode).observe((now - self.t1) / (choice.completion_tokens - 1))
        self.metrics.tokens.inc(choice.completion_tokens)
        self.metrics.requests.labels(self.endpoint, "ok").inc()
