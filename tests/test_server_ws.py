"""The websocket protocol against the real server (uvicorn on a free port, the embedded SmolLM2, a real
`websockets` client): streaming, concurrency, stop, persistence, and bad frames that never close the socket."""
from __future__ import annotations

import asyncio
import json

import pytest

from dark import OnlineLLM
from dark.server import ServerSettings, create_app
from dark.server.testing import ServerThread, WsSession

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with OnlineLLM(max_model_len=1024, data_dir=tmp_path_factory.mktemp("ws-data")) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    settings = ServerSettings(max_frame_bytes=4096, rate_limit=50, rate_burst=40, max_inflight=3, max_tokens=300,
                              default_max_tokens=40)
    with ServerThread(create_app(llm, settings)) as server:
        yield server


def run(coro):
    return asyncio.run(coro)


async def session(server) -> WsSession:
    return await WsSession.open(server.ws_url)


def test_hello_then_a_streamed_chat_that_is_stored(server, llm):
    async def go():
        async with await session(server) as s:
            assert s.hello["protocol"] == 1 and s.hello["model"] == llm.model_name
            assert s.hello["limits"]["max_tokens"] == 300
            frames = await s.request({"type": "chat", "content": QUESTION})
            started, *tokens, done = frames
            assert started["type"] == "started" and started["conversation_id"]
            assert tokens and all(f["type"] == "token" for f in tokens)
            assert done["type"] == "done" and done["text"] == "".join(f["text"] for f in tokens)
            assert done["text"] == llm.generate(QUESTION, max_tokens=40)
            assert done["finish_reason"] == "stop" and done["adapter"] is None
            assert done["usage"]["completion_tokens"] > 0 and done["usage"]["prompt_tokens"] > 0
            assert done["conversation_id"] == started["conversation_id"]

            # the conversation continues with its history, and both turns are stored in order
            cid = done["conversation_id"]
            follow = await s.request({"type": "chat", "conversation_id": cid, "content": "And of Italy?"})
            assert follow[-1]["type"] == "done" and follow[-1]["conversation_id"] == cid
            assert follow[-1]["parent_id"] == follow[0]["user_message_id"]
            (history,) = await s.request({"type": "history", "conversation_id": cid})
            assert [(m["role"], m["content"]) for m in history["messages"]] == [
                ("user", QUESTION), ("assistant", done["text"]), ("user", "And of Italy?"),
                ("assistant", follow[-1]["text"])]
            assert history["messages"][1]["id"] == done["message_id"]
            (convs,) = await s.request({"type": "conversations"})
            assert convs["conversations"][0]["id"] == cid and convs["conversations"][0]["title"] == QUESTION
    run(go())


def test_two_sockets_and_several_requests_on_one(server, llm):
    prompts = ["Name a colour.", "What is 2+2?", "Say hello."]
    expected = {p: llm.generate(p, max_tokens=24) for p in prompts}

    async def go():
        a, b = await session(server), await session(server)
        try:
            # two requests in flight on socket a, one on socket b, all at once
            await a.send({"type": "chat", "id": "x", "content": prompts[0], "sampling": {"max_tokens": 24}})
            await a.send({"type": "chat", "id": "y", "content": prompts[1], "sampling": {"max_tokens": 24}})
            await b.send({"type": "chat", "id": "x", "content": prompts[2], "sampling": {"max_tokens": 24}})
            ax, ay, bx = await asyncio.gather(a.frames("x"), a.frames("y"), b.frames("x"))
        finally:
            await a.close()
            await b.close()
        for frames, prompt in ((ax, prompts[0]), (ay, prompts[1]), (bx, prompts[2])):
            assert frames[-1]["type"] == "done", frames[-1]
            assert frames[-1]["text"] == expected[prompt]
            assert "".join(f["text"] for f in frames if f["type"] == "token") == expected[prompt]
    run(go())


def test_stop_ends_a_generation_and_says_so(server):
    async def go():
        async with await session(server) as s:
            await s.send({"type": "chat", "id": "long", "content": "Write a very long story about a dragon.",
                          "sampling": {"max_tokens": 300}})
            await s.next(lambda f: f.get("id") == "long" and f["type"] == "token")
            await s.send({"type": "stop", "id": "long"})
            frames = await s.frames("long")
            done = frames[-1]
            assert done["type"] == "done" and done["finish_reason"] == "abort"
            assert done["usage"]["completion_tokens"] < 300
            (history,) = await s.request({"type": "history", "conversation_id": done["conversation_id"]})
            assert history["messages"][-1]["finish_reason"] == "abort"
            # stopping what is not running is an error frame, not a closed socket
            (err,) = await s.request({"type": "stop"})
            assert err["code"] == "not_running"
            assert (await s.request({"type": "ping"}))[0]["type"] == "pong"
    run(go())


def test_bad_frames_get_error_frames_and_the_socket_keeps_working(server):
    bad = [
        ("not json", None, "bad_json"),
        ("[1, 2]", None, "bad_frame"),
        (json.dumps({"type": "launch", "id": 1}), 1, "unknown_type"),
        (json.dumps({"type": "chat", "content": "hi"}), None, "bad_frame"),
        (json.dumps({"type": "chat", "id": 2}), 2, "bad_frame"),
        (json.dumps({"type": "chat", "id": 3, "content": "hi", "bogus": 1}), 3, "bad_frame"),
        (json.dumps({"type": "chat", "id": 4, "content": "hi", "sampling": {"temperature": -1}}), 4, "bad_frame"),
        (json.dumps({"type": "chat", "id": 5, "content": "hi", "sampling": {"max_tokens": 100000}}), 5,
         "invalid_request"),
        (json.dumps({"type": "chat", "id": 6, "content": "hi", "adapter": "no-such-skill"}), 6, "unknown_adapter"),
        (json.dumps({"type": "chat", "id": 7, "content": "hi", "adapter": "bad name!"}), 7, "bad_frame"),
        (json.dumps({"type": "history", "id": 8, "conversation_id": "nope"}), 8, "not_found"),
        (json.dumps({"type": "chat", "id": 9, "content": "x" * 5000}), None, "frame_too_large"),
        (json.dumps({"type": "regenerate", "id": 10, "message_id": "nope"}), 10, "not_found"),
        (json.dumps({"type": "feedback", "id": 11, "message_id": "nope", "rating": 5}), 11, "bad_frame"),
        (b"\xff\xfe binary junk", None, "bad_json"),
    ]

    async def go():
        async with await session(server) as s:
            for frame, rid, code in bad:
                await s.send(frame)
                err = await s.next(lambda f: f["type"] == "error")
                assert (err["id"], err["code"]) == (rid, code), (frame[:60], err)
                assert err["message"]
            # a chat that failed validation stored nothing and the socket still works
            frames = await s.request({"type": "chat", "content": "Say hi.", "sampling": {"max_tokens": 8}})
            assert frames[-1]["type"] == "done"
            assert s.buffer == []
    run(go())


def test_error_messages_say_what_was_wrong(server):
    async def go():
        async with await session(server) as s:
            (err,) = await s.request({"type": "chat", "content": "hi", "sampling": {"max_tokens": 100000}})
            assert "100000" in err["message"] and "300" in err["message"]
            (err,) = await s.request({"type": "chat", "content": "hi", "adapter": "ghost"})
            assert "ghost" in err["message"]
            (err,) = await s.request({"type": "chat"})
            assert "content" in err["message"] and "required" in err["message"].lower()
    run(go())


def test_per_socket_caps_rate_and_inflight(server):
    async def go():
        async with await session(server) as s:
            # more generations than max_inflight (3): the extra one is refused, the others run
            for i in range(4):
                await s.send({"type": "chat", "id": f"g{i}", "content": "Count to five.",
                              "sampling": {"max_tokens": 12}})
            refused = await s.next(lambda f: f["type"] == "error")
            assert refused["id"] == "g3" and refused["code"] == "too_many_requests"
            for i in range(3):
                assert (await s.frames(f"g{i}"))[-1]["type"] == "done"
            # duplicate ids while running
            await s.send({"type": "chat", "id": "d", "content": "Count to five.", "sampling": {"max_tokens": 12}})
            await s.send({"type": "chat", "id": "d", "content": "again"})
            dup = await s.next(lambda f: f["type"] == "error")
            assert dup["code"] == "duplicate_id"
            await s.frames("d")
        async with await session(server) as s:
            # a burst beyond rate_burst (40) gets rate_limited errors; the socket stays open
            for i in range(60):
                await s.send({"type": "ping", "id": i})
            frames = [await s.next(lambda f: f.get("id") == i) for i in range(60)]
            kinds = [f.get("code", f["type"]) for f in frames]
            assert kinds.count("pong") >= 40 and "rate_limited" in kinds
            await asyncio.sleep(0.2)
            assert (await s.request({"type": "ping"}))[0]["type"] == "pong"
    run(go())


def test_feedback_regenerate_and_delete(server, llm):
    async def go():
        async with await session(server) as s:
            done = (await s.request({"type": "chat", "content": QUESTION}))[-1]
            (ack,) = await s.request({"type": "feedback", "message_id": done["message_id"], "rating": -1})
            assert ack["type"] == "ack" and ack["request"] == "feedback"
            again = await s.request({"type": "regenerate", "message_id": done["message_id"],
                                     "sampling": {"temperature": 0.9, "seed": 3, "max_tokens": 20}})
            new = again[-1]
            assert new["type"] == "done" and new["message_id"] != done["message_id"]
            assert new["parent_id"] == done["parent_id"] and again[0]["user_message_id"] is None
            (history,) = await s.request({"type": "history", "conversation_id": done["conversation_id"]})
            assert [m["id"] for m in history["messages"]] == [done["parent_id"], new["message_id"]]
            (err,) = await s.request({"type": "regenerate", "message_id": done["parent_id"]})
            assert err["code"] == "invalid_request" and "assistant" in err["message"]
            (ack,) = await s.request({"type": "delete_conversation", "conversation_id": done["conversation_id"]})
            assert ack["type"] == "ack"
            (err,) = await s.request({"type": "history", "conversation_id": done["conversation_id"]})
            assert err["code"] == "not_found"
        assert llm.store.list_feedback  # the store is the LLM's own
    run(go())


class ChatOnly:
    """An LLM without the learning API: chatting works, learning says it cannot."""

    def __init__(self, llm):
        self._llm = llm
        self.model_name, self.store, self.engine = llm.model_name, llm.store, llm.engine

    def submit(self, *a, **k):
        return self._llm.submit(*a, **k)

    def abort(self, rid):
        self._llm.abort(rid)

    def adapters(self):
        return []


def test_without_learning_api_corrections_fail_cleanly(llm):
    with ServerThread(create_app(ChatOnly(llm), ServerSettings())) as server:
        async def go():
            async with await session(server) as s:
                assert s.hello["learning"] is False
                done = (await s.request({"type": "chat", "content": "Say hi.", "sampling": {"max_tokens": 8}}))[-1]
                (err,) = await s.request({"type": "correct", "message_id": done["message_id"], "content": "Hello!",
                                          "adapter": "greeter"})
                assert err["code"] == "learning_unavailable"
                (history,) = await s.request({"type": "history", "conversation_id": done["conversation_id"]})
                assert history["messages"][-1]["content"] == done["text"]  # untouched
        run(go())


def test_the_example_client_script(server, llm):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "ws_client.py"
    out = subprocess.run([sys.executable, str(script), QUESTION, "--url", server.ws_url, "--max-tokens", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == llm.generate(QUESTION, max_tokens=20)
    assert "serving" in out.stderr


def test_many_sockets_at_once(server, llm):
    prompts = [f"Give me a word that rhymes with {w}." for w in ("cat", "dog", "sun", "tree", "cake", "light",
                                                                 "moon", "rain", "star", "sea", "hill", "road")]

    async def one(prompt):
        async with await session(server) as s:
            return (await s.request({"type": "chat", "content": prompt, "sampling": {"max_tokens": 12}}))[-1]

    async def go():
        return await asyncio.gather(*(one(p) for p in prompts))
    results = run(go())
    assert [r["type"] for r in results] == ["done"] * len(prompts)
    assert len({r["conversation_id"] for r in results}) == len(prompts)
    assert results[0]["text"] == llm.generate(prompts[0], max_tokens=12)


def test_closing_the_socket_stops_its_generations(server, llm):
    async def go():
        s = await session(server)
        await s.send({"type": "chat", "id": "a", "content": "Write a very long story about a dragon.",
                      "sampling": {"max_tokens": 300}})
        await s.next(lambda f: f.get("id") == "a" and f["type"] == "token")
        await s.close()
        for _ in range(100):
            if not llm.engine.scheduler.running and not llm.engine.scheduler.waiting:
                return True
            await asyncio.sleep(0.05)
        return False
    assert run(go()), "the generation kept running after its socket closed"


def test_a_conversation_longer_than_the_context_keeps_going(tmp_path):
    """Past the context window (1024 tokens here) a conversation is answered from its latest turns, says how many
    messages it left out, keeps every message stored, and a correction of such a reply learns the turns that fit
    (one training step here: the example, not the learning, is under test)."""
    note = "the quick brown fox jumps over the lazy dog and then it runs away into the green forest. " * 14
    with OnlineLLM(max_model_len=1024, data_dir=tmp_path, learn={"max_steps": 1, "augment": False}) as llm, \
            ServerThread(create_app(llm, ServerSettings(max_frame_bytes=4096, default_max_tokens=40))) as server:
        async def go():
            async with await session(server) as s:
                cid, dones = None, []
                for i in range(5):
                    msg = {"type": "chat", "content": f"Note {i}: {note}", "sampling": {"max_tokens": 8}}
                    if cid:
                        msg["conversation_id"] = cid
                    *_, done = await s.request(msg)
                    assert done["type"] == "done", done
                    cid = done["conversation_id"]
                    dones.append(done)
                assert dones[0]["context_dropped"] == 0
                last = dones[-1]
                assert last["context_dropped"] >= 2 and last["context_dropped"] % 2 == 0  # whole turns
                assert last["usage"]["prompt_tokens"] <= 1024 - 1 - 8
                (history,) = await s.request({"type": "history", "conversation_id": cid})
                assert len(history["messages"]) == 10  # nothing left out of the store
                assert history["messages"][-1]["meta"]["context_dropped"] == last["context_dropped"]
                frames = await s.request({"type": "correct", "message_id": last["message_id"], "content": "Noted.",
                                          "adapter": "long-notes"}, timeout=300)
                assert frames[-1]["type"] == "job" and frames[-1]["state"] == "done", frames[-1]
                (example,) = llm.store.list_examples("long-notes")
                taught = example["payload"]["messages"]
                assert taught[0]["content"].startswith("Note ") and taught[0]["content"] != f"Note 0: {note}"
                assert taught[-1] == {"role": "assistant", "content": "Noted."}
                assert len(llm.encode(taught)) < 1024
        run(go())
