"""The websocket at /ws: one Connection per socket, many requests in flight on each, correlated by id.

A reader loop parses frames and starts one task per request; all frames out go through one queue and one
writer task, so tokens of concurrent generations interleave without two sends racing. A bad frame gets an
error frame; only the client (or the server shutting down) closes the socket.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .. import __version__
from ..errors import DarkError, InvalidRequestError, PromptTooLongError, UnknownAdapterError
from .chat import ChatService
from .generation import Generation
from .learning import LearningUnavailable
from ..agent.mcp_client import MCPServerError
from .protocol import (
    SUBPROTOCOL, Ack, AddMCPServer, Adapters, AgentApprove, AgentCorrectTurn, AgentEvent, AgentLearn, AgentReject,
    AgentStop, AgentTask, Chat, ClientMessage, Conversations, Correct, CreateAdapter, DeleteAdapter,
    DeleteConversation, Error, Feedback, FrameError, Hello, History, HistoryReply, Job, Learn, ListAdapters,
    ListConversations, ListMCPServers, MCPAutoApprove, MCPServers, Ping, Pong, Regenerate, RemoveMCPServer,
    RestartMCPServer, Rollback, Started, Stop, Token, WatchJob, parse_client_message, request_id_of,
)
from .security import TokenBucket, origin_problem, subprotocols, websocket_key_problem
from .state import AppState

log = logging.getLogger(__name__)
router = APIRouter()


def error_for(exc: BaseException) -> tuple[str, str]:
    """(code, message) for an exception that ends one request."""
    if isinstance(exc, FrameError):
        return exc.code, exc.message
    if isinstance(exc, PromptTooLongError):
        return "prompt_too_long", str(exc)
    if isinstance(exc, UnknownAdapterError):
        return "unknown_adapter", str(exc)
    if isinstance(exc, InvalidRequestError):
        text = str(exc)
        return ("not_found" if text.startswith("unknown ") else "invalid_request"), text
    if isinstance(exc, LearningUnavailable):
        return "learning_unavailable", str(exc)
    if isinstance(exc, MCPServerError) and str(exc).startswith("no MCP server"):
        return "not_found", str(exc)
    if isinstance(exc, DarkError):
        return "failed", str(exc)
    log.error("request failed", exc_info=exc)
    return "internal", f"internal error ({type(exc).__name__}); the server log has the details"


class Connection:
    def __init__(self, ws: WebSocket, state: AppState):
        self.ws, self.state = ws, state
        self.settings = state.settings
        self.chat = ChatService(state)
        self.limiter = TokenBucket(self.settings.rate_limit, self.settings.rate_burst)
        self.outbox: asyncio.Queue[BaseModel | None] = asyncio.Queue()
        self.generations: dict[Any, Generation] = {}
        self.tasks: dict[Any, asyncio.Task] = {}
        self.watchers: list[Callable[[Job], None]] = []
        self.loop = asyncio.get_running_loop()
        self.handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            "chat": self.on_chat, "regenerate": self.on_regenerate, "correct": self.on_correct,
            "learn": self.on_learn, "feedback": self.on_feedback, "adapters": self.on_adapters,
            "create_adapter": self.on_create_adapter, "rollback": self.on_rollback,
            "delete_adapter": self.on_delete_adapter, "conversations": self.on_conversations,
            "history": self.on_history, "delete_conversation": self.on_delete_conversation,
            "watch": self.on_watch, "mcp_servers": self.on_mcp_servers, "mcp_add_server": self.on_mcp_add_server,
            "mcp_remove_server": self.on_mcp_remove_server, "mcp_restart_server": self.on_mcp_restart_server,
            "mcp_auto_approve": self.on_mcp_auto_approve, "agent": self.on_agent,
            "agent_approve": self.on_agent_approve, "agent_reject": self.on_agent_reject,
            "agent_correct_turn": self.on_agent_correct_turn, "agent_stop": self.on_agent_stop,
            "agent_learn": self.on_agent_learn,
        }
        self.runs: dict[str, Any] = {}          # agent run id -> the id of the request that started it
        self.advancing: set[str] = set()        # runs whose model is working now
        self.background: set[asyncio.Task] = set()

    # --- plumbing ---
    def send(self, frame: BaseModel) -> None:
        self.outbox.put_nowait(frame)

    def send_threadsafe(self, frame: BaseModel) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, frame)
        except RuntimeError:  # loop closed: the server is shutting down
            pass

    def error(self, request_id: Any, code: str, message: str) -> None:
        self.state.metrics.inc("dark_ws_errors_total", "Error frames sent, by code", code=code)
        self.send(Error(id=request_id, code=code, message=message))

    async def _writer(self) -> None:
        while (frame := await self.outbox.get()) is not None:
            await self.ws.send_text(frame.model_dump_json())

    async def run(self) -> None:
        state = self.state
        state.connections.add(self)
        state.metrics.add_gauge("dark_ws_connections", "Open websockets", 1)
        writer = asyncio.create_task(self._writer())
        self.send(Hello(server=f"dark {__version__}", model=state.model_name, learning=state.learning.available,
                        limits=self.settings.public_limits()))
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                self.on_frame(data)
                if writer.done():  # the socket broke while sending
                    break
        except WebSocketDisconnect:
            pass
        finally:
            state.connections.discard(self)
            state.metrics.add_gauge("dark_ws_connections", "Open websockets", -1)
            for watcher in self.watchers:
                state.hub.unwatch(watcher)
            for gen in self.generations.values():
                gen.stop()
            for task in self.tasks.values():
                task.cancel()
            for task in self.background:
                task.cancel()
            self._cancel_runs()
            self.outbox.put_nowait(None)
            try:
                await asyncio.wait_for(writer, timeout=1.0)
            except (asyncio.TimeoutError, Exception):
                writer.cancel()

    def on_frame(self, data: str | bytes) -> None:
        size = len(data) if isinstance(data, bytes) else len(data.encode())
        if size > self.settings.max_frame_bytes:
            self.error(None, "frame_too_large", f"the frame has {size} bytes; this server takes at most "
                                                f"{self.settings.max_frame_bytes} per frame")
            return
        if not self.limiter.take():  # before parsing: a flood of junk costs as little as a flood of pings
            self.error(request_id_of(data), "rate_limited",
                       f"more than {self.settings.rate_limit:g} messages a second (burst {self.settings.rate_burst});"
                       " slow down and send it again")
            return
        try:
            msg = parse_client_message(data)
        except FrameError as e:
            self.error(e.request_id, e.code, e.message)
            return
        if isinstance(msg, Ping):
            self.send(Pong(id=msg.id))
        elif isinstance(msg, Stop):
            gen = self.generations.get(msg.id)
            if gen is None:
                self.error(msg.id, "not_running", f"no generation with id {msg.id!r} is running on this socket")
            else:
                gen.stop()
        elif msg.id in self.tasks or self._run_uses(msg.id):
            self.error(msg.id, "duplicate_id", f"a request with id {msg.id!r} is still running; use a new id")
        elif isinstance(msg, (Chat, Regenerate)) and len(self.generations) >= self.settings.max_inflight:
            self.error(msg.id, "too_many_requests", f"{self.settings.max_inflight} generations are already running "
                                                    "on this socket; wait for one to finish or stop one")
        else:
            if isinstance(msg, (Chat, Regenerate)):
                self.generations[msg.id] = Generation(self.state.llm)
            self.tasks[msg.id] = asyncio.create_task(self._handle(msg))

    async def _handle(self, msg: ClientMessage) -> None:
        try:
            await self.handlers[msg.type](msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            code, text = error_for(e)
            self.error(msg.id, code, text)
        finally:
            self.tasks.pop(msg.id, None)
            self.generations.pop(msg.id, None)

    # --- generation ---
    async def _generate(self, msg, turn, adapter: str | None, args: dict) -> None:
        self.send(Started(id=msg.id, conversation_id=turn.conversation_id, user_message_id=turn.user_message_id,
                          parent_id=turn.parent_id))
        gen = self.generations[msg.id]
        done = await self.chat.answer(turn, adapter, args, gen, lambda text: self.send(Token(id=msg.id, text=text)))
        self.send(done.model_copy(update={"id": msg.id}))

    async def on_chat(self, msg: Chat) -> None:
        args = self.state.sampling_args(msg.sampling)
        # an unknown adapter fails before anything is stored
        await asyncio.to_thread(self.state.resolve_adapter, msg.adapter)
        turn = await self.chat.chat_turn(msg)
        await self._generate(msg, turn, msg.adapter, args)

    async def on_regenerate(self, msg: Regenerate) -> None:
        args = self.state.sampling_args(msg.sampling)
        turn, previous_adapter = await self.chat.regenerate_turn(msg)
        adapter = msg.adapter if "adapter" in msg.model_fields_set else previous_adapter
        await self._generate(msg, turn, adapter, args)

    # --- learning ---
    def _relay_job(self, request_id: Any, first: Job) -> None:
        """Send the job's events so far (or `first` when the hub has none), then every new one, under the
        request's id."""
        def watcher(job: Job) -> None:
            self.send_threadsafe(job.model_copy(update={"id": request_id}))

        self.watchers.append(watcher)
        past = self.state.hub.watch(first.job_id, watcher)
        for job in past or [first]:
            self.send(job.model_copy(update={"id": request_id}))

    async def on_correct(self, msg: Correct) -> None:
        queued = await self.chat.correct(msg)
        self._relay_job(msg.id, Job(job_id=queued["job_id"], adapter=queued["adapter"], state="queued",
                                    message_id=msg.message_id))

    async def on_learn(self, msg: Learn) -> None:
        queued = await asyncio.to_thread(self.state.learning.submit, msg.examples, msg.adapter, msg.kind, "api")
        self._relay_job(msg.id, Job(job_id=queued["job_id"], adapter=queued["adapter"], state="queued"))

    async def on_watch(self, msg: WatchJob) -> None:
        row = await asyncio.to_thread(self.state.store.get_job, msg.job_id)
        stored = Job(id=msg.id, job_id=row["id"], adapter=row["adapter"], state=row["state"],
                     report=row.get("report"), error=row.get("error"))
        if not self.state.hub.events(msg.job_id) and row["state"] not in ("queued", "running"):
            self.send(stored)  # finished before this server started: the stored state is all there is
            return
        self._relay_job(msg.id, stored)

    # --- adapters ---
    async def _adapters(self, request_id: Any) -> None:
        adapters = await asyncio.to_thread(self.state.learning.list_adapters)
        self.send(Adapters(id=request_id, adapters=adapters))

    async def on_adapters(self, msg: ListAdapters) -> None:
        await self._adapters(msg.id)

    async def on_create_adapter(self, msg: CreateAdapter) -> None:
        await asyncio.to_thread(self.state.learning.create, msg.name, msg.r, msg.alpha)
        await self._adapters(msg.id)
        await broadcast_adapters(self.state, exclude=self)

    async def on_rollback(self, msg: Rollback) -> None:
        await asyncio.to_thread(self.state.learning.rollback, msg.adapter, msg.version)
        await self._adapters(msg.id)
        await broadcast_adapters(self.state, exclude=self)

    async def on_delete_adapter(self, msg: DeleteAdapter) -> None:
        await asyncio.to_thread(self.state.learning.delete, msg.adapter)
        await self._adapters(msg.id)
        await broadcast_adapters(self.state, exclude=self)

    # --- conversations and feedback ---
    async def on_conversations(self, msg: ListConversations) -> None:
        rows = await asyncio.to_thread(self.state.store.list_conversations, msg.limit)
        self.send(Conversations(id=msg.id, conversations=rows))

    async def on_history(self, msg: History) -> None:
        conv, messages = await asyncio.to_thread(self.chat.history, msg.conversation_id)
        self.send(HistoryReply(id=msg.id, conversation=conv, messages=messages))

    async def on_delete_conversation(self, msg: DeleteConversation) -> None:
        await asyncio.to_thread(self.state.store.delete_conversation, msg.conversation_id)
        self.send(Ack(id=msg.id, request=msg.type))

    async def on_feedback(self, msg: Feedback) -> None:
        row = await asyncio.to_thread(self.state.store.add_feedback, msg.message_id, msg.rating, msg.comment)
        self.send(Ack(id=msg.id, request=msg.type, data={"feedback_id": row["id"]}))

    # --- MCP servers ---
    @property
    def agent(self):
        if self.state.agent is None:
            raise DarkError("the agent is not running (the server is starting or stopping); try again")
        return self.state.agent

    def _servers(self, request_id: Any) -> None:
        self.send(MCPServers(id=request_id, servers=self.agent.public_view()["mcpServers"]))

    async def on_mcp_servers(self, msg: ListMCPServers) -> None:
        self._servers(msg.id)

    async def on_mcp_add_server(self, msg: AddMCPServer) -> None:
        await self.agent.add_server(msg.name, msg.config)
        self._servers(msg.id)

    async def on_mcp_remove_server(self, msg: RemoveMCPServer) -> None:
        await self.agent.remove_server(msg.name)
        self._servers(msg.id)

    async def on_mcp_restart_server(self, msg: RestartMCPServer) -> None:
        await self.agent.restart_server(msg.name)
        self._servers(msg.id)

    async def on_mcp_auto_approve(self, msg: MCPAutoApprove) -> None:
        await asyncio.to_thread(self.agent.set_auto_approve, msg.name, msg.value)
        self._servers(msg.id)

    # --- agent runs ---
    def _relay_run(self, request_id: Any) -> Callable[[dict], None]:
        """The run's on_event: its events, from whichever thread, go out under the starting request's id."""
        def relay(event: dict) -> None:
            self.send_threadsafe(AgentEvent(id=request_id, **event))
        return relay

    def _run_uses(self, request_id: Any) -> bool:
        """Whether an agent run that has not ended still sends its events under this request id."""
        agent = self.state.agent
        if agent is None or request_id not in self.runs.values():
            return False
        return any(rid == request_id and (run := agent.runs.get(run_id)) is not None
                   and run.state not in ("done", "max_steps", "cancelled", "failed")
                   for run_id, rid in self.runs.items())

    def _own(self, run_id: str):
        """A run this socket started (runs belong to their socket, and end with it)."""
        if run_id not in self.runs:
            raise InvalidRequestError(f"unknown agent run {run_id!r} on this socket (runs end when their socket "
                                      "closes)")
        return self.agent.get_run(run_id), self.runs[run_id]

    async def _advance(self, run, request_id: Any) -> None:
        """Let the model work until the run needs the user or ends; a failure becomes an agent_error event."""
        if run.id in self.advancing:
            return
        self.advancing.add(run.id)
        try:
            await self.agent.advance(run.id)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not (run.state == "failed" and run.error):   # the run has not said so itself
                code, text = error_for(e)
                self.send(AgentEvent(id=request_id, type="agent_error", run_id=run.id, code=code, error=text))
        finally:
            self.advancing.discard(run.id)

    def _continue(self, run, request_id: Any) -> None:
        """After a decision: once every call of the turn is settled, the model goes on (in the background)."""
        if run.state == "ready" and run.id not in self.advancing:
            task = asyncio.create_task(self._advance(run, request_id))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    def _cancel_runs(self) -> None:
        agent = self.state.agent
        if agent is None:
            return
        for run_id in self.runs:
            run = agent.runs.get(run_id)
            if run is not None and run.state not in ("done", "max_steps", "cancelled", "failed"):
                self.loop.run_in_executor(None, run.cancel)

    async def on_agent(self, msg: AgentTask) -> None:
        agent = self.agent
        args = self.state.sampling_args(msg.sampling)
        max_tokens = args.pop("max_tokens")
        adapter = "auto"
        if "adapter" in msg.model_fields_set:
            adapter = (await asyncio.to_thread(self.state.resolve_adapter, msg.adapter))[0] if msg.adapter else None
        history = None
        if msg.conversation_id is not None:
            _, messages = await asyncio.to_thread(self.chat.history, msg.conversation_id)
            history = [{"role": m["role"], "content": m["content"]} for m in messages
                       if m["role"] in ("user", "assistant")]
        run = await asyncio.to_thread(
            agent.start_run, msg.content, servers=msg.servers, on_event=self._relay_run(msg.id), adapter=adapter,
            system=msg.system, history=history, max_steps=msg.max_steps, result_tokens=msg.result_tokens,
            max_tokens=max_tokens, sampling=args)
        self.runs[run.id] = msg.id
        await self._advance(run, msg.id)

    async def on_agent_approve(self, msg: AgentApprove) -> None:
        run, request_id = self._own(msg.run_id or msg.call_id.rpartition("-")[0])
        call = await self.agent.approve(run.id, msg.call_id, msg.edited)
        self.send(Ack(id=msg.id, request=msg.type, data={"run_id": run.id, "call": call.to_dict()}))
        self._continue(run, request_id)

    async def on_agent_reject(self, msg: AgentReject) -> None:
        run, request_id = self._own(msg.run_id or msg.call_id.rpartition("-")[0])
        call = await self.agent.reject(run.id, msg.call_id, msg.reason)
        self.send(Ack(id=msg.id, request=msg.type, data={"run_id": run.id, "call": call.to_dict()}))
        self._continue(run, request_id)

    async def on_agent_correct_turn(self, msg: AgentCorrectTurn) -> None:
        run, request_id = self._own(msg.run_id)
        calls = await self.agent.correct_turn(run.id, [c.model_dump() for c in msg.calls], msg.content)
        self.send(Ack(id=msg.id, request=msg.type, data={"run_id": run.id, "calls": [c.to_dict() for c in calls]}))
        self._continue(run, request_id)

    async def on_agent_stop(self, msg: AgentStop) -> None:
        run, _ = self._own(msg.run_id)
        await asyncio.to_thread(run.cancel)
        self.send(Ack(id=msg.id, request=msg.type, data={"run_id": run.id, "state": run.state}))

    async def on_agent_learn(self, msg: AgentLearn) -> None:
        self.state.learning.require("submit_learn")
        run, _ = self._own(msg.run_id)
        adapter = run.learn_adapter
        job = await asyncio.to_thread(self.agent.learn, run.id, call_ids=msg.call_ids,
                                      include_approved=msg.include_approved, on_event=self.state.hub.on_event)
        job_id = str(job.id)
        self.state.hub.register(job_id, adapter, None)
        log.info("learn job %s queued on adapter %s from agent run %s", job_id, adapter, run.id)
        self._relay_job(msg.id, Job(job_id=job_id, adapter=adapter, state="queued"))


def broadcast_frame(state: AppState, event: dict) -> None:
    """An MCP server's status change, to every socket (id null). Runs on the event loop."""
    frame = AgentEvent(id=None, **event)
    for conn in list(state.connections):
        conn.send(frame)


async def broadcast_adapters(state: AppState, exclude: Connection | None = None) -> None:
    """Tell every socket that the adapters changed; id null marks it unsolicited."""
    if not state.connections:
        return
    try:
        adapters = await asyncio.to_thread(state.learning.list_adapters)
    except Exception:
        log.exception("could not list adapters for a broadcast")
        return
    for conn in list(state.connections):
        if conn is not exclude:
            conn.send(Adapters(id=None, adapters=adapters))


async def _deny(ws: WebSocket, status: int, code: str, message: str) -> None:
    log.warning("websocket refused (%s): %s", code, message)
    try:
        await ws.send_denial_response(JSONResponse({"error": {"code": code, "message": message}}, status_code=status))
    except RuntimeError:  # the server has no denial-response extension: a plain refusal (HTTP 403)
        await ws.close(code=1008, reason=message[:120])


@router.websocket("/ws")
async def websocket_endpoint(ws: WebSocket) -> None:
    state: AppState = ws.app.state.dark
    problem = origin_problem(ws, state.settings)
    if problem:
        return await _deny(ws, 403, "forbidden_origin", problem)
    problem = websocket_key_problem(ws, state.settings)
    if problem:
        return await _deny(ws, 401, "unauthorized", problem)
    if len(state.connections) >= state.settings.max_connections:
        return await _deny(ws, 503, "busy", f"this server already has {state.settings.max_connections} open "
                                            "websockets; try again later")
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in subprotocols(ws) else None)
    await Connection(ws, state).run()
