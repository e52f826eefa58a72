"""One engine request seen from asyncio: outputs arrive on a queue, stop() aborts it from any task."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from ..engine.sequence import RequestOutput

log = logging.getLogger(__name__)


class Generation:
    def __init__(self, llm):
        self.llm = llm
        self.request_id: int | None = None
        self.stopped = False
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.final: RequestOutput | None = None

    async def start(self, prompt, adapter: str | None, params: dict) -> None:
        """Tokenize and queue the request (off the event loop: a long history takes a while to template)."""
        self._loop = asyncio.get_running_loop()
        if self.stopped:
            return
        self.request_id = await asyncio.to_thread(self.llm.submit, prompt, self._on_output, adapter, None, **params)
        if self.stopped:  # stop() came while the request was being queued
            self.llm.abort(self.request_id)

    def _on_output(self, out: RequestOutput) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the event loop is gone (shutdown); nobody is listening
            pass

    def stop(self) -> None:
        self.stopped = True
        if self.request_id is not None:
            self.llm.abort(self.request_id)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output until the finished one; abandoning the iteration aborts the request."""
        if self.request_id is None:  # stopped before it was queued
            return
        try:
            while True:
                out = await self._queue.get()
                yield out
                if out.finished:
                    self.final = out
                    return
        finally:
            if self.final is None:
                self.stop()
