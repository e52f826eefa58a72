"""MCP servers: configuration, sessions on a background event loop, tool listing and calls.

The sessions of the official `mcp` SDK are async and must be entered and left in one task, so every server
lives in one long-lived task on the manager's own asyncio loop, in its own thread. Sync code (tests, scripts,
the agent loop) and the FastAPI app (another loop) both reach it through thread-safe futures.

A server never hangs its caller: start-up has a deadline, each call has a timeout, and a server whose process
exits or whose connection drops becomes `failed` with the reason (and the tail of its stderr for stdio servers).

Configuration is the usual JSON shape, plus a few dark keys per server:

    {"mcpServers": {
        "fs":   {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem"],
                 "roots": ["/home/me/notes"], "auto_approve": false},
        "time": {"command": "python", "args": ["-m", "mcp_server_time"], "auto_approve": true},
        "api":  {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer ${API_TOKEN}"}}}}

- `env` / `headers` / `url` / `args` may name environment variables as `${NAME}` (secrets stay out of the file);
- `auto_approve`: true (every tool of the server runs without asking) or a list of tool names; default false;
- `roots`: the directories a filesystem-like server may touch. They are appended to a stdio server's args (the
  convention of server-filesystem and its kin; `"roots_in_args": false` turns that off) and answer the server's
  MCP `roots/list` requests, which such servers treat as authoritative;
- `tools`: an allow-list of tool names shown to the model (default: all);
- `adapter`: the skill the agent uses with this server (default `mcp-<name>`);
- `disabled`, `timeout` (start-up, s), `call_timeout` (s), `cwd`, `type` ("stdio", "http", "sse").

Nothing meant for clients carries a secret: `public_view()` and `status()` redact env and header values,
credentials in URLs and secret-looking command-line values.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import DarkError, InvalidRequestError

log = logging.getLogger(__name__)

SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,59}")  # "mcp-<name>" must stay a valid adapter name
REDACTED = "***"
STATES = ("starting", "ready", "failed", "stopped")
_SECRET_WORDS = re.compile(r"(key|token|secret|passw|auth|credential|bearer)", re.I)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KNOWN_KEYS = {"command", "args", "env", "cwd", "url", "headers", "type", "transport", "auto_approve", "autoApprove",
               "disabled", "roots", "roots_in_args", "tools", "adapter", "timeout", "call_timeout"}


class MCPServerError(DarkError):
    """An MCP server is unknown, not ready, or failed."""


# --- configuration ---

@dataclass
class ServerConfig:
    """One MCP server as configured: a stdio command or a URL, and how the agent may use it."""

    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    transport: str = "stdio"                 # "stdio", "http" (streamable HTTP) or "sse"
    auto_approve: bool | list[str] = False
    roots: list[str] = field(default_factory=list)
    roots_in_args: bool = True
    tools: list[str] | None = None
    adapter: str | None = None
    disabled: bool = False
    timeout: float = 30.0                    # start-up deadline, seconds
    call_timeout: float = 60.0               # default deadline of one tool call, seconds

    @classmethod
    def from_dict(cls, name: str, raw: dict) -> "ServerConfig":
        where = f"mcpServers.{name}"
        if not isinstance(name, str) or not SERVER_NAME.fullmatch(name):
            raise InvalidRequestError(f"MCP server name {name!r} is not valid: use 1-60 letters, digits, '.', '_' or '-', "
                                      "starting with a letter or digit")
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"{where} must be an object with 'command' (stdio) or 'url' (HTTP)")
        unknown = sorted(set(raw) - _KNOWN_KEYS)
        if unknown:
            log.warning("%s: ignoring unknown keys %s", where, unknown)
        has_cmd, has_url = bool(raw.get("command")), bool(raw.get("url"))
        if has_cmd == has_url:
            raise InvalidRequestError(f"{where} needs exactly one of 'command' (a stdio server) or 'url' (an HTTP server)")
        kind = str(raw.get("type") or raw.get("transport") or ("stdio" if has_cmd else "http")).lower()
        kind = {"streamable-http": "http", "streamablehttp": "http", "streamable_http": "http", "https": "http"}.get(kind, kind)
        if kind not in ("stdio", "http", "sse") or (kind == "stdio") != has_cmd:
            raise InvalidRequestError(f"{where}.type {raw.get('type') or raw.get('transport')!r} does not fit; use 'stdio' "
                                      "with 'command', 'http' or 'sse' with 'url'")

        def strings(key, kind_=list):
            value = raw.get(key, kind_())
            ok = (isinstance(value, list) and all(isinstance(v, str) for v in value)) if kind_ is list else \
                 (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()))
            if not ok:
                raise InvalidRequestError(f"{where}.{key} must be " + ("a list of strings" if kind_ is list else "an object of strings"))
            return list(value) if kind_ is list else dict(value)

        auto = raw.get("auto_approve", raw.get("autoApprove", False))
        if not (isinstance(auto, bool) or (isinstance(auto, list) and all(isinstance(t, str) for t in auto))):
            raise InvalidRequestError(f"{where}.auto_approve must be true, false or a list of tool names")
        tools = raw.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, str) for t in tools)):
            raise InvalidRequestError(f"{where}.tools must be a list of tool names")
        roots = []
        for r in strings("roots"):
            path = Path(os.path.expanduser(r)).resolve()
            if not path.is_dir():
                raise InvalidRequestError(f"{where}.roots: {r!r} is not an existing directory")
            roots.append(str(path))
        timeouts = {}
        for key, default in (("timeout", 30.0), ("call_timeout", 60.0)):
            value = raw.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise InvalidRequestError(f"{where}.{key} must be a number of seconds in (0, 3600]")
            timeouts[key] = float(value)
        adapter = raw.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise InvalidRequestError(f"{where}.adapter must be an adapter name")
        return cls(name=name, command=raw.get("command"), args=strings("args"), env=strings("env", dict),
                   cwd=raw.get("cwd"), url=raw.get("url"), headers=strings("headers", dict), transport=kind,
                   auto_approve=auto, roots=roots, roots_in_args=bool(raw.get("roots_in_args", True)), tools=tools,
                   adapter=adapter, disabled=bool(raw.get("disabled", False)), **timeouts)

    def to_dict(self) -> dict:
        """The config as written in the file (secrets included: this is for the server's own file only)."""
        out: dict[str, Any] = {}
        if self.command:
            out.update(command=self.command, args=list(self.args))
            if self.env:
                out["env"] = dict(self.env)
            if self.cwd:
                out["cwd"] = self.cwd
        else:
            out["url"] = self.url
            if self.transport != "http":
                out["type"] = self.transport
            if self.headers:
                out["headers"] = dict(self.headers)
        for key, default in (("auto_approve", False), ("roots", []), ("roots_in_args", True), ("tools", None),
                             ("adapter", None), ("disabled", False), ("timeout", 30.0), ("call_timeout", 60.0)):
            value = getattr(self, key)
            if value != default:
                out[key] = value
        return out

    def public_view(self) -> dict:
        """What a client may see: the shape of the config with every secret replaced by '***'."""
        out = self.to_dict()
        if "env" in out:
            out["env"] = {k: REDACTED for k in out["env"]}
        if "headers" in out:
            out["headers"] = {k: REDACTED for k in out["headers"]}
        if out.get("url"):
            out["url"] = redact_url(out["url"])
        if "args" in out:
            out["args"] = redact_args(out["args"])
        out["adapter"] = self.adapter_name
        return out

    @property
    def adapter_name(self) -> str:
        return self.adapter or f"mcp-{self.name}"

    def approves(self, tool: str) -> bool:
        """Whether a call of `tool` on this server may run without asking the user."""
        return self.auto_approve is True or (isinstance(self.auto_approve, list) and tool in self.auto_approve)


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2] if "@" in parts.netloc else parts.netloc
    query = urlencode([(k, REDACTED) for k, _ in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def redact_args(args: list[str]) -> list[str]:
    """Hide values that follow or are glued to secret-looking flags (--api-key X, --token=X) and ${VAR} uses."""
    out, hide_next = [], False
    for a in args:
        if hide_next and not a.startswith("-"):
            out.append(REDACTED)
        elif a.startswith("-") and "=" in a and _SECRET_WORDS.search(a.split("=", 1)[0]):
            out.append(a.split("=", 1)[0] + "=" + REDACTED)
        elif _SECRET_WORDS.search(a) and not a.startswith("-") and _VAR.search(a):
            out.append(REDACTED)
        else:
            out.append(a)
        hide_next = a.startswith("-") and "=" not in a and bool(_SECRET_WORDS.search(a))
    return out


def expand_vars(text: str, where: str) -> str:
    """Replace ${NAME} with the environment variable NAME; a missing one is an error that names it."""
    def sub(m):
        value = os.environ.get(m.group(1))
        if value is None:
            raise MCPServerError(f"{where} uses ${{{m.group(1)}}}, but that environment variable is not set")
        return value
    return _VAR.sub(sub, text)


def load_config_file(path: str | Path) -> dict[str, ServerConfig]:
    """Read an {"mcpServers": {...}} JSON file; a missing file is an empty config."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text() or "{}")
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    return parse_config(data, str(path))


def parse_config(data: dict, where: str = "config") -> dict[str, ServerConfig]:
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers", {}), dict):
        raise InvalidRequestError(f"{where} must be an object with an 'mcpServers' object inside")
    return {name: ServerConfig.from_dict(name, raw) for name, raw in data.get("mcpServers", {}).items()}


# --- tools and results ---

@dataclass
class ToolSpec:
    """One tool of one server, with its full JSON schemas."""

    server: str
    name: str
    description: str
    input_schema: dict
    output_schema: dict | None = None
    annotations: dict | None = None
    title: str | None = None

    def to_dict(self) -> dict:
        return {"server": self.server, "name": self.name, "title": self.title, "description": self.description,
                "input_schema": self.input_schema, "output_schema": self.output_schema, "annotations": self.annotations}

    def function_schema(self, name: str | None = None) -> dict:
        """The OpenAI-style function entry chat templates take in `tools=`."""
        return {"type": "function", "function": {"name": name or self.name, "description": self.description,
                                                 "parameters": self.input_schema}}


@dataclass
class ToolResult:
    """What a tool call returned: the content blocks, their text rendering, and whether it is an error."""

    content: list[dict]
    text: str
    is_error: bool = False
    structured: Any = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"content": self.content, "text": self.text, "is_error": self.is_error, "structured": self.structured,
                "seconds": round(self.seconds, 3)}

    @classmethod
    def error(cls, message: str, seconds: float = 0.0) -> "ToolResult":
        return cls([{"type": "text", "text": message}], message, True, None, seconds)


def content_text(blocks: list[dict]) -> str:
    """The text a model reads for a list of MCP content blocks (binary content is described, not inlined)."""
    parts = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            parts.append(b.get("text", ""))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {b.get('mimeType') or b.get('mime_type') or ''}, {len(b.get('data') or '') * 3 // 4} bytes]")
        elif kind == "resource":
            res = b.get("resource") or {}
            parts.append(res["text"] if "text" in res else f"[resource {res.get('uri', '')} ({res.get('mimeType', 'binary')})]")
        elif kind == "resource_link":
            parts.append(f"[resource link {b.get('uri', '')}{': ' + b['name'] if b.get('name') else ''}]")
        else:
            parts.append(json.dumps(b, ensure_ascii=False))
    return "\n".join(parts)


def _scrub(cfg: ServerConfig, text: str) -> str:
    """Blank out a server's secrets (env and header values, also as expanded from the environment) in text that
    clients see, such as an error that quotes the server's stderr."""
    values = set()
    for v in [*cfg.env.values(), *cfg.headers.values()]:
        for candidate in (v, _VAR.sub(lambda m: os.environ.get(m.group(1), ""), v)):
            values.add(candidate)
            values.update(candidate.split())   # "Bearer <token>": the token alone too
    for v in sorted((v for v in values if len(v) >= 6), key=len, reverse=True):
        text = text.replace(v, REDACTED)
    return text


def _describe(exc: BaseException) -> str:
    """One line for an exception, looking inside exception groups (anyio wraps failures in them)."""
    while hasattr(exc, "exceptions") and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, (MCPServerError, TimeoutError)):
        return text
    return text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"


# --- the manager ---

@dataclass
class _Server:
    config: ServerConfig
    state: str = "starting"
    error: str | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    server_info: dict | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    client: Any = None
    task: asyncio.Task | None = None
    stop: asyncio.Event | None = None
    settled: asyncio.Event | None = None     # set once the server left "starting"
    broken: asyncio.Event | None = None      # the connection is gone (set by the transport or a failed call)
    broken_reason: str | None = None
    stderr: Any = None
    http_error: str | None = None            # the last HTTP error status an HTTP server answered


class MCPManager:
    """Owns the MCP servers of one process: starts them, lists their tools, calls them, reports their status.

    `config` is a path to an {"mcpServers": ...} JSON file (servers start at once; add/remove can write it back
    with `save=True`), the parsed dict, or None. `on_event(dict)` hears {"type": "mcp_status", ...} whenever a
    server changes state; it is called on the manager's thread and must not block.
    """

    def __init__(self, config: str | Path | dict | None = None, *, on_event: Callable[[dict], None] | None = None,
                 wait: bool = True):
        self.config_path = Path(config) if isinstance(config, (str, Path)) else None
        self.on_event = on_event
        self._servers: dict[str, _Server] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dark-mcp", daemon=True)
        self._thread.start()
        self._closed = False
        configs = load_config_file(self.config_path) if self.config_path else parse_config(config or {})
        for cfg in configs.values():
            self._start(cfg)
        if wait:
            self.wait_ready(None)

    # --- plumbing between threads ---
    def _submit(self, coro) -> "asyncio.Future":
        if self._closed:
            coro.close()
            raise MCPServerError("the MCP manager is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro, timeout: float | None):
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("MCPManager's blocking calls cannot run on its own loop; use the async variants")
        return self._submit(coro).result(timeout)

    async def _on_loop(self, coro):
        """Await a coroutine on the manager's loop from any other running loop (e.g. FastAPI's)."""
        return await asyncio.wrap_future(self._submit(coro))

    def _emit(self, srv: _Server) -> None:
        if self.on_event:
            try:
                self.on_event({"type": "mcp_status", **self._status(srv)})
            except Exception:
                log.exception("an MCP status listener failed")

    def _set_state(self, srv: _Server, state: str, error: str | None = None) -> None:
        srv.state, srv.error = state, _scrub(srv.config, error) if error else None
        if state == "ready":
            srv.ready_at = time.time()
        if state != "starting" and srv.settled is not None:
            srv.settled.set()
        (log.warning if state == "failed" else log.info)("MCP server %s: %s%s", srv.config.name, state,
                                                          f" ({error})" if error else "")
        self._emit(srv)

    # --- servers ---
    def _start(self, cfg: ServerConfig) -> _Server:
        with self._lock:
            if cfg.name in self._servers:
                raise InvalidRequestError(f"an MCP server named {cfg.name!r} already exists; remove it first or pick another name")
            srv = _Server(cfg, state="stopped" if cfg.disabled else "starting", started_at=time.time())
            self._servers[cfg.name] = srv
        if not cfg.disabled:
            self._run(self._launch(srv), 10)
        return srv

    async def _launch(self, srv: _Server) -> None:
        srv.stop, srv.settled, srv.broken, srv.broken_reason = asyncio.Event(), asyncio.Event(), asyncio.Event(), None
        srv.http_error = None
        srv.task = asyncio.get_running_loop().create_task(self._serve(srv), name=f"mcp-{srv.config.name}")

    def add_server(self, name: str, config: dict | ServerConfig, *, wait: bool = True, save: bool = False) -> dict:
        """Start a new server; with wait, return once it is ready or failed (never later than its timeout)."""
        cfg = config if isinstance(config, ServerConfig) else ServerConfig.from_dict(name, config)
        cfg = replace(cfg, name=name) if cfg.name != name else cfg
        srv = self._start(cfg)
        if save:
            self.save()
        if wait and srv.settled is not None:
            self._run(self._settle(srv), cfg.timeout + 15)
        return self._status(srv)

    async def add_server_async(self, name: str, config: dict | ServerConfig, *, wait: bool = True, save: bool = False) -> dict:
        await asyncio.to_thread(self.add_server, name, config, wait=False, save=save)
        srv = self._get(name)
        if wait and srv.settled is not None:
            await self._on_loop(self._settle(srv))
        return self._status(srv)

    async def _settle(self, srv: _Server) -> None:
        await srv.settled.wait()

    def remove_server(self, name: str, *, save: bool = False) -> None:
        """Stop a server (its process ends) and forget it."""
        srv = self._get(name)
        self._run(self._shutdown(srv), 30)
        with self._lock:
            self._servers.pop(name, None)
        if save:
            self.save()

    async def remove_server_async(self, name: str, *, save: bool = False) -> None:
        await asyncio.to_thread(self.remove_server, name, save=save)

    def restart_server(self, name: str, *, wait: bool = True) -> dict:
        srv = self._get(name)
        self._run(self._shutdown(srv), 30)
        srv.config.disabled = False
        srv.started_at, srv.ready_at, srv.tools, srv.server_info = time.time(), None, [], None
        self._set_state(srv, "starting")
        self._run(self._launch(srv), 10)
        if wait:
            self._run(self._settle(srv), srv.config.timeout + 15)
        return self._status(srv)

    def set_auto_approve(self, name: str, value: bool | list[str], *, save: bool = False) -> dict:
        srv = self._get(name)
        if not (isinstance(value, bool) or (isinstance(value, list) and all(isinstance(t, str) for t in value))):
            raise InvalidRequestError("auto_approve must be true, false or a list of tool names")
        srv.config.auto_approve = value
        if save:
            self.save()
        self._emit(srv)
        return self._status(srv)

    async def _shutdown(self, srv: _Server) -> None:
        if srv.task is None or srv.task.done():
            return
        srv.stop.set()
        if srv.state == "starting":   # not connected yet: nothing to wind down gracefully
            srv.task.cancel()
        done, _ = await asyncio.wait([srv.task], timeout=10)
        if not done:  # a transport that ignores its own shutdown: cut it off
            srv.task.cancel()
            await asyncio.wait([srv.task], timeout=5)

    def wait_ready(self, timeout: float | None = None) -> dict[str, dict]:
        """Wait until no server is starting (each is bounded by its own start-up timeout); return all statuses."""
        pending = [s for s in list(self._servers.values()) if s.settled is not None and s.state == "starting"]
        for srv in pending:
            self._run(self._settle(srv), timeout if timeout is not None else srv.config.timeout + 15)
        return {name: self._status(s) for name, s in list(self._servers.items())}

    def _get(self, name: str) -> _Server:
        srv = self._servers.get(name)
        if srv is None:
            known = ", ".join(sorted(self._servers)) or "none"
            raise MCPServerError(f"no MCP server named {name!r}; configured: {known}")
        return srv

    def config(self, name: str) -> ServerConfig:
        return self._get(name).config

    def names(self) -> list[str]:
        return sorted(self._servers)

    # --- the session task ---
    def _transport(self, srv: _Server):
        cfg = srv.config
        where = f"mcpServers.{cfg.name}"
        if cfg.transport == "stdio":
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            args = [expand_vars(a, f"{where}.args") for a in cfg.args]
            if cfg.roots and cfg.roots_in_args:
                args += [r for r in cfg.roots if r not in args]
            env = {k: expand_vars(v, f"{where}.env.{k}") for k, v in cfg.env.items()}
            srv.stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
            params = StdioServerParameters(command=expand_vars(cfg.command, f"{where}.command"), args=args,
                                           env=env or None, cwd=cfg.cwd)
            return stdio_client(params, errlog=srv.stderr)
        url = expand_vars(cfg.url, f"{where}.url")
        headers = {k: expand_vars(v, f"{where}.headers.{k}") for k, v in cfg.headers.items()}
        if cfg.transport == "sse":
            from mcp.client.sse import sse_client

            return sse_client(url, headers=headers or None, timeout=min(cfg.timeout, 30.0))
        return _http_transport(url, headers, cfg.timeout, srv)

    def _roots_callback(self, srv: _Server):
        if not srv.config.roots:
            return None
        import mcp_types as types

        async def list_roots(_context):
            return types.ListRootsResult(roots=[types.Root(uri=Path(r).as_uri(), name=Path(r).name or r)
                                                for r in srv.config.roots])
        return list_roots

    def _stderr_tail(self, srv: _Server, limit: int = 800) -> str:
        """What the server said about its failure: its stderr (stdio) or the HTTP status it answered."""
        f = srv.stderr
        if f is None:
            return f"; {srv.http_error}" if srv.http_error else ""
        try:
            f.flush()
            f.seek(0)
            text = f.read()[-limit:].strip()
        except (OSError, ValueError):
            return ""
        return f"; stderr: {text}" if text else ""

    async def _serve(self, srv: _Server) -> None:
        import anyio
        from mcp import Client
        from mcp.types import Implementation

        cfg, started = srv.config, False
        closed = srv.broken
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + cfg.timeout) as scope:
                client = Client(_watched(self._transport(srv), closed), read_timeout_seconds=cfg.timeout,
                                list_roots_callback=self._roots_callback(srv), cache=None,
                                message_handler=self._notifications(srv),
                                client_info=Implementation(name="dark", version="0.1.0"))
                async with client:
                    info = client.server_info
                    srv.server_info = {"name": info.name, "version": info.version} if info else None
                    srv.tools = await self._list_tools(client, cfg)
                    scope.deadline = math.inf
                    srv.client, started = client, True
                    self._set_state(srv, "ready")
                    stop_wait = asyncio.ensure_future(srv.stop.wait())
                    closed_wait = asyncio.ensure_future(closed.wait())
                    try:
                        await asyncio.wait([stop_wait, closed_wait], return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stop_wait.cancel()
                        closed_wait.cancel()
                    srv.client = None
                    if not srv.stop.is_set():
                        raise MCPServerError(srv.broken_reason or "the server closed the connection "
                                             "(its process exited or the connection dropped)")
            if scope.cancelled_caught and not started:
                raise TimeoutError(f"did not finish starting within {cfg.timeout:g} s")
        except asyncio.CancelledError:
            self._set_state(srv, "stopped")
            raise
        except BaseException as e:  # a server's failure must never take the manager down
            message = ("failed to start: " if not started else "") + _describe(e) + self._stderr_tail(srv)
            srv.client = None
            if srv.stop.is_set() and started:
                self._set_state(srv, "stopped")
            elif srv.state != "failed":   # a failed call may have said why already
                self._set_state(srv, "failed", message)
            if not isinstance(e, Exception):
                raise
            return
        finally:
            srv.client = None
            if srv.stderr is not None:
                srv.stderr.close()
                srv.stderr = None
        if srv.state != "failed":
            self._set_state(srv, "stopped")

    def _notifications(self, srv: _Server):
        """Follow a server's tools/list_changed: list its tools again and tell the listeners."""
        import mcp_types as types

        async def handle(message) -> None:
            if isinstance(message, types.ToolListChangedNotification) and srv.client is not None:
                asyncio.get_running_loop().create_task(self._refresh_tools(srv))
        return handle

    async def _refresh_tools(self, srv: _Server) -> None:
        try:
            srv.tools = await self._list_tools(srv.client, srv.config)
            self._emit(srv)
        except Exception as e:
            log.warning("MCP server %s: listing its changed tools failed: %s", srv.config.name, _describe(e))

    async def _list_tools(self, client, cfg: ServerConfig) -> list[ToolSpec]:
        tools, cursor = [], None
        for _ in range(100):   # a paginator that never ends cannot hang start-up
            page = await client.list_tools(cursor=cursor)
            for t in page.tools:
                ann = t.annotations.model_dump(exclude_none=True) if t.annotations else None
                tools.append(ToolSpec(cfg.name, t.name, t.description or "", t.input_schema or {"type": "object"},
                                      t.output_schema, ann, t.title))
            cursor = page.next_cursor
            if not cursor:
                break
        if cfg.tools is not None:
            missing = sorted(set(cfg.tools) - {t.name for t in tools})
            if missing:
                log.warning("MCP server %s has no tools named %s", cfg.name, missing)
            tools = [t for t in tools if t.name in cfg.tools]
        return tools

    # --- using tools ---
    def tools(self, server: str | None = None) -> list[ToolSpec]:
        """The tools of one server, or of every ready server."""
        servers = [self._get(server)] if server else [self._servers[n] for n in self.names()]
        return [t for s in servers if s.state == "ready" for t in s.tools]

    def tool(self, server: str, name: str) -> ToolSpec | None:
        return next((t for t in self._get(server).tools if t.name == name), None)

    def call_tool(self, server: str, name: str, arguments: dict | None = None, timeout: float | None = None) -> ToolResult:
        """Run one tool; errors (server down, timeout, the tool's own failure) come back as an error result."""
        srv = self._get(server)
        timeout = timeout or srv.config.call_timeout
        try:
            return self._run(self._call(srv, name, arguments or {}, timeout), timeout + 15)
        except TimeoutError:
            return ToolResult.error(f"the call of {name} on {server} did not return within {timeout:g} s")

    async def call_tool_async(self, server: str, name: str, arguments: dict | None = None,
                              timeout: float | None = None) -> ToolResult:
        srv = self._get(server)
        return await self._on_loop(self._call(srv, name, arguments or {}, timeout or srv.config.call_timeout))

    async def _call(self, srv: _Server, name: str, arguments: dict, timeout: float) -> ToolResult:
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        start = time.perf_counter()
        cfg = srv.config
        if srv.state != "ready" or srv.client is None:
            return ToolResult.error(f"MCP server {cfg.name} is {srv.state}" + (f": {srv.error}" if srv.error else "")
                                    + "; restart it or fix its configuration")
        if cfg.tools is not None and name not in cfg.tools:
            return ToolResult.error(f"tool {name} of {cfg.name} is not enabled (enabled: {', '.join(cfg.tools)})")
        try:
            res = await asyncio.wait_for(srv.client.call_tool(name, arguments, read_timeout_seconds=timeout), timeout + 5)
        except (asyncio.TimeoutError, TimeoutError):
            return ToolResult.error(f"the call of {name} did not return within {timeout:g} s", time.perf_counter() - start)
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                return ToolResult.error(f"the call of {name} did not return within {timeout:g} s", time.perf_counter() - start)
            if e.code == CONNECTION_CLOSED:
                self._broken(srv, "the server closed the connection")
            return ToolResult.error(f"MCP error {e.code}: {e.error.message if hasattr(e, 'error') else e}",
                                    time.perf_counter() - start)
        except Exception as e:  # the transport itself failed (HTTP server gone, broken pipe)
            self._broken(srv, f"calling {name} failed: {_describe(e)}")
            return ToolResult.error(f"calling {name} failed: {_describe(e)}", time.perf_counter() - start)
        blocks = [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in res.content]
        text = content_text(blocks)
        if not text and res.structured_content is not None:
            text = json.dumps(res.structured_content, ensure_ascii=False)
        return ToolResult(blocks, text, bool(res.is_error), res.structured_content, time.perf_counter() - start)

    def _broken(self, srv: _Server, reason: str) -> None:
        """The connection is unusable: fail the server now, so the next caller sees it without waiting."""
        if srv.state == "ready" and not srv.stop.is_set():
            srv.broken_reason = reason
            self._set_state(srv, "failed", reason + self._stderr_tail(srv))
            srv.broken.set()

    # --- views ---
    def _status(self, srv: _Server) -> dict:
        cfg = srv.config
        return {"name": cfg.name, "state": srv.state, "error": srv.error, "transport": cfg.transport,
                "tools": [t.name for t in srv.tools], "auto_approve": cfg.auto_approve, "roots": list(cfg.roots),
                "adapter": cfg.adapter_name, "server_info": srv.server_info, "started_at": srv.started_at,
                "ready_at": srv.ready_at}

    def status(self, name: str | None = None) -> dict:
        """One server's status, or {name: status} for all. States: starting, ready, failed (with error), stopped."""
        if name is not None:
            return self._status(self._get(name))
        return {n: self._status(self._servers[n]) for n in self.names()}

    def public_view(self) -> dict:
        """Everything a client may be shown: each server's redacted config, status and tools with schemas."""
        return {"mcpServers": {n: {"config": s.config.public_view(), "status": self._status(s),
                                   "tools": [t.to_dict() for t in s.tools]}
                               for n, s in ((n, self._servers[n]) for n in self.names())}}

    def save(self, path: str | Path | None = None) -> Path:
        """Write the configuration (with its secrets: the file is readable by its owner only)."""
        path = Path(path) if path else self.config_path
        if path is None:
            raise InvalidRequestError("this MCP manager has no config file; pass a path to save()")
        data = {"mcpServers": {n: self._servers[n].config.to_dict() for n in self.names()}}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        """Stop every server and the loop thread."""
        if self._closed:
            return
        servers = [self._servers[n] for n in self.names()]

        async def stop_all():   # together: each may take seconds to exit
            results = await asyncio.gather(*(self._shutdown(s) for s in servers), return_exceptions=True)
            for srv, r in zip(servers, results):
                if isinstance(r, BaseException):
                    log.error("stopping MCP server %s failed: %s", srv.config.name, _describe(r))
        try:
            self._run(stop_all(), 30)
        except Exception:
            log.exception("stopping the MCP servers failed")
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@asynccontextmanager
async def _http_transport(url: str, headers: dict, timeout: float, srv: _Server):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    http = create_mcp_http_client(headers=headers or None, timeout=httpx2.Timeout(min(timeout, 30.0), read=300.0))

    async def note_status(response):
        # the SDK reports a rejected request as a bare "error response": keep the HTTP status for the user
        if response.status_code >= 400:
            srv.http_error = f"HTTP {response.status_code} {response.reason_phrase} from {redact_url(str(response.url))}"

    http.event_hooks = {"request": [], "response": [note_status]}
    async with http:
        async with streamable_http_client(url, http_client=http) as streams:
            yield streams


@asynccontextmanager
async def _watched(transport, closed: asyncio.Event):
    """Pass a transport's streams through, setting `closed` when the server's side ends (a dead process)."""
    import anyio

    async with transport as (read, write):
        send, recv = anyio.create_memory_object_stream(0)

        async def pump():
            try:
                async with send:
                    async for item in read:
                        await send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            try:
                yield recv, write
            finally:
                tg.cancel_scope.cancel()
