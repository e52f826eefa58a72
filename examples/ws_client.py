#!/usr/bin/env python3
"""Chat with a dark server over its websocket, and optionally teach it a better answer.

    python examples/ws_client.py "What is the capital of Zoggia?"
    python examples/ws_client.py "What is the capital of Zoggia?" --correct "Blorp." --adapter geo
    python examples/ws_client.py "What is the capital of Zoggia?" --adapter geo

The key, if the server needs one, comes from --key or DARK_API_KEY. Protocol: docs/protocol.md.
Needs only the `websockets` package.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from websockets.asyncio.client import connect


async def request(ws, message: dict, on_frame) -> dict:
    """Send one request and hand each of its frames to on_frame until the last; returns the last."""
    await ws.send(json.dumps(message))
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("id") != message["id"]:
            continue  # hello, adapter broadcasts, other requests
        on_frame(frame)
        if frame["type"] in ("done", "error") or (frame["type"] == "job" and frame["state"] in ("done", "failed")):
            return frame


def show_job(frame: dict) -> None:
    if frame["type"] == "job":
        if frame["state"] == "running" and frame["loss"] is not None:
            print(f"  step {frame['step']}/{frame['total_steps']}  loss {frame['loss']:.4f}", file=sys.stderr)
        elif frame["state"] == "done":
            print(f"  learned {frame['adapter']} v{frame['version']} (verified: {frame['verified']})", file=sys.stderr)
        else:
            print(f"  job {frame['state']}{': ' + frame['error'] if frame.get('error') else ''}", file=sys.stderr)


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("message")
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    p.add_argument("--key", default=os.environ.get("DARK_API_KEY"))
    p.add_argument("--adapter", help="the skill that answers (and learns, with --correct)")
    p.add_argument("--correct", metavar="TEXT", help="replace the answer with TEXT and teach it to --adapter")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}

    async with connect(args.url, additional_headers=headers, max_size=None) as ws:
        hello = json.loads(await ws.recv())
        print(f"# {hello['server']} serving {hello['model']}", file=sys.stderr)
        chat = {"type": "chat", "id": "chat", "content": args.message, "adapter": args.adapter,
                "sampling": {"max_tokens": args.max_tokens}}
        done = await request(ws, chat, lambda f: print(f["text"], end="", flush=True) if f["type"] == "token" else None)
        print()
        if done["type"] == "error":
            print(f"error ({done['code']}): {done['message']}", file=sys.stderr)
            return 1
        if args.correct:
            if not args.adapter:
                print("--correct needs --adapter: the skill that should learn it", file=sys.stderr)
                return 2
            fix = {"type": "correct", "id": "fix", "message_id": done["message_id"], "content": args.correct,
                   "adapter": args.adapter}
            last = await request(ws, fix, show_job)
            if last["type"] == "error" or last.get("state") != "done":
                print(f"could not learn: {last.get('message') or last.get('error')}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
