"""A small MCP server for the agent tests, on the official SDK: stdio, or streamable HTTP behind a bearer token.

    python tests/mcp/py_server.py                      # stdio
    python tests/mcp/py_server.py --http PORT --token T  # http://127.0.0.1:PORT/mcp, needs "Authorization: Bearer T"
"""
import argparse
import os
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("dark-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def big(lines: int = 2000) -> str:
    """A long text, to check that results are cut to the token budget."""
    return "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(lines))


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "done"


@server.tool()
def crash() -> str:
    """Exit the server process at once (a server that dies mid-session)."""
    os._exit(3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", type=int, default=0)
    ap.add_argument("--token", default="")
    args = ap.parse_args()
    if not args.http:
        server.run()
        return
    import uvicorn

    app = server.streamable_http_app()

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode() != f"Bearer {args.token}":
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"missing or wrong bearer token"})
                return
        await app(scope, receive, send)

    uvicorn.run(guarded, host="127.0.0.1", port=args.http, log_level="warning")


if __name__ == "__main__":
    main()
