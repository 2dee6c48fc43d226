"""Awaiting calls with a time limit, for the triggers' store reads and the shared poller's describes.

A call past its limit counts as failed (``TimeoutError``), but its thread cannot be stopped: until it
returns, the next call of the same kind fails at once instead of starting another beside it, so a hung store
or endpoint pins at most one thread of the loop's shared executor per kind and caller.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class BoundedCalls:
    """One caller's bounded calls, by kind (``"store"``, ``"describe"``, ...)."""

    def __init__(self) -> None:
        #: kind -> a call past its limit that has not returned, and when it began (monotonic)
        self._hung: dict[str, tuple[asyncio.Future, float]] = {}

    async def call(self, kind: str, start: Callable[[], Awaitable[Any]], timeout: float) -> Any:
        """``await start()``, at most ``timeout`` seconds; cancelling the caller cancels the call."""
        hung = self._hung.get(kind)
        if hung is not None:
            if not hung[0].done():
                raise TimeoutError(f"an earlier {kind} call has not returned for {time.monotonic() - hung[1]:.0f}s")
            del self._hung[kind]
        task = asyncio.ensure_future(start())
        # retrieved here, so one that fails after it was given up on logs nothing
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        started = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            self._hung[kind] = (task, started)
            raise TimeoutError(f"a {kind} call took over {timeout:.1f}s") from None
        except asyncio.CancelledError:
            task.cancel()
            raise
