"""The agent loop as an object with explicit state, so a websocket (or a test) can drive it a step at a time.

    run = AgentRun(llm, mcp, "What time is it in Tokyo?", servers=["time"])
    pending = run.step()              # the model's next turn; returns the calls that wait for the user
    run.approve(pending[0].id)        # or approve(id, edited={"arguments": {...}}), or reject(id, "why")
    run.step()                        # results are in the context: the model goes on ... until run.state == "done"

States: "ready" (step() may run), "generating", "awaiting_approval", "done" (final answer), "max_steps",
"cancelled", "failed". Every change is appended to `run.events` and passed to `on_event` (from whichever
thread made it: step() and approve() block, so an async server runs them with asyncio.to_thread, or uses
astep/aapprove/areject).

Safety: no tool runs without approval unless its server is auto-approve (for that tool). A call the model
wrote badly (unreadable JSON, unknown tool, arguments outside the schema) never runs: its error goes back to
the model as the tool result, unless the user edits it into a valid call and approves that.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import InvalidRequestError
from .mcp_client import MCPManager
from .tools import Toolbox, cut_to_tokens, format_turn, parse_tool_calls, tool_role, tools_system_prompt

log = logging.getLogger(__name__)

DEFAULT_SYSTEM = "You are a helpful assistant."
FINISHED = ("done", "max_steps", "cancelled", "failed")


@dataclass
class ToolCall:
    """One proposed call and everything that happened to it."""

    id: str
    turn: int                         # index of the turn (in run.turns) that proposed it
    name: str | None                  # the name the model sees (after an edit: the edited one)
    arguments: dict | None
    raw: str                          # the text the model wrote for it
    status: str = "pending"           # pending, invalid, running, done, error, rejected, replaced
    server: str | None = None
    tool: str | None = None           # the server's own name of the tool
    error: str | None = None          # why it was invalid (also fed back to the model)
    proposed: dict | None = None      # {"name", "arguments"} as the model wrote them
    edited: bool = False
    auto_approved: bool = False
    source: str = "model"             # "model", or "user" for calls written in a correction
    reason: str | None = None         # why the user rejected it
    result: str | None = None         # what the model reads back (cut to the token budget)
    result_cut: bool = False
    output: dict | None = None        # the full ToolResult (content blocks, is_error, structured)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def resolved(self) -> bool:
        return self.status in ("invalid", "done", "error", "rejected", "replaced")


@dataclass
class Turn:
    """One assistant turn: what the model wrote, where it sits in the messages, and its calls."""

    index: int
    message_index: int
    text: str                         # the model's text, as generated
    content: str                      # the text outside the tool calls
    call_ids: list[str] = field(default_factory=list)
    corrected: bool = False           # the user rewrote this turn (edited a call or wrote calls in)
    finalized: bool = False           # its tool results are in the messages
    replaced_ids: list[str] = field(default_factory=list)   # the model's calls a correction replaced


class AgentRun:
    """One task for the model with tools from MCP servers, driven step by step.

    llm: an OnlineLLM. mcp: the MCPManager. servers: which servers' tools to offer (default: every ready one).
    adapter: "auto" (the first server's adapter, `mcp-<server>` by default, when it exists), None for the base
    model, or a name. history: earlier {"role", "content"} messages of the conversation, before the task.
    result_tokens: the budget of one tool result in the model's context. max_steps: model turns at most.
    sampling: extra sampling arguments (temperature, ...); max_tokens bounds one turn.
    """

    _ids = itertools.count(1)

    def __init__(self, llm, mcp: MCPManager, task: str, *, servers: list[str] | None = None, system: str | None = None,
                 adapter: str | None = "auto", history: list[dict] | None = None, max_steps: int = 8,
                 result_tokens: int = 1024, max_tokens: int = 512, sampling: dict | None = None,
                 on_event: Callable[[dict], None] | None = None, run_id: str | None = None):
        if not isinstance(task, str) or not task.strip():
            raise InvalidRequestError("the task must be a non-empty string")
        if not isinstance(max_steps, int) or max_steps < 1 or result_tokens < 16:
            raise InvalidRequestError("max_steps must be >= 1 and result_tokens >= 16")
        self.llm, self.mcp = llm, mcp
        self.id = run_id or uuid.uuid4().hex[:12]
        self.task = task
        if servers is None:
            servers = [n for n in mcp.names() if mcp.status(n)["state"] == "ready"]
        for name in servers:
            state = mcp.status(name)  # unknown names raise here, with the configured ones listed
            if state["state"] != "ready":
                raise InvalidRequestError(f"MCP server {name} is {state['state']}"
                                          + (f" ({state['error']})" if state["error"] else "") + "; it cannot be used now")
        self.servers = list(servers)
        self.toolbox = Toolbox([t for s in self.servers for t in mcp.tools(s)])
        self.adapter = self._pick_adapter(adapter)
        self.max_steps, self.result_tokens = max_steps, result_tokens
        self.sampling = {"max_tokens": max_tokens, **(sampling or {})}
        self.on_event = on_event
        tok = llm.tokenizer
        system_text, self.native_tools = tools_system_prompt(tok, system or DEFAULT_SYSTEM, self.toolbox.functions())
        self.tool_role = tool_role(tok)
        self.messages: list[dict] = [{"role": "system", "content": system_text}]
        for m in history or []:
            if m.get("role") not in ("user", "assistant", "tool") or not isinstance(m.get("content"), str):
                raise InvalidRequestError("history messages need a role (user, assistant or tool) and string content")
            self.messages.append({"role": m["role"], "content": m["content"]})
        self.messages.append({"role": "user", "content": task})
        self.turns: list[Turn] = []
        self.calls: dict[str, ToolCall] = {}
        self.events: list[dict] = []
        self.state = "ready"
        self.final: str | None = None
        self.error: str | None = None
        self._lock = threading.RLock()
        self._request_id: int | None = None
        self._cancelled = False
        self._emit("agent_started", task=task, servers=self.servers, adapter=self.adapter,
                   tools=self.toolbox.names(), native_tools=self.native_tools)

    def _pick_adapter(self, adapter: str | None) -> str | None:
        if adapter != "auto":
            return adapter
        if not self.servers:
            return None
        name = self.mcp.config(self.servers[0]).adapter_name
        return name if name in {a["name"] for a in self.llm.adapters()} else None

    @property
    def learn_adapter(self) -> str:
        """The adapter corrections of this run teach: the first server's (`mcp-<server>` by default)."""
        if not self.servers:
            raise InvalidRequestError("this run has no MCP server, so there is no tool adapter to teach")
        return self.mcp.config(self.servers[0]).adapter_name

    # --- events ---
    def _emit(self, kind: str, **data) -> dict:
        event = {"type": kind, "run_id": self.id, "seq": len(self.events), "time": time.time(), **data}
        self.events.append(event)
        if self.on_event:
            try:
                self.on_event(event)
            except Exception:
                log.exception("an agent event listener failed")
        return event

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._emit("agent_state", state=state)

    # --- the model's turn ---
    def _generate(self) -> str:
        """The next assistant turn, streamed into `agent_delta` events; cancel() aborts it."""
        q: queue.Queue = queue.Queue()
        self._request_id = self.llm.submit(self.messages, q.put, adapter=self.adapter, **self.sampling)
        try:
            while True:
                out = q.get()
                if out.error is not None:
                    raise out.error
                if out.delta:
                    self._emit("agent_delta", step=len(self.turns), text=out.delta)
                if out.finished:
                    return out.text
        finally:
            self._request_id = None

    def step(self) -> list[ToolCall]:
        """Let the model write its next turn. Returns the calls that now wait for approve/reject (may be empty:
        then either the run is done, or auto-approved calls ran and step() may be called again)."""
        with self._lock:
            if self.state in FINISHED:
                raise InvalidRequestError(f"this agent run is {self.state}; start a new one")
            waiting = self.pending()
            if waiting:
                raise InvalidRequestError(f"calls {', '.join(c.id for c in waiting)} wait for approve or reject first")
            if self.turns:
                self._finalize(self.turns[-1])
            if len(self.turns) >= self.max_steps:
                self._set_state("max_steps")
                return []
            self._set_state("generating")
            try:
                text = self._generate()
            except Exception as e:
                if self._cancelled:
                    return []
                self.error = f"{type(e).__name__}: {e}"
                self._set_state("failed")
                self._emit("agent_error", error=self.error)
                raise
            if self._cancelled:
                return []
            return self._take_turn(text)

    def _take_turn(self, text: str) -> list[ToolCall]:
        content, parsed = parse_tool_calls(text, set(self.toolbox.names()))
        turn = Turn(len(self.turns), len(self.messages), text, content)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": text})
        if not parsed:
            self.final = text
            self._emit("agent_turn", step=turn.index, text=text, content=content, calls=[])
            self._emit("agent_final", text=text)
            self._set_state("done")
            return []
        for p in parsed:
            call = ToolCall(f"{self.id}-{next(self._ids)}", turn.index, p.name, p.arguments, p.raw,
                            proposed={"name": p.name, "arguments": p.arguments} if p.error is None else None)
            self._bind(call, p.error)
            self.calls[call.id] = call
            turn.call_ids.append(call.id)
        self._emit("agent_turn", step=turn.index, text=text, content=content,
                   calls=[self.calls[c].to_dict() for c in turn.call_ids])
        for cid in turn.call_ids:
            call = self.calls[cid]
            if call.status == "pending" and self.mcp.config(call.server).approves(call.tool):
                call.auto_approved = True
                self._execute(call)
        return self._after_calls(turn)

    def _bind(self, call: ToolCall, parse_error: str | None) -> None:
        """Resolve a call's tool and check it; a bad call becomes `invalid` with the error the model will read."""
        error = parse_error or self.toolbox.check(call.name, call.arguments)
        spec = self.toolbox.get(call.name or "")
        call.server, call.tool = (spec.server, spec.name) if spec else (None, None)
        if error:
            call.status, call.error, call.result = "invalid", error, f"Error: {error}"
        else:
            call.status, call.error = "pending", None

    def _after_calls(self, turn: Turn) -> list[ToolCall]:
        calls = [self.calls[c] for c in turn.call_ids]
        waiting = [c for c in calls if not c.resolved]
        if waiting:
            self._set_state("awaiting_approval")
            return waiting
        # the results join the conversation when the next step starts: until then an invalid call can still be
        # edited into a valid one (approve with an edit)
        self._set_state("max_steps" if len(self.turns) >= self.max_steps else "ready")
        return []

    def _finalize(self, turn: Turn) -> None:
        """All calls of the turn are resolved: their results join the conversation, in order."""
        if turn.finalized or not turn.call_ids:
            return
        if turn.corrected:   # the history shows the turn as corrected, so later steps build on the right call
            self.messages[turn.message_index]["content"] = self.turn_text(turn)
        for c in self.turn_calls(turn):
            result = c.result or ""
            if self.tool_role == "user":   # a template without a tool role: mark the turn as a tool's answer
                result = f"<tool_response>\n{result}\n</tool_response>"
            self.messages.append({"role": self.tool_role, "content": result})
        turn.finalized = True

    def turn_text(self, turn: Turn | int, *, include_rejected: bool = True) -> str:
        """An assistant turn as it stands: the model's own text, or, once corrected, its calls as they now are."""
        turn = self.turns[turn] if isinstance(turn, int) else turn
        if not turn.corrected:
            return turn.text
        calls = self.turn_calls(turn, include_rejected=include_rejected)
        user_written = any(self.calls[c].source == "user" for c in turn.call_ids)
        return format_turn(turn.content if user_written else "", [(c.name, c.arguments) for c in calls])

    def turn_calls(self, turn: Turn | int, *, include_rejected: bool = True) -> list[ToolCall]:
        """The calls a turn shows: all of them as the model wrote it; once corrected, those that can be written
        out (an unreadable call the user neither fixed nor kept has no text to show)."""
        turn = self.turns[turn] if isinstance(turn, int) else turn
        calls = [self.calls[c] for c in turn.call_ids]
        if turn.corrected:
            calls = [c for c in calls if c.arguments is not None and c.name]
        return [c for c in calls if include_rejected or c.status != "rejected"]

    # --- the user's decisions ---
    def pending(self) -> list[ToolCall]:
        return [c for c in self.calls.values() if c.status == "pending"]

    def _get(self, call_id: str) -> ToolCall:
        call = self.calls.get(call_id)
        if call is None:
            raise InvalidRequestError(f"this run has no call {call_id!r}")
        return call

    def approve(self, call_id: str, edited: dict | None = None) -> ToolCall:
        """Run a pending call, or first replace its name and/or arguments (`edited` = {"name"?, "arguments"?}).

        An invalid call (bad JSON, unknown tool, schema violation) can be approved only with an edit that fixes it.
        An edit that does not fit the tool's schema is refused with what is wrong, and nothing runs.
        """
        with self._lock:
            call = self._get(call_id)
            if call.status not in ("pending", "invalid") or self.turns[call.turn].finalized:
                raise InvalidRequestError(f"call {call_id} is {call.status}; only pending calls can be approved")
            if edited is not None:
                self._apply_edit(call, edited)
            elif call.status == "invalid":
                raise InvalidRequestError(f"call {call_id} cannot run as written ({call.error}); edit it or reject it")
            self._execute(call)
            self._after_calls(self.turns[call.turn])
            return call

    def _apply_edit(self, call: ToolCall, edited: dict) -> None:
        if not isinstance(edited, dict) or not set(edited) <= {"name", "arguments"} or not edited:
            raise InvalidRequestError('an edit is {"name": <tool>, "arguments": {...}} (either key may be left out)')
        name = edited.get("name", call.name)
        arguments = edited.get("arguments", call.arguments if call.arguments is not None else {})
        problem = self.toolbox.check(name, arguments)
        if problem:
            raise InvalidRequestError(f"the edited call cannot run: {problem}")
        if name == call.name and arguments == call.arguments and call.status == "pending":
            return   # approving it as it was
        call.name, call.arguments, call.edited = name, arguments, True
        self._bind(call, None)
        self.turns[call.turn].corrected = True
        self._emit("tool_call_edited", call=call.to_dict())

    def reject(self, call_id: str, reason: str = "") -> ToolCall:
        """Do not run the call; the model reads that it was rejected (and why) and goes on."""
        with self._lock:
            call = self._get(call_id)
            if call.status not in ("pending", "invalid") or self.turns[call.turn].finalized:
                raise InvalidRequestError(f"call {call_id} is {call.status}; only pending calls can be rejected")
            call.status, call.reason = "rejected", reason or None
            call.result = "Error: the user rejected this call" + (f": {reason}" if reason else ".")
            self._emit("tool_rejected", call=call.to_dict())
            self._after_calls(self.turns[call.turn])
            return call

    def correct_turn(self, calls: list[dict], content: str = "", turn: int | None = None) -> list[ToolCall]:
        """Replace a model turn that made no (or the wrong) calls with the user's own calls, and run them.

        For a model that answered without a tool: `calls` = [{"name", "arguments"}, ...] written by the user. They
        run at once (the user wrote them) and the run goes on from there. Default turn: the last one.
        """
        with self._lock:
            if not self.turns:
                raise InvalidRequestError("the model has not written a turn yet; call step() first")
            index = len(self.turns) - 1 if turn is None else turn
            if index != len(self.turns) - 1:
                raise InvalidRequestError("only the latest turn can be corrected")
            t = self.turns[index]
            if t.finalized and t.call_ids or not isinstance(calls, list) or not calls:
                raise InvalidRequestError("a correction needs a non-empty list of calls, on a turn whose results "
                                          "have not gone back to the model yet")
            ran = [cid for cid in t.call_ids if self.calls[cid].status not in ("pending", "invalid")]
            if ran:
                raise InvalidRequestError(f"calls {', '.join(ran)} of this turn were already decided; correct a turn "
                                          "before approving or rejecting any of its calls")
            for c in calls:
                if not isinstance(c, dict) or not set(c) <= {"name", "arguments"}:
                    raise InvalidRequestError('each corrected call is {"name": <tool>, "arguments": {...}}')
                problem = self.toolbox.check(c.get("name"), c.get("arguments", {}))
                if problem:
                    raise InvalidRequestError(f"the corrected call cannot run: {problem}")
            for cid in t.call_ids:   # the model's own calls of this turn are replaced: none of them runs
                old = self.calls[cid]
                old.status, old.reason, old.result = "replaced", "replaced by the user's correction", None
                self._emit("tool_replaced", call=old.to_dict())
            t.replaced_ids, t.call_ids = t.replaced_ids + t.call_ids, []
            t.content, t.corrected = content, True
            new = []
            for c in calls:
                call = ToolCall(f"{self.id}-{next(self._ids)}", index, c["name"], c.get("arguments", {}),
                                "", source="user", edited=True)
                self._bind(call, None)
                self.calls[call.id] = call
                t.call_ids.append(call.id)
                new.append(call)
            if self.state == "done":
                self.final = None
            self._emit("agent_turn_corrected", step=index, text=self.turn_text(t),
                       calls=[self.calls[cid].to_dict() for cid in t.call_ids])
            for call in new:
                self._execute(call)
            self._after_calls(t)
            return new

    def _execute(self, call: ToolCall) -> None:
        call.status = "running"
        self._emit("tool_running", call=call.to_dict())
        result = self.mcp.call_tool(call.server, call.tool, call.arguments)
        text = result.text if not result.is_error else f"Error: {result.text}"
        call.result, call.result_cut = cut_to_tokens(self.llm.tokenizer, text, self.result_tokens)
        call.output = result.to_dict()
        call.status = "error" if result.is_error else "done"
        self._emit("tool_result", call=call.to_dict())

    # --- driving ---
    def advance(self) -> list[ToolCall]:
        """Step until the run needs the user (returns the pending calls) or is finished (returns []): what a
        websocket handler calls after the task arrives and after each approve / reject / correction."""
        while self.state == "ready":
            pending = self.step()
            if pending:
                return pending
        return self.pending()

    async def aadvance(self) -> list[ToolCall]:
        return await asyncio.to_thread(self.advance)

    def run(self, approve: Callable[[ToolCall], dict | bool | None] | None = None) -> str | None:
        """Drive to the end in this thread. `approve(call)` returns True (run it), False (reject), or an edit dict;
        without it, pending calls stop the run in awaiting_approval. Returns the final answer (or None)."""
        while self.state not in FINISHED:
            pending = self.step() if self.state == "ready" else self.pending()
            if self.state == "awaiting_approval":
                if approve is None:
                    return None
                for call in pending:
                    decision = approve(call)
                    if decision is True or decision is None:
                        self.approve(call.id)
                    elif decision is False:
                        self.reject(call.id)
                    else:
                        self.approve(call.id, decision)
        return self.final

    def cancel(self) -> None:
        """Stop the run: a turn being generated is aborted and nothing more runs."""
        self._cancelled = True
        rid = self._request_id
        if rid is not None:
            self.llm.abort(rid)
        with self._lock:
            for call in self.pending():
                call.status, call.reason = "rejected", "the run was cancelled"
            self._set_state("cancelled")

    async def astep(self) -> list[ToolCall]:
        return await asyncio.to_thread(self.step)

    async def aapprove(self, call_id: str, edited: dict | None = None) -> ToolCall:
        return await asyncio.to_thread(self.approve, call_id, edited)

    async def areject(self, call_id: str, reason: str = "") -> ToolCall:
        return await asyncio.to_thread(self.reject, call_id, reason)

    async def acorrect_turn(self, calls: list[dict], content: str = "", turn: int | None = None) -> list[ToolCall]:
        return await asyncio.to_thread(self.correct_turn, calls, content, turn)

    def to_dict(self) -> dict:
        """A snapshot for a client (no secrets: tool schemas and results only)."""
        return {"id": self.id, "task": self.task, "state": self.state, "servers": self.servers, "adapter": self.adapter,
                "learn_adapter": self.learn_adapter if self.servers else None, "native_tools": self.native_tools,
                "final": self.final, "error": self.error, "steps": len(self.turns), "max_steps": self.max_steps,
                "turns": [{"index": t.index, "text": t.text, "content": t.content, "corrected": t.corrected,
                           "calls": [self.calls[c].to_dict() for c in t.call_ids]} for t in self.turns]}
