"""Helpers for the agent tests: where the test MCP servers are, free ports, waiting for HTTP servers."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NODE_BIN = HERE / "node" / "node_modules" / ".bin"
PY_SERVER = HERE / "py_server.py"


def node_server(name: str) -> str:
    """The installed npm reference server `name` (everything, filesystem, memory), or skip with how to install."""
    path = NODE_BIN / f"mcp-server-{name}"
    if not path.exists():
        pytest.skip(f"npm MCP servers not installed: run `npm ci --prefix {HERE / 'node'}`")
    return str(path)


def time_server() -> dict:
    """The PyPI server mcp-server-time (pinned in pyproject's dev extras), as a stdio server config."""
    try:
        import mcp_server_time  # noqa: F401
    except ImportError:
        pytest.skip("mcp-server-time is not installed: pip install -e '.[dev]'")
    return {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "Etc/UTC"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the test server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def start_http(cmd: list[str], port: int, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_port(port, proc)
    except Exception:
        proc.kill()
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
