"""The MCP client against real servers started by the tests: the npm reference servers (everything, filesystem,
memory), the PyPI mcp-server-time, and a small SDK server over stdio and over streamable HTTP with a token."""
from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mcp"))
from agent_helpers import PY_SERVER, free_port, node_server, start_http, stop, time_server  # noqa: E402

from dark.agent import MCPManager, MCPServerError  # noqa: E402
from dark.errors import InvalidRequestError  # noqa: E402


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One manager with the four registry servers (they start in parallel)."""
    root = tmp_path_factory.mktemp("fsroot")
    (root / "notes.txt").write_text("buy milk\n")
    events = []
    mgr = MCPManager({"mcpServers": {
        "everything": {"command": node_server("everything"), "env": {"DARK_TEST_SECRET": "hunter2"}},
        "fs": {"command": node_server("filesystem"), "roots": [str(root)]},
        "memory": {"command": node_server("memory"),
                   "env": {"MEMORY_FILE_PATH": str(tmp_path_factory.mktemp("memory") / "memory.jsonl")}},
        "time": time_server(),
    }}, on_event=events.append)
    mgr.root, mgr.events = root, events
    yield mgr
    mgr.close()


def test_servers_ready_with_full_schemas(servers):
    status = servers.status()
    assert {n: s["state"] for n, s in status.items()} == dict.fromkeys(["everything", "fs", "memory", "time"], "ready")
    assert [e["state"] for e in servers.events if e["name"] == "time"] == ["ready"]
    time_tools = {t.name: t for t in servers.tools("time")}
    assert set(time_tools) == {"get_current_time", "convert_time"}
    schema = time_tools["get_current_time"].input_schema
    assert schema["type"] == "object" and schema["required"] == ["timezone"] and "description" in schema["properties"]["timezone"]
    fs = {t.name for t in servers.tools("fs")}
    assert {"read_text_file", "write_file", "list_directory", "list_allowed_directories"} <= fs
    assert {"create_entities", "read_graph", "search_nodes"} <= {t.name for t in servers.tools("memory")}
    assert {"echo", "get-sum"} <= {t.name for t in servers.tools("everything")}
    assert status["everything"]["server_info"]["name"]
    assert len(servers.tools()) == sum(len(servers.tools(n)) for n in servers.names())


def test_calls_run_on_each_server(servers):
    r = servers.call_tool("time", "get_current_time", {"timezone": "Asia/Tokyo"})
    assert not r.is_error and json.loads(r.text)["timezone"] == "Asia/Tokyo" and r.structured["timezone"] == "Asia/Tokyo"
    assert servers.call_tool("everything", "echo", {"message": "hello"}).text == "Echo: hello"
    assert "3" in servers.call_tool("everything", "get-sum", {"a": 1, "b": 2}).text
    assert servers.call_tool("fs", "read_text_file", {"path": str(servers.root / "notes.txt")}).text.strip() == "buy milk"
    servers.call_tool("memory", "create_entities", {"entities": [{"name": "Ada", "entityType": "person",
                                                                  "observations": ["likes tea"]}]})
    assert "likes tea" in servers.call_tool("memory", "search_nodes", {"query": "Ada"}).text
    img = servers.call_tool("everything", "get-tiny-image", {})
    assert any(b["type"] == "image" for b in img.content) and "[image image/png" in img.text   # described, not inlined


def test_tool_errors_come_back_as_error_results(servers):
    r = servers.call_tool("everything", "get-sum", {"a": 1})          # the server's own validation
    assert r.is_error and "b" in r.text
    r = servers.call_tool("everything", "no-such-tool", {})
    assert r.is_error and "no-such-tool" in r.text
    assert servers.status("everything")["state"] == "ready"           # a bad call does not hurt the server


def test_filesystem_roots_confine_the_server(servers, tmp_path):
    allowed = servers.call_tool("fs", "list_allowed_directories", {}).text
    assert str(servers.root.resolve()) in allowed
    outside = tmp_path / "secret.txt"
    outside.write_text("no")
    r = servers.call_tool("fs", "read_text_file", {"path": str(outside)})
    assert r.is_error and "denied" in r.text.lower()


def test_call_timeout_does_not_hang(servers):
    start = time.monotonic()
    r = servers.call_tool("everything", "trigger-long-running-operation", {"duration": 30, "steps": 3}, timeout=1.5)
    assert r.is_error and "did not return within 1.5 s" in r.text
    assert time.monotonic() - start < 6
    assert servers.call_tool("everything", "echo", {"message": "still here"}).text == "Echo: still here"


def test_secrets_stay_out_of_public_view(servers):
    view = json.dumps(servers.public_view())
    assert "hunter2" not in view and "DARK_TEST_SECRET" in view
    assert '"get_current_time"' in view and '"input_schema"' in view   # tools with schemas for the UI
    # the server itself did get its env
    assert "hunter2" in servers.call_tool("everything", "get-env", {}).text


def test_async_calls_from_another_loop(servers):
    async def main():
        results = await asyncio.gather(*(servers.call_tool_async("everything", "echo", {"message": str(i)}) for i in range(5)))
        return [r.text for r in results]
    assert asyncio.run(main()) == [f"Echo: {i}" for i in range(5)]


def test_failures_are_reported_quickly(tmp_path):
    crash = [sys.executable, "-c", "import sys; sys.stderr.write('fatal: MY_API_KEY is not set\\n'); sys.exit(2)"]
    leak = [sys.executable, "-c", "import os, sys; sys.stderr.write('bad key ' + os.environ['MY_KEY']); sys.exit(1)"]
    start = time.monotonic()
    mgr = MCPManager({"mcpServers": {
        "missing": {"command": str(tmp_path / "no-such-binary")},
        "crash": {"command": crash[0], "args": crash[1:]},
        "leak": {"command": leak[0], "args": leak[1:], "env": {"MY_KEY": "sk-very-secret"}},
        "hang": {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "timeout": 2},
        "refused": {"url": f"http://127.0.0.1:{free_port()}/mcp", "timeout": 5},
    }})
    try:
        took = time.monotonic() - start
        status = mgr.status()
        assert {n: s["state"] for n, s in status.items()} == dict.fromkeys(["missing", "crash", "hang", "leak", "refused"],
                                                                          "failed")
        assert took < 12, took
        assert "no-such-binary" in status["missing"]["error"]
        assert "MY_API_KEY is not set" in status["crash"]["error"]          # the server's stderr says why
        assert "bad key ***" in status["leak"]["error"] and "sk-very-secret" not in json.dumps(mgr.public_view())
        assert "within 2 s" in status["hang"]["error"]
        assert status["refused"]["error"].startswith("failed to start")
        r = mgr.call_tool("crash", "anything", {})
        assert r.is_error and "crash is failed" in r.text
        assert mgr.tools() == []
    finally:
        mgr.close()


def test_server_that_dies_mid_session(tmp_path):
    with MCPManager({"mcpServers": {"py": {"command": sys.executable, "args": [str(PY_SERVER)]}}}) as mgr:
        assert mgr.status("py")["state"] == "ready"
        assert mgr.call_tool("py", "add", {"a": 2, "b": 3}).text == "5"
        start = time.monotonic()
        r = mgr.call_tool("py", "crash", {})
        assert r.is_error and time.monotonic() - start < 10
        deadline = time.monotonic() + 10
        while mgr.status("py")["state"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mgr.status("py")["state"] == "failed" and "closed the connection" in mgr.status("py")["error"]
        assert "is failed" in mgr.call_tool("py", "add", {"a": 1, "b": 1}).text
        # a restart brings it back
        assert mgr.restart_server("py")["state"] == "ready"
        assert mgr.call_tool("py", "add", {"a": 1, "b": 1}).text == "2"


def test_streamable_http_servers_with_headers(tmp_path, monkeypatch):
    port, everything_port = free_port(), free_port()
    py = start_http([sys.executable, str(PY_SERVER), "--http", str(port), "--token", "s3cret"], port)
    everything = start_http([node_server("everything"), "streamableHttp"], everything_port,
                            env={**os.environ, "PORT": str(everything_port)})
    monkeypatch.setenv("DARK_TEST_TOKEN", "s3cret")
    try:
        with MCPManager({"mcpServers": {
            "py": {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"Authorization": "Bearer ${DARK_TEST_TOKEN}"}},
            "wrong": {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"Authorization": "Bearer nope"}, "timeout": 10},
            "everything": {"url": f"http://127.0.0.1:{everything_port}/mcp"},
        }}) as mgr:
            status = mgr.status()
            assert status["py"]["state"] == "ready" and status["py"]["transport"] == "http"
            assert status["wrong"]["state"] == "failed" and "401" in status["wrong"]["error"]
            assert mgr.call_tool("py", "add", {"a": 20, "b": 22}).text == "42"
            assert status["everything"]["state"] == "ready"
            assert mgr.call_tool("everything", "echo", {"message": "over http"}).text == "Echo: over http"
            assert "s3cret" not in json.dumps(mgr.public_view()) and "nope" not in json.dumps(mgr.public_view())
            # the server goes away: the next call fails cleanly and the status says so
            stop(py)
            r = mgr.call_tool("py", "add", {"a": 1, "b": 1}, timeout=5)
            assert r.is_error
            assert mgr.status("py")["state"] == "failed"
    finally:
        stop(py)
        stop(everything)


def test_add_remove_at_runtime_and_save(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"time": time_server()}}))
    with MCPManager(path) as mgr:
        assert mgr.names() == ["time"]
        status = mgr.add_server("py", {"command": sys.executable, "args": [str(PY_SERVER)], "auto_approve": ["add"],
                                       "env": {"TOKEN": "t0p"}}, save=True)
        assert status["state"] == "ready" and status["tools"] == ["add", "big", "slow", "crash"]
        saved = json.loads(path.read_text())
        assert set(saved["mcpServers"]) == {"time", "py"} and saved["mcpServers"]["py"]["env"] == {"TOKEN": "t0p"}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600            # the file holds secrets
        with pytest.raises(InvalidRequestError, match="already exists"):
            mgr.add_server("py", {"command": "x"})
        mgr.set_auto_approve("time", True)
        assert mgr.config("time").approves("get_current_time") and mgr.config("py").approves("add")
        assert not mgr.config("py").approves("crash")
        mgr.remove_server("py", save=True)
        assert mgr.names() == ["time"] and set(json.loads(path.read_text())["mcpServers"]) == {"time"}
        with pytest.raises(MCPServerError, match="no MCP server named 'py'"):
            mgr.call_tool("py", "add", {})
        mgr.add_server("off", {"command": "x", "disabled": True})
        assert mgr.status("off")["state"] == "stopped"
        # a server still starting can be removed at once
        mgr.add_server("slow", {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "timeout": 60},
                       wait=False)
        assert mgr.status("slow")["state"] == "starting"
        start = time.monotonic()
        mgr.remove_server("slow")
        assert time.monotonic() - start < 8 and "slow" not in mgr.names()


def test_tools_allow_list(tmp_path):
    with MCPManager({"mcpServers": {"py": {"command": sys.executable, "args": [str(PY_SERVER)], "tools": ["add"]}}}) as mgr:
        assert [t.name for t in mgr.tools("py")] == ["add"]
        assert "not enabled" in mgr.call_tool("py", "crash", {}).text
        assert mgr.status("py")["state"] == "ready"
