"""What the server holds for the agent: one MCPManager and the live agent runs, with async calls that map one to
one onto websocket messages and REST routes.

    agent = AgentService(llm, data_dir / "mcp.json")
    run = agent.start_run(task, servers=["time"], on_event=send)   # send(event) is called from worker threads
    pending = await agent.advance(run.id)                            # the model works until it needs the user
    await agent.approve(run.id, call_id, edited={"arguments": {...}})
    await agent.advance(run.id)                                      # ... until run.state is "done"
    job = agent.learn(run.id)                                        # teach mcp-<server> the corrected calls

Events and snapshots carry no secrets (tool schemas, calls and results only); server configs reach clients
through public_view() alone.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from ..errors import InvalidRequestError
from .learning import learn_from_run
from .loop import AgentRun, ToolCall
from .mcp_client import MCPManager

log = logging.getLogger(__name__)


class AgentService:
    def __init__(self, llm, config: str | Path | dict | None = None, *, max_runs: int = 200,
                 on_server_event: Callable[[dict], None] | None = None):
        self.llm = llm
        self.mcp = MCPManager(config, on_event=on_server_event, wait=False)
        self.runs: OrderedDict[str, AgentRun] = OrderedDict()
        self.max_runs = max_runs

    # --- servers ---
    def public_view(self) -> dict:
        return self.mcp.public_view()

    async def add_server(self, name: str, config: dict, save: bool = True) -> dict:
        return await self.mcp.add_server_async(name, config, save=save and self.mcp.config_path is not None)

    async def remove_server(self, name: str, save: bool = True) -> None:
        await self.mcp.remove_server_async(name, save=save and self.mcp.config_path is not None)

    async def restart_server(self, name: str) -> dict:
        return await asyncio.to_thread(self.mcp.restart_server, name)

    def set_auto_approve(self, name: str, value: bool | list[str], save: bool = True) -> dict:
        return self.mcp.set_auto_approve(name, value, save=save and self.mcp.config_path is not None)

    # --- runs ---
    def start_run(self, task: str, *, servers: list[str] | None = None, on_event: Callable[[dict], None] | None = None,
                  **options) -> AgentRun:
        """A new run (nothing generated yet: call advance). options: adapter, system, history, max_steps,
        result_tokens, max_tokens, sampling (see AgentRun)."""
        run = AgentRun(self.llm, self.mcp, task, servers=servers, on_event=on_event, **options)
        self.runs[run.id] = run
        while len(self.runs) > self.max_runs:   # forget the oldest finished runs
            old = next((rid for rid, r in self.runs.items() if r.state in ("done", "max_steps", "cancelled", "failed")), None)
            if old is None:
                break
            self.runs.pop(old)
        return run

    def get_run(self, run_id: str) -> AgentRun:
        run = self.runs.get(run_id)
        if run is None:
            raise InvalidRequestError(f"no agent run {run_id!r} (finished runs are forgotten after {self.max_runs})")
        return run

    async def advance(self, run_id: str) -> list[ToolCall]:
        return await self.get_run(run_id).aadvance()

    async def approve(self, run_id: str, call_id: str, edited: dict | None = None) -> ToolCall:
        return await self.get_run(run_id).aapprove(call_id, edited)

    async def reject(self, run_id: str, call_id: str, reason: str = "") -> ToolCall:
        return await self.get_run(run_id).areject(call_id, reason)

    async def correct_turn(self, run_id: str, calls: list[dict], content: str = "") -> list[ToolCall]:
        return await self.get_run(run_id).acorrect_turn(calls, content)

    def cancel(self, run_id: str) -> None:
        self.get_run(run_id).cancel()

    def learn(self, run_id: str, *, call_ids: list[str] | None = None, include_approved: bool = False,
              on_event: Callable[[dict], None] | None = None, **learn_settings):
        """Queue a learn job with the run's corrections on its tool adapter; returns the LearnJob at once."""
        return learn_from_run(self.llm, self.get_run(run_id), call_ids=call_ids, include_approved=include_approved,
                              on_event=on_event, **learn_settings)

    def close(self) -> None:
        for run in self.runs.values():
            if run.state not in ("done", "max_steps", "cancelled", "failed"):
                run.cancel()
        self.mcp.close()
