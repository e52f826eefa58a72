"""Conversations: store the user's turn, generate the reply, store it; and turn corrections into learn jobs.

The store is synchronous (every write is fsynced), so its calls run in a worker thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import InvalidRequestError
from .generation import Generation
from .protocol import AdapterRef, Chat, Correct, Done, Regenerate, Usage
from .state import AppState

log = logging.getLogger(__name__)

TITLE_CHARS = 80


@dataclass
class Turn:
    """What one chat or regenerate will answer, once its user turn is stored."""

    conversation_id: str
    user_message_id: str | None
    parent_id: str
    prompt: list[dict]


def _prompt(history: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in history]


def _title(content: str) -> str:
    line = content.strip().splitlines()[0] if content.strip() else "conversation"
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class ChatService:
    def __init__(self, state: AppState):
        self.state = state
        self.store = state.store

    # --- preparing a turn (blocking store calls, run in a thread) ---
    def _chat_turn(self, msg: Chat) -> Turn:
        store = self.store
        if msg.conversation_id is None:
            conv = store.create_conversation(title=_title(msg.content), adapter=msg.adapter)
            parent = None
            if msg.system:
                parent = store.add_message(conv["id"], "system", msg.system)["id"]
        else:
            if msg.system is not None:
                raise InvalidRequestError("system is only for a new conversation; leave conversation_id out to start one")
            conv = store.get_conversation(msg.conversation_id)
            parent = msg.parent_id
            if parent is None:
                messages = store.list_messages(conv["id"])
                parent = messages[-1]["id"] if messages else None
        user = store.add_message(conv["id"], "user", msg.content, parent_id=parent)
        return Turn(conv["id"], user["id"], user["id"], _prompt(store.history_until(user["id"])))

    def _regenerate_turn(self, msg: Regenerate) -> tuple[Turn, str | None]:
        target = self.store.get_message(msg.message_id)
        if target["role"] != "assistant":
            raise InvalidRequestError(f"regenerate takes the id of an assistant reply; {msg.message_id} is a "
                                      f"{target['role']} message")
        history = self.store.history_until(target["id"])[:-1]
        if not history:
            raise InvalidRequestError("that reply answers nothing: there is no earlier message to answer again")
        parent = history[-1]
        return Turn(target["conversation_id"], None, parent["id"], _prompt(history)), target.get("adapter")

    async def chat_turn(self, msg: Chat) -> Turn:
        if msg.parent_id is not None and msg.conversation_id is None:
            raise InvalidRequestError("parent_id needs the conversation_id it belongs to")
        return await asyncio.to_thread(self._chat_turn, msg)

    async def regenerate_turn(self, msg: Regenerate) -> tuple[Turn, str | None]:
        """The turn, and the adapter the replaced reply came from (the default for the new one)."""
        return await asyncio.to_thread(self._regenerate_turn, msg)

    # --- generating ---
    async def answer(self, turn: Turn, adapter: str | None, args: dict, gen: Generation,
                     on_token: Callable[[str], None], source: str = "ws") -> Done:
        """Generate the reply to a prepared turn, calling on_token with each piece, and store it."""
        engine_adapter, reported = await asyncio.to_thread(self.state.resolve_adapter, adapter)
        # a conversation longer than the context window keeps its latest turns (and its system prompt)
        prompt, dropped = await asyncio.to_thread(self._fit, turn.prompt, args.get("max_tokens", 0))
        started = time.monotonic()
        await gen.start(prompt, engine_adapter, args)
        async for out in gen.outputs():
            if out.error is not None:
                raise out.error
            if out.delta:
                on_token(out.delta)
        seconds = time.monotonic() - started
        final = gen.final
        if final is not None:
            text, reason = final.text, final.finish_reason or "stop"
            prompt_tokens, completion_tokens = final.prompt_tokens, final.completion_tokens
            ref = AdapterRef(name=final.adapter[0], version=final.adapter[1]) if final.adapter else None
        else:  # stopped before the engine had it
            text, reason, prompt_tokens, completion_tokens, ref = "", "abort", 0, 0, None
        if ref is None and reported:
            ref = AdapterRef(name=reported, version=0)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens, seconds=round(seconds, 4),
                      tokens_per_second=round(completion_tokens / seconds, 2) if seconds > 0 else 0.0)
        stored = await asyncio.to_thread(
            self.store.add_message, turn.conversation_id, "assistant", text, parent_id=turn.parent_id,
            adapter=ref.name if ref else None, adapter_version=ref.version if ref else None, finish_reason=reason,
            meta={"usage": usage.model_dump(), **({"context_dropped": dropped} if dropped else {})})
        self.state.metrics.generation(source, reason, prompt_tokens, completion_tokens)
        return Done(conversation_id=turn.conversation_id, message_id=stored["id"], parent_id=turn.parent_id,
                    text=text, finish_reason=reason, adapter=ref, usage=usage, context_dropped=dropped)

    def _fit(self, messages: list[dict], reply_tokens: int) -> tuple[list[dict], int]:
        fit = getattr(self.state.llm, "fit_conversation", None)
        return fit(messages, reply_tokens) if fit is not None else (messages, 0)

    # --- corrections ---
    def _correct(self, msg: Correct) -> dict:
        learning = self.state.learning
        learning.require("submit_learn")  # fail before touching the message when this server cannot learn
        target = self.store.get_message(msg.message_id)
        if target["role"] != "assistant":
            raise InvalidRequestError(f"only assistant replies can be corrected; {msg.message_id} is a "
                                      f"{target['role']} message")
        adapter = msg.adapter or target.get("adapter")
        if not adapter:
            raise InvalidRequestError("this reply came from the base model: name the adapter (skill) that should "
                                      "learn the correction in \"adapter\"")
        old = target["content"]
        if msg.content == old:
            raise InvalidRequestError("the correction is the same as the reply; change the text first")
        history = self.store.history_until(target["id"])[:-1]
        # taught with the latest turns that fit the context window, as the reply was answered from them
        example = {"messages": self._fit(_prompt(history) + [{"role": "assistant", "content": msg.content}], 0)[0]}
        kind = msg.kind or self.state.settings.correction_kind
        if old.strip():
            example["rejected"] = old
        else:
            kind = "sft"  # an empty (stopped) reply is nothing to prefer against
        # the example and its job first (one transaction): a correction that cannot be queued leaves the reply as
        # it was, and once the reply shows the correction, its job is on disk
        queued = learning.submit([example], adapter, kind=kind, source="correction", message_id=target["id"])
        self.store.update_message_content(target["id"], msg.content,
                                          meta={**(target.get("meta") or {}), "corrected": True})
        return queued

    async def correct(self, msg: Correct) -> dict:
        """Update the stored reply and queue the learn job; returns {"job_id", "adapter", "state"}."""
        return await asyncio.to_thread(self._correct, msg)

    # --- reading ---
    def history(self, conversation_id: str) -> tuple[dict, list[dict]]:
        """A conversation and its messages along the latest branch (blocking)."""
        conv = self.store.get_conversation(conversation_id)
        messages = self.store.list_messages(conversation_id)
        branch = self.store.history_until(messages[-1]["id"]) if messages else []
        for m in branch:  # the latest rating counts
            ratings = self.store.list_feedback(m["id"])
            m["feedback"] = ratings[-1]["rating"] if ratings else None
        return conv, branch
