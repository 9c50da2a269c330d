"""The events of a request's choices, merged in arrival order for one SSE response.

With one choice (the usual request) its stream is read directly: no task or queue between the worker's tokens
and the response. With ``n`` > 1 each choice's stream is pumped by a task into one queue. Either way a failure
comes out as ``StreamError`` (an unexpected one as a 500)."""
from __future__ import annotations

import asyncio
import logging

from .service import StreamError

log = logging.getLogger(__name__)


async def merged(choices, streams):
    """``(choice, event)`` pairs until every stream ends."""
    if len(streams) == 1:
        try:
            async for ev in streams[0]:
                yield choices[0], ev
        except StreamError:
            raise
        except Exception as e:
            log.exception("stream of choice 0 failed")
            raise StreamError(500, f"internal error: {e}") from e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice, events):
        try:
            async for ev in events:
                queue.put_nowait((choice, ev))
        except StreamError as e:
            queue.put_nowait((choice, e))
        except Exception as e:
            log.exception("stream of choice %d failed", choice.index)
            queue.put_nowait((choice, StreamError(500, f"internal error: {e}")))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.ensure_future(pump(c, s)) for c, s in zip(choices, streams)]
    try:
        remaining = len(tasks)
        while remaining:
            choice, ev = await queue.get()
            if ev is None:
                remaining -= 1
            elif isinstance(ev, StreamError):
                raise ev
            else:
                yield choice, ev
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
