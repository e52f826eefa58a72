"""The agent through the server, end to end: the real server (uvicorn, the embedded SmolLM2), a real MCP server
from PyPI (mcp-server-time) and one added at runtime, over the websocket: list servers -> a task -> the model's
call (or none) -> the user edits or writes the right call -> it runs for real -> the final answer -> agent_learn
-> the job is done -> the next run makes the call itself and the user approves it. No frame and no REST answer
ever holds a server's secrets."""
from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mcp"))
from agent_helpers import PY_SERVER, time_server  # noqa: E402

from dark import OnlineLLM  # noqa: E402
from dark.server import ServerSettings, create_app  # noqa: E402
from dark.server.testing import ServerThread, WsSession  # noqa: E402

KEY = "agent-test-key"
SECRET = "sk-time-SECRET-0d5e"          # in the time server's env, from the config file
SECRET2 = "py-SECRET-77aa"              # in the env of a server added over the websocket
TASK = "What time is it in Tokyo right now?"
RIGHT = {"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}
FINISHED = ("done", "max_steps", "cancelled", "failed")
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with OnlineLLM(data_dir=tmp_path_factory.mktemp("agent-data")) as llm:
        yield llm


@pytest.fixture(scope="module")
def mcp_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent-mcp") / "mcp.json"
    time = time_server()
    path.write_text(json.dumps({"mcpServers": {"time": {**time, "env": {"TIME_API_TOKEN": SECRET}}}}))
    return path


@pytest.fixture(scope="module")
def server(llm, mcp_file):
    settings = ServerSettings(api_key=KEY, default_max_tokens=48, mcp_config=mcp_file)
    with ServerThread(create_app(llm, settings)) as server:
        yield server


async def open_session(server) -> WsSession:
    return await WsSession.open(server.ws_url, additional_headers=HEADERS)


async def wait_ready(s: WsSession, name: str) -> dict:
    for _ in range(300):
        (servers,) = await s.request({"type": "mcp_servers"})
        entry = servers["servers"][name]
        if entry["status"]["state"] != "starting":
            assert entry["status"]["state"] == "ready", entry["status"]
            return entry
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} did not start")


async def drive(s: WsSession, rid) -> list[dict]:
    """The run's frames until it waits for the user or ends."""
    return await s.until(rid, lambda f: f["type"] == "agent_state" and f["state"] in ("awaiting_approval", *FINISHED)
                         or f["type"] == "agent_error", timeout=300)


def pending_calls(frames: list[dict]) -> list[dict]:
    turns = [f for f in frames if f["type"] == "agent_turn"]
    return [c for c in turns[-1]["calls"] if c["status"] in ("pending", "invalid")] if turns else []


async def finish(s: WsSession, rid, frames: list[dict]) -> list[dict]:
    """Reject whatever else the model proposes, until the run ends; all its frames."""
    seen = list(frames)
    while seen[-1]["type"] == "agent_state" and seen[-1]["state"] == "awaiting_approval":
        for call in pending_calls(seen):
            (ack,) = await s.request({"type": "agent_reject", "call_id": call["id"], "reason": "not needed"})
            assert ack["type"] == "ack", ack
        seen += await drive(s, rid)
    assert seen[-1]["type"] == "agent_state" and seen[-1]["state"] in ("done", "max_steps"), seen[-1]
    return seen


def test_agent_over_the_websocket_edit_run_learn_and_approve(server, llm, mcp_file):
    async def go():
        async with await open_session(server) as s:
            # 1. the servers: the configured one (secrets redacted, tools with schemas) and one added now
            time_entry = await wait_ready(s, "time")
            assert time_entry["config"]["env"] == {"TIME_API_TOKEN": "***"}
            tools = {t["name"]: t for t in time_entry["tools"]}
            assert "timezone" in tools["get_current_time"]["input_schema"]["properties"]
            (added,) = await s.request({"type": "mcp_add_server", "name": "py", "config": {
                "command": sys.executable, "args": [str(PY_SERVER)], "env": {"PY_TOKEN": SECRET2}}}, timeout=60)
            assert added["type"] == "mcp_servers" and added["servers"]["py"]["status"]["state"] == "ready"
            assert "add" in added["servers"]["py"]["status"]["tools"]
            (toggled,) = await s.request({"type": "mcp_auto_approve", "name": "py", "value": ["add"]})
            assert toggled["servers"]["py"]["status"]["auto_approve"] == ["add"]
            (broken,) = await s.request({"type": "mcp_add_server", "name": "broken", "config": {
                "command": "/nonexistent/mcp-server", "env": {"KEY": SECRET2}}}, timeout=60)
            status = broken["servers"]["broken"]["status"]
            assert status["state"] == "failed" and status["error"], status          # a clear status, not a hang
            (refused,) = await s.request({"type": "agent", "content": TASK, "servers": ["broken"]})
            assert refused["type"] == "error" and "failed" in refused["message"]
            await s.request({"type": "mcp_remove_server", "name": "broken"})
            (bad,) = await s.request({"type": "agent", "content": TASK, "servers": ["nope"]})
            assert bad["type"] == "error" and bad["code"] == "not_found" and "nope" in bad["message"]

            # 2. a task: the base model answers with no call, or with a call that is not the right one
            rid = s.new_id()
            await s.send({"type": "agent", "id": rid, "content": TASK, "servers": ["time"]})
            frames = await drive(s, rid)
            started = frames[0]
            assert started["type"] == "agent_started" and started["tools"] == ["convert_time", "get_current_time"] \
                or sorted(started["tools"]) == ["convert_time", "get_current_time"]
            run_id = started["run_id"]
            assert any(f["type"] == "agent_delta" for f in frames)
            calls = pending_calls(frames)
            (dup,) = await s.request({"type": "mcp_servers", "id": rid})   # the run still speaks under its id
            busy = ("error", "duplicate_id") if frames[-1]["state"] != "done" else ("mcp_servers", None)
            assert (dup["type"], dup.get("code")) == busy
            if frames[-1]["state"] == "awaiting_approval":
                first = calls[0]
                assert [(c["name"], c["arguments"]) for c in calls] != [(RIGHT["name"], RIGHT["arguments"])]
                (err,) = await s.request({"type": "agent_approve", "call_id": first["id"],
                                          "edited": {"name": "get_current_time", "arguments": {"zone": "Tokyo"}}})
                assert err["type"] == "error" and err["code"] == "invalid_request"   # checked before anything runs
                (ack,) = await s.request({"type": "agent_approve", "call_id": first["id"], "edited": RIGHT})
                for other in calls[1:]:
                    await s.request({"type": "agent_reject", "call_id": other["id"], "reason": "not needed"})
                ran = ack["data"]["call"]
            else:
                assert frames[-1]["state"] == "done" and calls == []
                (err,) = await s.request({"type": "agent_correct_turn", "run_id": run_id, "calls": [
                    {"name": "get_current_time", "arguments": {"timezone": 9}}]})
                assert err["type"] == "error" and err["code"] == "invalid_request"
                (ack,) = await s.request({"type": "agent_correct_turn", "run_id": run_id, "calls": [RIGHT]})
                ran = ack["data"]["calls"][0]
            assert ack["type"] == "ack" and ran["edited"] and ran["status"] == "done"
            assert json.loads(ran["result"])["timezone"] == "Asia/Tokyo"                 # it ran for real
            # the model reads the result and goes on to an answer
            rest = await finish(s, rid, await drive(s, rid))
            assert any(f["type"] == "tool_result" and f["call"]["id"] == ran["id"] for f in frames + rest)
            assert any(f["type"] == "agent_final" for f in rest) or rest[-1]["state"] == "max_steps"

            # 3. teach the skill the corrected call: job frames as for corrections
            job = await s.request({"type": "agent_learn", "run_id": run_id}, timeout=300)
            queued, *running, done = job
            assert queued["state"] == "queued" and queued["adapter"] == "mcp-time"
            assert any(f["loss"] is not None for f in running)
            assert done["state"] == "done" and done["version"] >= 1 and done["verified"] is True, done

            # 4. the next run picks mcp-time by itself and makes the call; the user approves it as it is
            rid2 = s.new_id()
            await s.send({"type": "agent", "id": rid2, "content": TASK, "servers": ["time"]})
            frames = await drive(s, rid2)
            assert frames[0]["adapter"] == "mcp-time"
            assert frames[-1]["state"] == "awaiting_approval", frames[-1]
            calls = pending_calls(frames)
            assert [(c["name"], c["arguments"]) for c in calls] == [(RIGHT["name"], RIGHT["arguments"])]
            (ack,) = await s.request({"type": "agent_approve", "call_id": calls[0]["id"]})
            assert ack["data"]["call"]["status"] == "done" and not ack["data"]["call"]["edited"]
            rest = await finish(s, rid2, await drive(s, rid2))
            result = next(f for f in rest if f["type"] == "tool_result")
            assert json.loads(result["call"]["result"])["timezone"] == "Asia/Tokyo"
            # ... and for a paraphrase of the task; stopping a run cancels its pending call
            rid3 = s.new_id()
            await s.send({"type": "agent", "id": rid3, "content": "Tell me the current time in Tokyo.",
                          "servers": ["time"]})
            frames = await drive(s, rid3)
            calls = pending_calls(frames)
            assert [(c["name"], c["arguments"]) for c in calls] == [(RIGHT["name"], RIGHT["arguments"])]
            (stopped,) = await s.request({"type": "agent_stop", "run_id": frames[0]["run_id"]})
            assert stopped["type"] == "ack" and stopped["data"]["state"] == "cancelled"
            (late,) = await s.request({"type": "agent_approve", "call_id": calls[0]["id"]})
            assert late["type"] == "error" and late["code"] == "invalid_request"
            (gone,) = await s.request({"type": "agent_learn", "run_id": "nope"})
            assert gone["code"] == "not_found"

            # 5. servers: removed at runtime, the file keeps the rest (with its secrets, for the owner only)
            (left,) = await s.request({"type": "mcp_remove_server", "name": "py"})
            assert set(left["servers"]) == {"time"}
            saved = json.loads(mcp_file.read_text())["mcpServers"]
            assert set(saved) == {"time"} and saved["time"]["env"]["TIME_API_TOKEN"] == SECRET
            assert stat.S_IMODE(mcp_file.stat().st_mode) == 0o600
            raw = "\n".join(s.raw)
        assert SECRET not in raw and SECRET2 not in raw
        assert '"type":"mcp_status"' in raw.replace(" ", "")      # status changes reached the socket
    asyncio.run(go())


def test_mcp_servers_over_rest_under_the_key(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/api/mcp/servers").status_code == 401
        client.headers.update(HEADERS)
        listed = client.get("/api/mcp/servers")
        assert listed.status_code == 200 and "time" in listed.json()["mcpServers"]
        added = client.post("/api/mcp/servers", json={"name": "py2", "config": {
            "command": sys.executable, "args": [str(PY_SERVER)], "env": {"PY_TOKEN": SECRET2}}})
        assert added.status_code == 201, added.text
        assert added.json()["status"]["state"] == "ready" and added.json()["config"]["env"] == {"PY_TOKEN": "***"}
        bad = client.post("/api/mcp/servers", json={"name": "bad", "config": {"command": "x", "url": "http://y"}})
        assert bad.status_code == 400 and "exactly one" in bad.json()["detail"]
        toggled = client.post("/api/mcp/servers/py2/auto_approve", json={"value": True})
        assert toggled.json()["status"]["auto_approve"] is True
        assert SECRET not in client.get("/api/mcp/servers").text and SECRET2 not in client.get("/api/mcp/servers").text
        assert client.delete("/api/mcp/servers/py2").status_code == 204
        assert client.delete("/api/mcp/servers/py2").status_code == 404
        assert "py2" not in client.get("/api/mcp/servers").json()["mcpServers"]
