"""OpenAI-compatible routes under /v1: models (the base model and every adapter) and chat completions.

`model` names what answers: the base model's name (or "base"), an adapter's name, or "adapter@version" for one
version. Sampling is greedy unless temperature is given. Chats here are not stored as conversations.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError, PromptTooLongError, UnknownAdapterError
from .generation import Generation
from .protocol import Sampling
from .security import check_http_key
from .state import AppState, get_state

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", dependencies=[Depends(check_http_key)])
BASE_ALIASES = ("base", "default")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def openai_error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def plain(self) -> dict:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise OpenAIError(400, "only text content parts are supported", "messages")
            text = "".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields dark reads; others that OpenAI clients send are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


def resolve_model(state: AppState, model: str) -> tuple[str | None, int | None]:
    """(adapter, version) for a `model` value; (None, None) is the base model."""
    if model in (state.model_name, *BASE_ALIASES):
        return None, None
    name, _, version = model.partition("@")
    try:
        engine_name, _ = state.resolve_adapter(name)
    except UnknownAdapterError:
        raise OpenAIError(404, f"the model {model!r} does not exist: use {state.model_name!r} (the base model) or an "
                               "adapter listed by GET /v1/models", "model", "model_not_found") from None
    if engine_name is None:
        return None, None  # created but not trained yet: answers as the base model
    if version:
        if not version.isdigit():
            raise OpenAIError(400, f"in {model!r} the version after '@' must be a number", "model")
        return name, int(version)
    return name, None


def _sampling(state: AppState, req: ChatCompletionRequest) -> dict:
    if req.n != 1:
        raise OpenAIError(400, "n must be 1: dark returns one choice per request", "n")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    try:
        sampling = Sampling(max_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature,
                            top_p=req.top_p, top_k=req.top_k, stop=stop or None, seed=req.seed)
        return state.sampling_args(sampling)
    except InvalidRequestError as e:
        raise OpenAIError(400, str(e), "max_tokens") from None
    except ValueError as e:
        raise OpenAIError(400, f"invalid sampling values: {e}") from None


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


@router.get("/models")
async def list_models(state: AppState = Depends(get_state)) -> dict:
    created = int(state.metrics.started)
    data = [{"id": state.model_name, "object": "model", "created": created, "owned_by": "dark"}]
    adapters = await asyncio.to_thread(state.learning.list_adapters)
    for a in adapters:
        data.append({"id": a.name, "object": "model", "created": created, "owned_by": "dark",
                     "parent": state.model_name, "version": a.version})
    return {"object": "list", "data": data}


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: AppState = Depends(get_state)):
    adapter, version = await asyncio.to_thread(resolve_model, state, req.model)
    args = _sampling(state, req)
    if version is not None:
        args["adapter_version"] = version
    messages = [m.plain() for m in req.messages]
    gen = Generation(state.llm)
    try:
        await gen.start(messages, adapter, args)
    except PromptTooLongError as e:
        raise OpenAIError(400, str(e), "messages", "context_length_exceeded") from None
    except UnknownAdapterError as e:
        raise OpenAIError(404, str(e), "model", "model_not_found") from None
    except InvalidRequestError as e:
        raise OpenAIError(400, str(e)) from None
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, gen, cid, created, req.model, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    final = await _until_done(gen, request)
    if final.error is not None:
        raise OpenAIError(500, f"generation failed: {final.error}", type_="server_error")
    state.metrics.generation("openai", final.finish_reason or "stop", final.prompt_tokens, final.completion_tokens)
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": req.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": final.text},
                     "finish_reason": _finish(final.finish_reason), "logprobs": None}],
        "usage": _usage(final),
        "system_fingerprint": _fingerprint(final),
    }


def _usage(out) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def _fingerprint(out) -> str | None:
    return f"{out.adapter[0]}@{out.adapter[1]}" if out.adapter else None


async def _until_done(gen: Generation, request: Request):
    """The finished output; a client that hangs up stops the generation."""
    async def consume():
        async for _ in gen.outputs():
            pass
        return gen.final

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            gen.stop()
    return task.result()


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(state: AppState, gen: Generation, cid: str, created: int, model: str, include_usage: bool):
    def chunk(delta: dict, finish: str | None = None) -> str:
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for out in gen.outputs():  # leaving early (client gone) aborts the request
            if out.error is not None:
                yield _sse(OpenAIError(500, f"generation failed: {out.error}", type_="server_error").body())
                break
            if out.delta:
                yield chunk({"content": out.delta})
            if out.finished:
                state.metrics.generation("openai", out.finish_reason or "stop", out.prompt_tokens,
                                         out.completion_tokens)
                yield chunk({}, _finish(out.finish_reason))
                if include_usage:
                    yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": _usage(out)})
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        gen.stop()
        raise

