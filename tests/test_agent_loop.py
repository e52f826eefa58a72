"""The agent loop against real MCP servers, with a scripted model: approve / edit / reject, bad calls, auto-approve,
the step cap, result budgets, and the learn examples corrections make."""
from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mcp"))
from agent_helpers import PY_SERVER, node_server, time_server  # noqa: E402

from dark.agent import (AgentRun, MCPManager, example_for_call, example_for_turn, examples_for_run,  # noqa: E402
                        format_call, learn_from_run)
from dark.engine.sequence import RequestOutput  # noqa: E402
from dark.errors import InvalidRequestError  # noqa: E402


class ScriptedLLM:
    """Stands in for OnlineLLM: answers with the scripted turns, streaming them, and records every prompt."""

    def __init__(self, tokenizer, replies, adapters=()):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []
        self.adapter_names = list(adapters)

    def submit(self, prompt, on_output, adapter=None, **sampling):
        self.prompts.append({"messages": copy.deepcopy(prompt), "adapter": adapter, "sampling": sampling})
        text = self.replies.pop(0)
        half = len(text) // 2
        on_output(RequestOutput(1, text[:half], []))
        on_output(RequestOutput(1, text[half:], [], finished=True, finish_reason="stop", text=text))
        return 1

    def abort(self, request_id):
        pass

    def adapters(self):
        return [{"name": n} for n in self.adapter_names]

    def submit_learn(self, examples, adapter, kind="sft", source="api", message_id=None, on_event=None, lora=None,
                     **settings):
        self.learned = {"examples": examples, "adapter": adapter, "kind": kind, "source": source, "lora": lora,
                        "settings": settings}
        return "job"


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)


@pytest.fixture(scope="module")
def mcp(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentfs")
    mgr = MCPManager({"mcpServers": {
        "time": time_server(),
        "py": {"command": sys.executable, "args": [str(PY_SERVER)]},
        "fs": {"command": node_server("filesystem"), "roots": [str(root)]},
    }})
    mgr.root = root
    yield mgr
    mgr.close()


def call(name, **arguments):
    return format_call(name, arguments)


def test_a_call_runs_after_approval_and_its_result_goes_back(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, [call("get_current_time", timezone="Asia/Tokyo"), "It is morning in Tokyo."])
    events = []
    run = AgentRun(llm, mcp, "What time is it in Tokyo?", servers=["time"], on_event=events.append)
    assert run.adapter is None and run.learn_adapter == "mcp-time"        # no mcp-time adapter yet: the base model
    system = run.messages[0]["content"]
    assert "<tools>" in system and '"name": "get_current_time"' in system and '"required": ["timezone"]' in system
    pending = run.step()
    assert run.state == "awaiting_approval" and [(c.name, c.arguments) for c in pending] == [
        ("get_current_time", {"timezone": "Asia/Tokyo"})]
    assert pending[0].server == "time" and pending[0].output is None      # nothing ran yet
    with pytest.raises(InvalidRequestError, match="wait for approve or reject"):
        run.step()
    done = run.approve(pending[0].id)
    assert done.status == "done" and json.loads(done.result)["timezone"] == "Asia/Tokyo"
    assert run.state == "ready"
    assert run.step() == [] and run.state == "done" and run.final == "It is morning in Tokyo."
    # the second prompt is the first plus the model's call and the tool's result
    second = llm.prompts[1]["messages"]
    assert second[:2] == llm.prompts[0]["messages"]
    assert second[2] == {"role": "assistant", "content": call("get_current_time", timezone="Asia/Tokyo")}
    assert second[3]["role"] == "tool" and json.loads(second[3]["content"])["timezone"] == "Asia/Tokyo"
    assert llm.prompts[0]["sampling"]["max_tokens"] == 512
    kinds = [e["type"] for e in events]
    for kind in ("agent_started", "agent_delta", "agent_turn", "tool_running", "tool_result", "agent_final"):
        assert kind in kinds
    assert [e["state"] for e in events if e["type"] == "agent_state"] == [
        "generating", "awaiting_approval", "ready", "generating", "done"]
    assert run.to_dict()["turns"][0]["calls"][0]["status"] == "done"
    assert examples_for_run(run) == []                                     # nothing was corrected
    kept = example_for_turn(run, 1)                                         # a final answer the user keeps
    assert kept["messages"][-1] == {"role": "assistant", "content": "It is morning in Tokyo."}
    assert kept["messages"][-2]["role"] == "tool" and len(kept["messages"]) == 5
    positive = examples_for_run(run, include_approved=True)[0]
    assert positive["messages"][-1]["content"] == call("get_current_time", timezone="Asia/Tokyo") and "rejected" not in positive


def test_bad_calls_get_tool_errors_without_running(tokenizer, mcp):
    turn = "\n".join([
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": </tool_call>',      # malformed JSON
        call("subtract", a=1, b=2),                                               # unknown tool
        call("add", a="one", b=2),                                                # schema violation
        call("add", a=1, b=2)])
    llm = ScriptedLLM(tokenizer, [turn, "1 + 2 = 3."])
    run = AgentRun(llm, mcp, "Add 1 and 2.", servers=["py"])
    pending = run.step()
    calls = [run.calls[c] for c in run.turns[0].call_ids]
    assert [c.status for c in calls] == ["invalid", "invalid", "invalid", "pending"] and pending == [calls[3]]
    assert "not valid JSON" in calls[0].error
    assert "no tool named 'subtract'" in calls[1].error and "add" in calls[1].error
    assert "'one' is not of type 'integer'" in calls[2].error
    with pytest.raises(InvalidRequestError, match="cannot run as written"):
        run.approve(calls[1].id)
    run.approve(calls[3].id)
    run.step()
    tool_msgs = [m["content"] for m in llm.prompts[1]["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == 4 and all(m.startswith("Error: ") for m in tool_msgs[:3]) and tool_msgs[3] == "3"
    assert "not valid JSON" in tool_msgs[0] and "<tool_call>" in tool_msgs[0]   # tells the model how to write it


def test_a_failing_tool_is_an_error_result(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, [call("get_current_time", timezone="Mars/Olympus"), "Sorry."])
    run = AgentRun(llm, mcp, "What time is it on Mars?", servers=["time"])
    c = run.approve(run.step()[0].id)
    assert c.status == "error" and c.result.startswith("Error: ") and "Mars/Olympus" in c.result


def test_edit_then_learn_example_holds_the_full_context(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, ["Let me check.\n" + call("get_current_time", timezone="Tokyo"), "Done."],
                      adapters=["mcp-time"])
    run = AgentRun(llm, mcp, "What time is it in Tokyo?", servers=["time"], history=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}])
    assert run.adapter == "mcp-time"
    c = run.step()[0]
    with pytest.raises(InvalidRequestError, match="edited call cannot run"):          # checked before anything runs
        run.approve(c.id, {"arguments": {"zone": "Asia/Tokyo"}})
    with pytest.raises(InvalidRequestError, match="no tool named"):
        run.approve(c.id, {"name": "get_time"})
    assert c.status == "pending"
    run.approve(c.id, {"arguments": {"timezone": "Asia/Tokyo"}})
    assert c.edited and c.status == "done" and c.proposed == {"name": "get_current_time", "arguments": {"timezone": "Tokyo"}}
    assert json.loads(c.result)["timezone"] == "Asia/Tokyo"
    ex = example_for_call(run, c, rejected=True)
    msgs = ex["messages"]
    assert msgs[0] == run.messages[0] and "<tools>" in msgs[0]["content"]               # the tool list the model saw
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1:4] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                         {"role": "user", "content": "What time is it in Tokyo?"}]
    assert msgs[-1] == {"role": "assistant", "content": call("get_current_time", timezone="Asia/Tokyo")}
    assert ex["rejected"] == "Let me check.\n" + call("get_current_time", timezone="Tokyo")
    # the learner accepts it as it is
    from dark.learn.data import normalize_examples
    assert normalize_examples([ex])[0]["messages"] == msgs
    assert examples_for_run(run) == [{"messages": msgs}]                  # by default without the rejected turn
    # the conversation shows the corrected call, so the model builds on it
    run.step()
    assert llm.prompts[1]["messages"][4] == {"role": "assistant", "content": call("get_current_time", timezone="Asia/Tokyo")}
    assert example_for_call(run, c, rejected=True) == ex


def test_learn_from_run_queues_the_corrections(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, [call("add", a=1, b=1) + "\n" + call("add", a=2, b=2), "ok"])
    run = AgentRun(llm, mcp, "Add 1 and 3", servers=["py"])
    first, second = run.step()
    with pytest.raises(InvalidRequestError, match="nothing to learn"):
        learn_from_run(llm, run)
    run.approve(first.id, {"arguments": {"a": 1, "b": 3}})
    run.reject(second.id, "one sum is enough")
    assert learn_from_run(llm, run, max_steps=80) == "job"
    learned = llm.learned
    assert learned["adapter"] == "mcp-py" and learned["source"] == "agent" and learned["settings"] == {"max_steps": 80}
    assert learned["lora"]["target_modules"][-1] == "lm_head" and len(learned["lora"]["target_modules"]) == 8
    assert [e["messages"][-1]["content"] for e in learned["examples"]] == [call("add", a=1, b=3)]  # rejected one left out


def test_reject_tells_the_model_and_nothing_runs(tokenizer, mcp):
    target = mcp.root / "hello.txt"
    turn = call("write_file", path=str(target), content="hi") + "\n" + call("list_allowed_directories")
    llm = ScriptedLLM(tokenizer, [turn, "I did not write it."])
    run = AgentRun(llm, mcp, "Write hi to hello.txt", servers=["fs"])
    write, listing = run.step()
    assert not target.exists()                                     # proposed is not run
    run.reject(write.id, "not now")
    assert run.state == "awaiting_approval" and not target.exists()
    run.approve(listing.id)
    assert run.state == "ready"
    with pytest.raises(InvalidRequestError, match="only pending"):
        run.approve(write.id)
    run.step()
    tool_msgs = [m["content"] for m in llm.prompts[1]["messages"] if m["role"] == "tool"]
    assert tool_msgs[0] == "Error: the user rejected this call: not now" and str(mcp.root) in tool_msgs[1]
    assert not target.exists() and run.state == "done"
    with pytest.raises(InvalidRequestError, match="rejected"):
        example_for_call(run, write)


def test_approved_write_runs_on_the_filesystem(tokenizer, mcp):
    target = mcp.root / "note.txt"
    llm = ScriptedLLM(tokenizer, [call("write_file", path=str(target), content="from the agent"), "Written."])
    run = AgentRun(llm, mcp, "Save a note", servers=["fs"])
    c = run.step()[0]
    run.approve(c.id)
    assert c.status == "done" and target.read_text() == "from the agent"


def test_auto_approve_runs_without_asking(tokenizer, mcp):
    mcp.set_auto_approve("py", ["add"])
    try:
        llm = ScriptedLLM(tokenizer, [call("add", a=2, b=2) + "\n" + call("slow", seconds=0), "4"])
        run = AgentRun(llm, mcp, "2+2?", servers=["py"])
        pending = run.step()
        add, slow = (run.calls[c] for c in run.turns[0].call_ids)
        assert add.auto_approved and add.status == "done" and add.result == "4"
        assert pending == [slow] and slow.status == "pending"            # not on the list: it asks
        run.approve(slow.id)
        assert run.run() == "4"
    finally:
        mcp.set_auto_approve("py", False)


def test_step_cap(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, [call("add", a=1, b=1)] * 3)
    run = AgentRun(llm, mcp, "Loop forever", servers=["py"], max_steps=2)
    assert run.run(approve=lambda c: True) is None
    assert run.state == "max_steps" and len(run.turns) == 2 and len(llm.prompts) == 2
    with pytest.raises(InvalidRequestError, match="max_steps"):
        run.step()


def test_results_are_cut_to_the_token_budget(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, [call("big", lines=3000), "That was long."])
    run = AgentRun(llm, mcp, "Read it all", servers=["py"], result_tokens=200)
    c = run.approve(run.step()[0].id)
    assert c.result_cut and len(tokenizer(c.result)["input_ids"]) <= 210 and "tokens cut" in c.result
    assert "line 2999" in c.output["text"]                           # the client still has the whole result


def test_correct_a_turn_that_made_no_call(tokenizer, mcp):
    wrong = "It is 12:30 in Tokyo."
    llm = ScriptedLLM(tokenizer, [wrong, "It is morning in Tokyo."])
    run = AgentRun(llm, mcp, "What time is it in Tokyo?", servers=["time"])
    assert run.step() == [] and run.state == "done"
    with pytest.raises(InvalidRequestError, match="corrected call cannot run"):
        run.correct_turn([{"name": "get_current_time", "arguments": {}}])
    new = run.correct_turn([{"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}])
    assert new[0].status == "done" and new[0].source == "user" and run.state == "ready"
    ex = example_for_call(run, new[0], rejected=True)
    assert ex["messages"][-1]["content"] == call("get_current_time", timezone="Asia/Tokyo") and ex["rejected"] == wrong
    assert run.run() == "It is morning in Tokyo."


def test_an_unreadable_call_can_be_fixed_by_an_edit(tokenizer, mcp):
    broken = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2</tool_call>'
    llm = ScriptedLLM(tokenizer, [broken + "\n" + call("add", a=5, b=5), "done"])
    run = AgentRun(llm, mcp, "1+2", servers=["py"])
    pending = run.step()
    bad = run.calls[run.turns[0].call_ids[0]]
    assert bad.status == "invalid" and bad.arguments is None and len(pending) == 1
    run.approve(bad.id, {"name": "add", "arguments": {"a": 1, "b": 2}})
    run.approve(pending[0].id)
    assert bad.status == "done" and bad.result == "3" and bad.edited
    run.step()
    assert llm.prompts[1]["messages"][2]["content"] == call("add", a=1, b=2) + "\n" + call("add", a=5, b=5)
    assert example_for_call(run, bad, rejected=True)["rejected"] == broken + "\n" + call("add", a=5, b=5)


def test_an_invalid_call_alone_goes_back_as_an_error(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, ['<tool_call>{"name": "add"</tool_call>', "sorry"])
    run = AgentRun(llm, mcp, "1+2", servers=["py"])
    assert run.step() == [] and run.state == "ready"               # nothing waits for the user
    run.step()
    assert llm.prompts[1]["messages"][-1]["content"].startswith("Error: the tool call is not valid JSON")


def test_async_driving(tokenizer, mcp):
    llm = ScriptedLLM(tokenizer, [call("add", a=3, b=4), "7"])
    run = AgentRun(llm, mcp, "3+4", servers=["py"])

    async def drive():
        pending = await run.astep()
        await run.aapprove(pending[0].id)
        await run.astep()
    asyncio.run(drive())
    assert run.final == "7"


def test_unusable_servers_are_refused(tokenizer, tmp_path):
    with MCPManager({"mcpServers": {"bad": {"command": str(tmp_path / "nothing")}}}) as mgr:
        with pytest.raises(InvalidRequestError, match="bad is failed"):
            AgentRun(ScriptedLLM(tokenizer, []), mgr, "task", servers=["bad"])
        with pytest.raises(Exception, match="no MCP server named 'other'"):
            AgentRun(ScriptedLLM(tokenizer, []), mgr, "task", servers=["other"])


def test_service_drives_a_run_like_the_websocket_would(tokenizer, tmp_path):
    from dark.agent import AgentService

    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"py": {"command": sys.executable, "args": [str(PY_SERVER)],
                                                        "env": {"PY_TOKEN": "sekrit"}}}}))
    llm = ScriptedLLM(tokenizer, [call("add", a=2, b=3), "5", call("add", a=1, b=1), "2"])
    events = []

    async def main():
        agent = AgentService(llm, config)
        try:
            agent.mcp.wait_ready()
            assert "sekrit" not in json.dumps(agent.public_view())
            run = agent.start_run("2+3", servers=["py"], on_event=events.append)
            pending = await agent.advance(run.id)
            assert [c.arguments for c in pending] == [{"a": 2, "b": 3}]
            await agent.approve(run.id, pending[0].id, edited={"arguments": {"a": 2, "b": 4}})
            assert await agent.advance(run.id) == [] and run.state == "done" and run.final == "5"
            agent.learn(run.id, max_steps=10)
            assert llm.learned["adapter"] == "mcp-py" and llm.learned["settings"] == {"max_steps": 10}
            # auto-approve from the UI: the next run goes to its end on its own
            agent.set_auto_approve("py", True)
            run2 = agent.start_run("1+1", servers=["py"])
            assert await agent.advance(run2.id) == [] and run2.final == "2"
            assert json.loads(config.read_text())["mcpServers"]["py"]["auto_approve"] is True
            await agent.remove_server("py")
            assert json.loads(config.read_text())["mcpServers"] == {}
            with pytest.raises(InvalidRequestError, match="no agent run"):
                agent.get_run("nope")
        finally:
            agent.close()
    asyncio.run(main())
    assert {"agent_turn", "tool_call_edited", "tool_result", "agent_final"} <= {e["type"] for e in events}
