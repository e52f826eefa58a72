"""Run the app on a real uvicorn server in a background thread: for tests and for embedding in a program."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(app) as server:` serves on server.url (http://127.0.0.1:<free port>) until the block ends."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, ws_max_size: int = 16 << 20):
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", ws_max_size=ws_max_size,
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dark-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/ws"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class WsSession:
    """A websocket client that sorts frames by request id: `await s.request({...})` returns the frames of one
    request up to its last (done, error, a final job state, or the one answer of a simple request). Several
    tasks may wait on one session at once."""

    LAST = {"done", "error", "adapters", "conversations", "history", "ack", "pong", "mcp_servers"}
    LAST_JOB = {"done", "failed", "cancelled"}

    def __init__(self, ws):
        import asyncio

        self.ws = ws
        self.buffer: list[dict] = []
        self.raw: list[str] = []          # every frame received, as sent (to check what never appears in one)
        self.hello: dict | None = None
        self.closed: BaseException | None = None
        self._n = 0
        self._arrived = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        import json

        try:
            async for raw in self.ws:
                self.raw.append(raw if isinstance(raw, str) else raw.decode())
                async with self._arrived:
                    self.buffer.append(json.loads(raw))
                    self._arrived.notify_all()
        except Exception as e:  # closed: waiters see it
            self.closed = e
        finally:
            self.closed = self.closed or ConnectionError("the websocket closed")
            async with self._arrived:
                self._arrived.notify_all()

    @classmethod
    async def open(cls, url: str, **connect_args) -> "WsSession":
        from websockets.asyncio.client import connect

        session = cls(await connect(url, max_size=None, **connect_args))
        session.hello = await session.next(lambda f: f["type"] == "hello")
        return session

    async def close(self) -> None:
        await self.ws.close()
        await self._reader

    async def __aenter__(self) -> "WsSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def new_id(self) -> str:
        self._n += 1
        return f"t{self._n}"

    async def send(self, message: dict | str | bytes) -> None:
        import json

        await self.ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))

    async def next(self, match=lambda f: True, timeout: float = 120.0) -> dict:
        """The first frame (buffered or new) that matches; others stay buffered."""
        import asyncio

        def pick():
            for i, frame in enumerate(self.buffer):
                if match(frame):
                    return self.buffer.pop(i)
            if self.closed is not None:
                raise ConnectionError(f"the websocket closed while waiting: {self.closed}")
            return None

        async with self._arrived:
            return await asyncio.wait_for(self._arrived.wait_for(pick), timeout)

    def is_last(self, frame: dict) -> bool:
        if frame["type"] == "job":
            return frame["state"] in self.LAST_JOB
        return frame["type"] in self.LAST

    async def frames(self, request_id, timeout: float = 120.0) -> list[dict]:
        """Every frame of one request, through its last."""
        out = []
        while True:
            frame = await self.next(lambda f: f.get("id") == request_id, timeout)
            out.append(frame)
            if self.is_last(frame):
                return out

    async def until(self, request_id, match, timeout: float = 120.0) -> list[dict]:
        """The frames of one request up to and including the first that matches (an agent run's events do not
        end with a fixed frame: wait for the one the test needs, e.g. an agent_state)."""
        out = []
        while True:
            frame = await self.next(lambda f: f.get("id") == request_id, timeout)
            out.append(frame)
            if match(frame):
                return out
            if frame["type"] == "error":
                raise AssertionError(f"request {request_id} failed: {frame}")

    async def request(self, message: dict, timeout: float = 120.0) -> list[dict]:
        message = {"id": self.new_id(), **message}
        await self.send(message)
        return await self.frames(message["id"], timeout)
