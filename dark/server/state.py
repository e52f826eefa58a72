"""What the app holds: the one OnlineLLM, its store, settings, metrics and the open connections."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..errors import InvalidRequestError, UnknownAdapterError
from .learning import JobHub, Learning
from .metrics import Metrics
from .protocol import Sampling
from .settings import ServerSettings

log = logging.getLogger(__name__)


@dataclass
class AppState:
    llm: Any
    store: Any
    settings: ServerSettings
    metrics: Metrics
    hub: JobHub
    learning: Learning
    owns_store: bool = False
    connections: set = field(default_factory=set)
    loop: asyncio.AbstractEventLoop | None = None
    agent: Any = None               # the AgentService (MCP servers and agent runs), from the app's lifespan

    @property
    def model_name(self) -> str:
        return str(getattr(self.llm, "model_name", "") or "base")

    def resolve_adapter(self, name: str | None) -> tuple[str | None, str | None]:
        """(adapter to run in the engine, adapter to report). A created adapter without a trained version yet
        answers as the base model and is reported as version 0."""
        if not name:
            return None, None
        if name in self.learning.engine_names():
            return name, name
        if self.learning.known(name):
            return None, name
        known = sorted(a.name for a in self.learning.list_adapters())
        raise UnknownAdapterError(f"unknown adapter {name!r}; known adapters: {', '.join(known) or 'none yet'} "
                                  "(create one first, or leave adapter out for the base model)")

    def sampling_args(self, sampling: Sampling | None) -> dict:
        """Engine sampling arguments with the server's defaults and caps applied."""
        args = sampling.engine_args() if sampling else {}
        limit = self.settings.max_tokens
        args.setdefault("max_tokens", min(self.settings.default_max_tokens, limit))
        if args["max_tokens"] > limit:
            raise InvalidRequestError(f"max_tokens {args['max_tokens']} is above this server's limit of {limit}; "
                                      "ask for fewer")
        return args

    def queue_depth(self) -> tuple[int, int]:
        """(waiting, running) sequences in the engine; read without the engine's lock, so approximate."""
        sched = getattr(getattr(self.llm, "engine", None), "scheduler", None)
        if sched is None:
            return 0, 0
        return len(getattr(sched, "waiting", ())), len(getattr(sched, "running", ()))


def get_state(request: Request) -> AppState:
    return request.app.state.dark
