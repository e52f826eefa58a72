"""HTTP against the real server with an API key: /health, auth on every route and on the websocket, the Origin
check, the OpenAI-compatible routes through the official `openai` package, REST, /metrics, limits, headers."""
from __future__ import annotations

import asyncio
import base64
import logging

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus

from dark import OnlineLLM
from dark.server import ServerSettings, create_app
from dark.server.testing import ServerThread, WsSession

KEY = "sk-test/+=:key"  # characters a subprotocol token cannot hold: the browser route must encode them
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with OnlineLLM(max_model_len=1024, data_dir=tmp_path_factory.mktemp("http-data")) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    settings = ServerSettings(api_key=KEY, max_frame_bytes=64 * 1024, default_max_tokens=32, max_tokens=256)
    with ServerThread(create_app(llm, settings)) as server:
        yield server


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def key_protocol(key: str) -> str:
    return "bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_health_is_public_and_everything_else_needs_the_key(server):
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "protocol": 1, "auth_required": True}
    assert KEY not in health.text
    for method, path in [("GET", "/api/info"), ("GET", "/api/conversations"), ("GET", "/api/adapters"),
                         ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("POST", "/api/learn"), ("DELETE", "/api/adapters/x")]:
        missing = httpx.request(method, server.url + path)
        assert missing.status_code == 401, (path, missing.text)
        assert "API key" in missing.text and KEY not in missing.text
        wrong = httpx.request(method, server.url + path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path
    ok = httpx.get(server.url + "/api/info", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["protocol"] == 1 and KEY not in ok.text


def test_the_websocket_needs_the_key_too(server):
    async def go():
        for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}},
                       {"subprotocols": ["dark.v1", key_protocol("wrong")]},
                       {"subprotocols": ["dark.v1", "bearer.!!!"]}):
            with pytest.raises(InvalidStatus) as refused:
                await WsSession.open(server.ws_url, **kwargs)
            assert refused.value.response.status_code == 401, kwargs
        # a script: the Authorization header
        async with await WsSession.open(server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as s:
            assert (await s.request({"type": "ping"}))[0]["type"] == "pong"
        # a browser: the key as a subprotocol, and the server picks dark.v1
        async with await WsSession.open(server.ws_url, subprotocols=["dark.v1", key_protocol(KEY)]) as s:
            assert s.ws.subprotocol == "dark.v1"
            assert KEY not in str(s.hello)
    asyncio.run(go())


def test_the_websocket_checks_origin(server):
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go():
        with pytest.raises(InvalidStatus) as refused:
            await WsSession.open(server.ws_url, additional_headers=headers, origin="http://evil.example")
        assert refused.value.response.status_code == 403
        async with await WsSession.open(server.ws_url, additional_headers=headers, origin=server.url) as s:
            assert s.hello["type"] == "hello"
    asyncio.run(go())


def test_openai_models_and_chat(client, llm):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == llm.model_name
    reply = client.chat.completions.create(model=llm.model_name, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=20)
    expected = llm.generate(QUESTION, max_tokens=20)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0

    stream = client.chat.completions.create(model="base", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=20, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == expected
    assert finish in ("stop", "length") and usage.completion_tokens == reply.usage.completion_tokens

    # content parts and a system message are accepted
    parts = client.chat.completions.create(
        model=llm.model_name, max_tokens=20,
        messages=[{"role": "system", "content": "You are helpful."},
                  {"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert parts.choices[0].message.content


def test_openai_errors(server, client, llm):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-skill", messages=[{"role": "user", "content": "hi"}])
    assert "no-such-skill" in str(missing.value)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="base", n=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="256"):
        client.chat.completions.create(model="base", max_tokens=10_000, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="base", messages=[])


def test_rest_conversations_and_metrics(server, http):
    async def chat():
        async with await WsSession.open(server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as s:
            return (await s.request({"type": "chat", "content": QUESTION}))[-1]
    done = asyncio.run(chat())
    convs = http.get("/api/conversations").json()
    assert convs[0]["id"] == done["conversation_id"]
    conv = http.get(f"/api/conversations/{done['conversation_id']}").json()
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert http.post(f"/api/messages/{done['message_id']}/feedback", json={"rating": 1}).status_code == 201
    assert http.post(f"/api/messages/{done['message_id']}/feedback", json={"rating": 3}).status_code == 422
    missing = http.get("/api/conversations/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ("dark_requests_total", "dark_generated_tokens_total", "dark_tokens_per_second",
                 "dark_queue_waiting", "dark_ws_connections", "dark_learn_jobs"):
        assert f"# TYPE {name}" in text, name
    assert 'dark_requests_total{finish_reason="stop",source="ws"}' in text


def test_limits_and_headers(server, http):
    big = http.post("/api/learn", content=b"x" * (65 * 1024), headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and "limit" in big.json()["detail"]

    def chunks():
        for _ in range(70):
            yield b"x" * 1024
    chunked = http.post("/api/learn", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "<title>dark</title>" in page.text  # the UI needs no key to load
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"


def test_binding_beyond_loopback_without_a_key_warns(llm, caplog):
    settings = ServerSettings(host="0.0.0.0")  # the app only reads it; the test server still binds loopback
    with caplog.at_level(logging.WARNING, logger="dark.server.app"):
        with ServerThread(create_app(llm, settings)):
            pass
    assert any("WITHOUT an API key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dark.server.app"):
        with ServerThread(create_app(llm, ServerSettings(host="0.0.0.0", api_key="k"))):
            pass
    assert not any("WITHOUT an API key" in r.getMessage() for r in caplog.records)


def test_settings_from_environment():
    s = ServerSettings.from_env({"DARK_API_KEY": "abc", "DARK_PORT": "9001", "DARK_ALLOWED_ORIGINS": "https://a.b, http://c:1/",
                                 "DARK_HOST": "0.0.0.0"}, port=9002)
    assert s.key == "abc" and s.port == 9002 and s.allowed_origins == ["https://a.b", "http://c:1"]
    assert s.binds_beyond_loopback and "abc" not in repr(s) and "abc" not in s.model_dump_json()
    assert not ServerSettings(host="127.0.0.1").binds_beyond_loopback
    assert ServerSettings.from_env({"DARK_API_KEY": ""}).key is None
    with pytest.raises(ValueError, match="ASCII"):
        ServerSettings(api_key="caf\u00e9")
    with pytest.raises(ValueError, match="port"):
        ServerSettings.from_env({"DARK_PORT": "seventy"})


def test_origin_rules():
    from types import SimpleNamespace

    from dark.server.security import origin_problem

    def check(origin, host, allowed=()):
        headers = {"host": host} if origin is None else {"host": host, "origin": origin}
        return origin_problem(SimpleNamespace(headers=headers), ServerSettings(allowed_origins=list(allowed))) is None

    assert check(None, "127.0.0.1:8000")                                  # scripts send no Origin
    assert check("http://127.0.0.1:8000", "127.0.0.1:8000")               # the server's own page
    assert not check("http://127.0.0.1:9999", "127.0.0.1:8000")           # another port is another origin
    assert check("https://pod-8000.proxy.runpod.net", "pod-8000.proxy.runpod.net")  # behind a TLS proxy
    assert not check("https://evil.example", "pod-8000.proxy.runpod.net")
    assert check("https://app.example", "127.0.0.1:8000", ["https://app.example"])
    assert check("http://127.0.0.1:8000", "127.0.0.1:8000", ["https://app.example"])  # own origin stays allowed
    assert check("https://anything.example", "127.0.0.1:8000", ["*"])
    assert not check("null", "127.0.0.1:8000")                            # sandboxed frames, file:// pages


def test_a_client_that_leaves_a_stream_stops_it(http, llm):
    import time

    body = {"model": "base", "stream": True, "max_tokens": 250,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    for _ in range(100):
        if not llm.engine.scheduler.running and not llm.engine.scheduler.waiting:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the generation kept running after its client left")
