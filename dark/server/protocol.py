"""The websocket protocol: one pydantic model per message, in each direction. See docs/protocol.md.

Client messages form a union discriminated on "type"; every one carries the client's own `id`, which the
server echoes on everything it sends about that request. Server messages not caused by a request (hello,
adapter updates) carry id null.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
SUBPROTOCOL = "dark.v1"          # offered by browsers, with the key as a second "bearer.<base64url>" entry
KEY_SUBPROTOCOL_PREFIX = "bearer."

RequestId = Union[Annotated[str, StringConstraints(min_length=1, max_length=128)], int]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
ObjectId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Text = Annotated[str, StringConstraints(min_length=1)]


class Sampling(BaseModel):
    """How to pick tokens; absent fields take the server's defaults (greedy, default_max_tokens)."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=5)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: list[Annotated[str, StringConstraints(min_length=1)]] | None = Field(None, max_length=16)
    seed: int | None = None

    def engine_args(self) -> dict:
        return self.model_dump(exclude_none=True)


# ---- client -> server ------------------------------------------------------------------------------------


class ClientMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: RequestId


class Chat(ClientMessage):
    """Say something; the reply streams back as token frames and ends with done."""

    type: Literal["chat"]
    content: Text
    conversation_id: ObjectId | None = None   # none: a new conversation
    parent_id: ObjectId | None = None         # the message this one answers; none: the conversation's last
    adapter: Name | None = None               # none: the base model
    system: str | None = None                 # a system prompt for a new conversation
    sampling: Sampling | None = None


class Regenerate(ClientMessage):
    """Answer again the user turn before an assistant message; the new reply is its sibling."""

    type: Literal["regenerate"]
    message_id: ObjectId
    adapter: Name | None = None
    sampling: Sampling | None = None


class Stop(ClientMessage):
    """End the generation whose request has this id; its done frame says finish_reason "abort"."""

    type: Literal["stop"]


class Correct(ClientMessage):
    """Replace an assistant reply and learn from it: the conversation up to it plus this content."""

    type: Literal["correct"]
    message_id: ObjectId
    content: Text
    adapter: Name | None = None               # none: the adapter the reply came from
    kind: Literal["preference", "sft"] | None = None


class Learn(ClientMessage):
    type: Literal["learn"]
    adapter: Name
    examples: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)
    kind: Literal["sft", "preference", "unlearn"] = "sft"


class Feedback(ClientMessage):
    type: Literal["feedback"]
    message_id: ObjectId
    rating: Literal[1, -1]
    comment: str | None = Field(None, max_length=10_000)


class ListAdapters(ClientMessage):
    type: Literal["adapters"]


class CreateAdapter(ClientMessage):
    type: Literal["create_adapter"]
    name: Name
    r: int = Field(16, ge=1, le=256)
    alpha: float | None = Field(None, gt=0)


class Rollback(ClientMessage):
    """Make an older version current; with no version, undo the last published one."""

    type: Literal["rollback"]
    adapter: Name
    version: int | None = Field(None, ge=0)


class DeleteAdapter(ClientMessage):
    type: Literal["delete_adapter"]
    adapter: Name


class ListConversations(ClientMessage):
    type: Literal["conversations"]
    limit: int = Field(100, ge=1, le=1000)


class History(ClientMessage):
    """The messages of a conversation along its latest branch, oldest first."""

    type: Literal["history"]
    conversation_id: ObjectId


class DeleteConversation(ClientMessage):
    type: Literal["delete_conversation"]
    conversation_id: ObjectId


class WatchJob(ClientMessage):
    """Get a learn job's events so far and those to come (after a reconnect, say)."""

    type: Literal["watch"]
    job_id: ObjectId


class Ping(ClientMessage):
    type: Literal["ping"]


# ---- the agent: MCP servers and tool-using runs (additions to v1) ----

ServerName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,59}$")]
RunId = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class ListMCPServers(ClientMessage):
    """The MCP servers: redacted config, status and tools with their schemas (never a secret)."""

    type: Literal["mcp_servers"]


class AddMCPServer(ClientMessage):
    """Start a server (an entry of the usual "mcpServers" JSON) and save it; answers once it is ready or failed."""

    type: Literal["mcp_add_server"]
    name: ServerName
    config: dict[str, Any]


class RemoveMCPServer(ClientMessage):
    type: Literal["mcp_remove_server"]
    name: ServerName


class RestartMCPServer(ClientMessage):
    type: Literal["mcp_restart_server"]
    name: ServerName


class MCPAutoApprove(ClientMessage):
    """Let a server's tools (all, or the listed ones) run without asking; false asks again for every call."""

    type: Literal["mcp_auto_approve"]
    name: ServerName
    value: bool | list[Annotated[str, StringConstraints(min_length=1, max_length=200)]]


class AgentTask(ClientMessage):
    """Start an agent run: the model works on the task with the servers' tools; its events carry this id."""

    type: Literal["agent"]
    content: Text
    servers: list[ServerName] | None = None   # none: every ready server
    conversation_id: ObjectId | None = None   # its messages (latest branch) come before the task
    adapter: Name | None = None               # absent: the first server's skill (mcp-<server>) when it exists
    system: str | None = Field(None, max_length=100_000)
    max_steps: int = Field(8, ge=1, le=64)
    result_tokens: int = Field(1024, ge=16, le=32_768)
    sampling: Sampling | None = None


class AgentApprove(ClientMessage):
    """Run a proposed call, as written or edited ({"name"?, "arguments"?})."""

    type: Literal["agent_approve"]
    call_id: RunId
    run_id: RunId | None = None               # none: taken from the call id ("<run>-<n>")
    edited: dict[str, Any] | None = None


class AgentReject(ClientMessage):
    type: Literal["agent_reject"]
    call_id: RunId
    run_id: RunId | None = None
    reason: str = Field("", max_length=10_000)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    arguments: dict[str, Any] = Field(default_factory=dict)


class AgentCorrectTurn(ClientMessage):
    """Replace the model's latest turn (no call, or the wrong ones) with these calls; they run at once."""

    type: Literal["agent_correct_turn"]
    run_id: RunId
    calls: list[ToolCallIn] = Field(min_length=1, max_length=32)
    content: str = Field("", max_length=100_000)


class AgentStop(ClientMessage):
    type: Literal["agent_stop"]
    run_id: RunId


class AgentLearn(ClientMessage):
    """Teach the run's tool skill (mcp-<server>) its corrected calls; answers with job frames."""

    type: Literal["agent_learn"]
    run_id: RunId
    call_ids: list[RunId] | None = Field(None, max_length=256)   # none: every corrected turn
    include_approved: bool = False                               # also teach calls approved as proposed


AnyClientMessage = Annotated[
    Union[Chat, Regenerate, Stop, Correct, Learn, Feedback, ListAdapters, CreateAdapter, Rollback, DeleteAdapter,
          ListConversations, History, DeleteConversation, WatchJob, Ping, ListMCPServers, AddMCPServer,
          RemoveMCPServer, RestartMCPServer, MCPAutoApprove, AgentTask, AgentApprove, AgentReject, AgentCorrectTurn,
          AgentStop, AgentLearn],
    Field(discriminator="type"),
]
CLIENT_TYPES = ("chat", "regenerate", "stop", "correct", "learn", "feedback", "adapters", "create_adapter",
                "rollback", "delete_adapter", "conversations", "history", "delete_conversation", "watch", "ping",
                "mcp_servers", "mcp_add_server", "mcp_remove_server", "mcp_restart_server", "mcp_auto_approve",
                "agent", "agent_approve", "agent_reject", "agent_correct_turn", "agent_stop", "agent_learn")
_client = TypeAdapter(AnyClientMessage)


# ---- server -> client ------------------------------------------------------------------------------------


class ServerMessage(BaseModel):
    id: RequestId | None = None


class AdapterRef(BaseModel):
    name: str
    version: int  # 0: the adapter has no trained version yet, so the base model answered


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    seconds: float
    tokens_per_second: float


class Hello(ServerMessage):
    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    server: str
    model: str
    learning: bool                  # whether this server can learn (correct/learn work)
    limits: dict[str, Any]


class Started(ServerMessage):
    """A chat or regenerate was accepted: where its reply will be stored."""

    type: Literal["started"] = "started"
    conversation_id: str
    user_message_id: str | None     # the stored user turn (none for regenerate)
    parent_id: str | None           # what the reply answers


class Token(ServerMessage):
    type: Literal["token"] = "token"
    text: str


class Done(ServerMessage):
    type: Literal["done"] = "done"
    conversation_id: str
    message_id: str
    parent_id: str | None
    text: str
    finish_reason: str              # stop | length | abort | error
    adapter: AdapterRef | None
    usage: Usage
    context_dropped: int = 0        # earlier messages left out: the conversation is longer than the context window


class Job(ServerMessage):
    """One learn job event. state: queued -> running (many) -> done | failed."""

    type: Literal["job"] = "job"
    job_id: str
    adapter: str
    state: str
    message_id: str | None = None   # the corrected message, for jobs that came from a correction
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    version: int | None = None
    verified: bool | None = None
    report: dict[str, Any] | None = None
    error: str | None = None


class AdapterVersion(BaseModel):
    version: int
    created_at: float | None = None
    verified: bool | None = None
    loss: float | None = None
    report: dict[str, Any] | None = None


class AdapterInfo(BaseModel):
    name: str
    version: int                    # the current version; 0 while none is trained
    versions: list[AdapterVersion]


class Adapters(ServerMessage):
    type: Literal["adapters"] = "adapters"
    adapters: list[AdapterInfo]


class Conversations(ServerMessage):
    type: Literal["conversations"] = "conversations"
    conversations: list[dict[str, Any]]


class HistoryReply(ServerMessage):
    type: Literal["history"] = "history"
    conversation: dict[str, Any]
    messages: list[dict[str, Any]]


class Ack(ServerMessage):
    """A request without a richer answer (feedback, delete_conversation) succeeded."""

    type: Literal["ack"] = "ack"
    request: str
    data: dict[str, Any] | None = None


class Pong(ServerMessage):
    type: Literal["pong"] = "pong"


class MCPServers(ServerMessage):
    """Every MCP server by name: {"config": <redacted>, "status": {...}, "tools": [{name, description,
    input_schema, ...}]}."""

    type: Literal["mcp_servers"] = "mcp_servers"
    servers: dict[str, Any]


class AgentEvent(ServerMessage):
    """One event of an agent run or an MCP server (agent_started, agent_state, agent_delta, agent_turn,
    tool_running, tool_result, tool_rejected, tool_call_edited, tool_replaced, agent_turn_corrected,
    agent_final, agent_error, mcp_status): the AgentService's event dict as it is, with the request's id."""

    model_config = ConfigDict(extra="allow")
    type: str


class Error(ServerMessage):
    type: Literal["error"] = "error"
    code: str
    message: str


# ---- parsing ---------------------------------------------------------------------------------------------


class FrameError(Exception):
    """A frame that is not a valid client message; becomes an error frame, never a closed socket."""

    def __init__(self, code: str, message: str, request_id: Any = None):
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


def _echo_id(raw: Any) -> RequestId | None:
    rid = raw.get("id") if isinstance(raw, dict) else None
    if isinstance(rid, bool):
        return None
    if isinstance(rid, int) or (isinstance(rid, str) and 0 < len(rid) <= 128):
        return rid
    return None


def request_id_of(data: str | bytes) -> RequestId | None:
    """The id of a frame, when it has a usable one, without validating the rest."""
    try:
        return _echo_id(json.loads(data))
    except (ValueError, UnicodeDecodeError):
        return None


def describe(e: ValidationError) -> str:
    """Pydantic's errors as one line a person can act on: `field.path: what is wrong`."""
    parts = []
    for err in e.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in err["loc"][1:] if p != "function-after") or "message"  # [0] is the type tag
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "is not a field of this message"
        parts.append(f"{loc}: {msg}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_client_message(data: str | bytes) -> ClientMessage:
    """One frame -> a client message, or FrameError saying what was wrong with it."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FrameError("bad_json", f"the frame is not JSON ({e}); send one JSON object per frame") from None
    if not isinstance(raw, dict):
        raise FrameError("bad_frame", f"a frame must be a JSON object with a \"type\", got {type(raw).__name__}")
    rid = _echo_id(raw)
    kind = raw.get("type")
    if kind not in CLIENT_TYPES:
        raise FrameError("unknown_type", f"unknown message type {kind!r:.40}; known: {', '.join(CLIENT_TYPES)}", rid)
    if "id" not in raw:
        raise FrameError("bad_frame", f"a {kind} message needs an \"id\" (a string or integer you choose)", rid)
    try:
        return _client.validate_python(raw)
    except ValidationError as e:
        raise FrameError("bad_frame", f"invalid {kind} message: {describe(e)}", rid) from None
