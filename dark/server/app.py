"""The FastAPI app factory: create_app(llm, settings) wires the routes, the websocket and the UI around one
OnlineLLM that the caller built (and closes)."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..agent.mcp_client import MCPServerError
from ..errors import DarkError, InvalidRequestError, UnknownAdapterError
from ..store.db import Store
from . import openai_api, rest, ws
from .learning import JobHub, Learning, LearningUnavailable
from .metrics import Metrics
from .middleware import BodyLimit, SecurityHeaders
from .openai_api import OpenAIError, openai_error_response
from .settings import ServerSettings
from .state import AppState

log = logging.getLogger(__name__)


def _open_store(llm, settings: ServerSettings) -> tuple[Store, bool]:
    """The LLM's own store when it has one; else the data directory's, owned (and closed) by the app."""
    store = getattr(llm, "store", None)
    if store is not None:
        return store, False
    path = settings.resolved_data_dir() / "dark.db"
    log.info("conversations are stored in %s", path)
    return Store(path), True


def mcp_config_path(llm, settings: ServerSettings) -> Path:
    """Where the agent's MCP servers are configured: the setting, else mcp.json in the data directory (the
    LLM's own when it has one, so a test's temporary data directory keeps its servers to itself)."""
    if settings.mcp_config is not None:
        return Path(settings.mcp_config).expanduser()
    data_dir = getattr(llm, "data_dir", None)
    return Path(data_dir if data_dir is not None else settings.resolved_data_dir()) / "mcp.json"


def _open_agent(llm, settings: ServerSettings, on_server_event):
    """The app's AgentService; a config file that cannot be read leaves the agent with no servers (and says
    why) rather than keeping the server from starting."""
    from ..agent import AgentService

    path = mcp_config_path(llm, settings)
    try:
        return AgentService(llm, path, on_server_event=on_server_event)
    except DarkError as e:
        log.error("MCP servers not started: %s. The agent starts with none, and servers added now are not "
                  "saved; fix %s and restart.", e, path)
        return AgentService(llm, None, on_server_event=on_server_event)


def create_app(llm, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    store, owns_store = _open_store(llm, settings)
    metrics = Metrics()
    hub = JobHub(metrics)
    state = AppState(llm=llm, store=store, settings=settings, metrics=metrics, hub=hub,
                     learning=Learning(llm, store, hub), owns_store=owns_store)

    def published(adapter: str) -> None:  # a learner's thread: hop onto the loop
        if state.loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(ws.broadcast_adapters(state), state.loop)
            except RuntimeError:  # the loop has closed: nobody to tell
                pass
    hub.on_published = published

    def mcp_event(event: dict) -> None:  # the MCP manager's thread: every socket hears of a server's status
        loop = state.loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(ws.broadcast_frame, state, event)
        except RuntimeError:  # the loop has closed
            pass

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        if settings.key is None and settings.binds_beyond_loopback:
            log.warning("\n%s\n  dark is listening on %s WITHOUT an API key: anyone who can reach this port can\n"
                        "  chat, read every conversation and retrain its adapters. Set DARK_API_KEY (or\n"
                        "  --api-key) or bind to 127.0.0.1.\n%s", "!" * 78, settings.host, "!" * 78)
        state.agent = await asyncio.to_thread(_open_agent, llm, settings, mcp_event)
        try:
            yield
        finally:
            for conn in list(state.connections):
                conn.outbox.put_nowait(None)
            agent, state.agent = state.agent, None
            await asyncio.to_thread(agent.close)
            if owns_store:
                store.close()

    app = FastAPI(title="dark", version=__version__, lifespan=lifespan,
                  description="Serves a language model and learns LoRA skills from corrections while it serves.")
    app.state.dark = state
    _add_error_handlers(app)

    app.include_router(rest.public)
    app.include_router(rest.api)
    app.include_router(rest.metrics_router)
    app.include_router(openai_api.router)
    app.include_router(ws.router)
    web = settings.resolved_web_dir()
    if web.is_dir():
        app.mount("/", StaticFiles(directory=web, html=True), name="web")
    else:
        log.warning("no UI: %s is not a folder (set DARK_WEB_DIR)", web)

    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(SecurityHeaders)
    app.add_middleware(BodyLimit, max_bytes=settings.max_frame_bytes)
    return app


def _status_of(exc: Exception) -> int:
    if isinstance(exc, MCPServerError) and str(exc).startswith("no MCP server"):
        return 404
    if isinstance(exc, UnknownAdapterError):
        return 404
    if isinstance(exc, InvalidRequestError):
        return 404 if str(exc).startswith("unknown ") else 400
    if isinstance(exc, LearningUnavailable):
        return 501
    if isinstance(exc, FileNotFoundError):
        return 404
    return 500


def _add_error_handlers(app: FastAPI) -> None:
    def is_openai(request: Request) -> bool:
        return request.url.path.startswith("/v1/")

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return openai_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if is_openai(request):
            kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
            resp = openai_error_response(OpenAIError(exc.status_code, str(exc.detail), type_=kind))
        else:
            resp = JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        message = "invalid request: " + "; ".join(parts)
        if is_openai(request):
            return openai_error_response(OpenAIError(400, message))
        return JSONResponse({"detail": message}, status_code=422)

    @app.exception_handler(DarkError)
    async def _dark(request: Request, exc: DarkError):
        status = _status_of(exc)
        if is_openai(request):
            return openai_error_response(OpenAIError(status, str(exc)))
        return JSONResponse({"detail": str(exc)}, status_code=status)

    @app.exception_handler(FileNotFoundError)
    async def _missing(request: Request, exc: FileNotFoundError):
        return JSONResponse({"detail": str(exc)}, status_code=404)

