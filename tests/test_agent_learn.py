"""Learning tool use on the embedded SmolLM2 with the real mcp-server-time: one correction per task, and
afterwards the model makes the corrected call on its own, for the task and for a paraphrase of it."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mcp"))
from agent_helpers import time_server  # noqa: E402

from dark import OnlineLLM  # noqa: E402
from dark.agent import TOOL_LORA, AgentRun, MCPManager, example_for_call  # noqa: E402

pytestmark = pytest.mark.slow

TOKYO, TOKYO_PARAPHRASE = "What time is it in Tokyo right now?", "Tell me the current time in Tokyo."
PARIS, PARIS_PARAPHRASE = "What time is it in Paris right now?", "Tell me the current time in Paris."
TURN_TOKENS = 48      # a call is about 30 tokens; the base model's rambling answers are cut here


def first_calls(run: AgentRun) -> list[tuple[str | None, dict | None]]:
    return [(run.calls[c].name, run.calls[c].arguments) for c in run.turns[-1].call_ids]


def propose(llm, mcp, task) -> AgentRun:
    run = AgentRun(llm, mcp, task, servers=["time"], max_tokens=TURN_TOKENS)
    run.step()
    return run


def correct(run: AgentRun, right: dict):
    """What the user does in the UI: edit the model's call, or, when it made none, write the call in."""
    calls = [run.calls[c] for c in run.turns[-1].call_ids]
    if calls:
        fixed = run.approve(calls[0].id, edited=right)
        for other in calls[1:]:
            run.reject(other.id, "not needed")
        return fixed
    return run.correct_turn([right])[0]


def test_one_correction_teaches_the_call(tmp_path):
    mcp = MCPManager({"mcpServers": {"time": time_server()}})
    llm = OnlineLLM(data_dir=tmp_path / "data")
    timings = {}
    try:
        # 1. the base model has never used a tool: it answers "What time is it in Tokyo?" without calling one
        right = {"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}
        run = propose(llm, mcp, TOKYO)
        assert run.adapter is None and first_calls(run) != [(right["name"], right["arguments"])]
        fixed = correct(run, right)
        assert fixed.status == "done" and json.loads(fixed.result)["timezone"] == "Asia/Tokyo"   # it ran for real
        start = time.perf_counter()
        report = llm.learn([example_for_call(run, fixed)], adapter=run.learn_adapter, lora=TOOL_LORA, max_steps=80)
        timings["learn 1"] = (round(time.perf_counter() - start, 1), report["steps"])
        assert report["verified"] and run.learn_adapter == "mcp-time"

        for task in (TOKYO, TOKYO_PARAPHRASE):
            again = propose(llm, mcp, task)
            assert again.adapter == "mcp-time"                          # the server's skill is picked by default
            assert first_calls(again) == [(right["name"], right["arguments"])], (task, again.turns[-1].text)
        # the learned call runs on the server and its result goes back to the model
        ran = again.approve(again.pending()[0].id)
        assert ran.status == "done" and json.loads(ran.result)["timezone"] == "Asia/Tokyo"

        # 2. now it calls the tool for Paris too, with the wrong argument: one edit fixes it
        right = {"name": "get_current_time", "arguments": {"timezone": "Europe/Paris"}}
        run = propose(llm, mcp, PARIS)
        assert first_calls(run) != [(right["name"], right["arguments"])]
        wrong_call = bool(run.turns[-1].call_ids)
        fixed = correct(run, right)
        assert fixed.edited and json.loads(fixed.result)["timezone"] == "Europe/Paris"
        start = time.perf_counter()
        report = llm.learn([example_for_call(run, fixed)], adapter="mcp-time", lora=TOOL_LORA, max_steps=80)
        timings["learn 2"] = (round(time.perf_counter() - start, 1), report["steps"])
        assert report["verified"]
        for task in (PARIS, PARIS_PARAPHRASE):
            assert first_calls(propose(llm, mcp, task)) == [(right["name"], right["arguments"])], task
        # the first lesson holds
        assert first_calls(propose(llm, mcp, TOKYO)) == [("get_current_time", {"timezone": "Asia/Tokyo"})]
        print(f"\nlearning tool calls: {timings}; the Paris turn before the edit {'was a wrong call' if wrong_call else 'had no call'}")
    finally:
        llm.close()
        mcp.close()
