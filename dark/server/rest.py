"""REST under /api: conversations, feedback, learning, adapters (with PEFT zip download), jobs; and /health,
/metrics. Everything but /health needs the API key when one is set."""
from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import FileResponse, PlainTextResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from .. import __version__
from .chat import ChatService
from ..errors import DarkError
from .protocol import PROTOCOL_VERSION, AdapterInfo, AdapterVersion, Name, ServerName
from .security import check_http_key
from .state import AppState, get_state

log = logging.getLogger(__name__)
public = APIRouter()
api = APIRouter(prefix="/api", dependencies=[Depends(check_http_key)])
metrics_router = APIRouter(dependencies=[Depends(check_http_key)])


class LearnRequest(BaseModel):
    adapter: Name
    examples: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)
    kind: Literal["sft", "preference", "unlearn"] = "sft"
    wait: bool = Field(False, description="answer when the job is done, with its report")


class FeedbackRequest(BaseModel):
    rating: Literal[1, -1]
    comment: str | None = Field(None, max_length=10_000)


class CreateAdapterRequest(BaseModel):
    name: Name
    r: int = Field(16, ge=1, le=256)
    alpha: float | None = Field(None, gt=0)


class RollbackRequest(BaseModel):
    version: int | None = Field(None, ge=0, description="none: undo the last published version")


@public.get("/health")
async def health(state: AppState = Depends(get_state)) -> dict:
    """Liveness for load balancers and the UI; public, so it says nothing but what a login page would."""
    return {"status": "ok", "protocol": PROTOCOL_VERSION, "auth_required": state.settings.key is not None}


@api.get("/info")
async def info(state: AppState = Depends(get_state)) -> dict:
    return {"server": f"dark {__version__}", "protocol": PROTOCOL_VERSION, "model": state.model_name,
            "learning": state.learning.available, "limits": state.settings.public_limits()}


# --- conversations ---
@api.get("/conversations")
async def conversations(limit: int = Query(100, ge=1, le=1000), state: AppState = Depends(get_state)) -> list[dict]:
    return await asyncio.to_thread(state.store.list_conversations, limit)


@api.get("/conversations/{conversation_id}")
async def conversation(conversation_id: str, state: AppState = Depends(get_state)) -> dict:
    conv, messages = await asyncio.to_thread(ChatService(state).history, conversation_id)
    return {"conversation": conv, "messages": messages}


@api.delete("/conversations/{conversation_id}", status_code=204)
async def delete_conversation(conversation_id: str, state: AppState = Depends(get_state)) -> None:
    await asyncio.to_thread(state.store.delete_conversation, conversation_id)


@api.post("/messages/{message_id}/feedback", status_code=201)
async def feedback(message_id: str, body: FeedbackRequest, state: AppState = Depends(get_state)) -> dict:
    return await asyncio.to_thread(state.store.add_feedback, message_id, body.rating, body.comment)


# --- learning ---
@api.post("/learn", status_code=202)
async def learn(body: LearnRequest, response: Response, state: AppState = Depends(get_state)) -> dict:
    """202 with the queued job's id; with wait, 200 and the finished job's report."""
    if body.wait:
        response.status_code = 200
        return await asyncio.to_thread(state.learning.learn, body.examples, body.adapter, body.kind, "api")
    queued = await asyncio.to_thread(state.learning.submit, body.examples, body.adapter, body.kind, "api")
    return {k: queued[k] for k in ("job_id", "adapter", "state")}


@api.get("/jobs/{job_id}")
async def job(job_id: str, state: AppState = Depends(get_state)) -> dict:
    return await asyncio.to_thread(state.learning.job, job_id)


# --- adapters ---
@api.get("/adapters")
async def adapters(state: AppState = Depends(get_state)) -> list[AdapterInfo]:
    return await asyncio.to_thread(state.learning.list_adapters)


@api.post("/adapters", status_code=201)
async def create_adapter(body: CreateAdapterRequest, state: AppState = Depends(get_state)) -> AdapterInfo:
    await asyncio.to_thread(state.learning.create, body.name, body.r, body.alpha)
    return await asyncio.to_thread(state.learning.info, body.name)


@api.get("/adapters/{name}")
async def adapter(name: str, state: AppState = Depends(get_state)) -> AdapterInfo:
    return await asyncio.to_thread(state.learning.info, name)


@api.get("/adapters/{name}/versions")
async def adapter_versions(name: str, state: AppState = Depends(get_state)) -> list[AdapterVersion]:
    return (await asyncio.to_thread(state.learning.info, name)).versions


@api.post("/adapters/{name}/rollback")
async def rollback(name: str, body: RollbackRequest, state: AppState = Depends(get_state)) -> AdapterInfo:
    await asyncio.to_thread(state.learning.rollback, name, body.version)
    return await asyncio.to_thread(state.learning.info, name)


@api.delete("/adapters/{name}", status_code=204)
async def delete_adapter(name: str, state: AppState = Depends(get_state)) -> None:
    await asyncio.to_thread(state.learning.delete, name)


def _zip_folder(folder: Path, name: str) -> Path:
    if not folder.is_dir():
        raise FileNotFoundError(f"the adapter folder {folder.name} is missing on the server")
    fd, tmp = tempfile.mkstemp(prefix=f"dark-{name}-", suffix=".zip")
    os.close(fd)
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, Path(name) / f.relative_to(folder))
    return Path(tmp)


@api.get("/adapters/{name}/download")
async def download(name: str, version: int | None = Query(None, ge=1),
                   state: AppState = Depends(get_state)) -> FileResponse:
    """The adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors) in a zip."""
    folder = await asyncio.to_thread(state.learning.path, name, version)
    label = f"{name}-v{version}" if version else name
    zipped = await asyncio.to_thread(_zip_folder, folder, label)
    return FileResponse(zipped, media_type="application/zip", filename=f"{label}.zip",
                        background=BackgroundTask(os.unlink, zipped))


# --- MCP servers (the agent's tools) ---
class AddMCPServerRequest(BaseModel):
    name: ServerName
    config: dict[str, Any] = Field(description="one entry of the usual mcpServers JSON: command/args/env or url/headers")


class AutoApproveRequest(BaseModel):
    value: bool | list[str]


def _agent(state: AppState):
    if state.agent is None:
        raise DarkError("the agent is not running (the server is starting or stopping); try again")
    return state.agent


@api.get("/mcp/servers")
async def mcp_servers(state: AppState = Depends(get_state)) -> dict:
    """{"mcpServers": {name: {"config": <secrets as ***>, "status": {...}, "tools": [...]}}}"""
    return _agent(state).public_view()


@api.post("/mcp/servers", status_code=201)
async def add_mcp_server(body: AddMCPServerRequest, state: AppState = Depends(get_state)) -> dict:
    """Start and save a server; answers once it is ready or failed, with its public view."""
    agent = _agent(state)
    await agent.add_server(body.name, body.config)
    return agent.public_view()["mcpServers"][body.name]


@api.delete("/mcp/servers/{name}", status_code=204)
async def remove_mcp_server(name: str, state: AppState = Depends(get_state)) -> None:
    await _agent(state).remove_server(name)


@api.post("/mcp/servers/{name}/restart")
async def restart_mcp_server(name: str, state: AppState = Depends(get_state)) -> dict:
    agent = _agent(state)
    await agent.restart_server(name)
    return agent.public_view()["mcpServers"][name]


@api.post("/mcp/servers/{name}/auto_approve")
async def auto_approve_mcp_server(name: str, body: AutoApproveRequest, state: AppState = Depends(get_state)) -> dict:
    agent = _agent(state)
    await asyncio.to_thread(agent.set_auto_approve, name, body.value)
    return agent.public_view()["mcpServers"][name]


# --- metrics ---
@metrics_router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: AppState = Depends(get_state)) -> PlainTextResponse:
    waiting, running = state.queue_depth()
    gauges = [("dark_queue_waiting", "Requests waiting for the engine", waiting, {}),
              ("dark_queue_running", "Requests the engine is generating", running, {})]
    try:
        for a in await asyncio.to_thread(state.learning.list_adapters):
            gauges.append(("dark_adapter_version", "Current version of each adapter", a.version, {"adapter": a.name}))
        jobs = await asyncio.to_thread(state.store.unfinished_jobs)
        for job_state in ("queued", "running"):
            gauges.append(("dark_learn_jobs", "Learn jobs not finished yet, by state",
                           sum(j["state"] == job_state for j in jobs), {"state": job_state}))
    except Exception:  # metrics must not fail because one source did
        log.exception("metrics: could not read adapters or jobs")
    return PlainTextResponse(state.metrics.render(gauges), media_type="text/plain; version=0.0.4")
