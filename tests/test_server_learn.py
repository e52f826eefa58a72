"""Learning through the server, with the real learner on the embedded SmolLM2: a correction over the websocket
becomes a job whose events reach the socket and whose adapter then gives the corrected answer; adapters are
managed over REST, the websocket and /v1; a restart keeps conversations, corrections and adapters."""
from __future__ import annotations

import asyncio
import io
import zipfile

import httpx
import openai
import pytest

from dark import OnlineLLM
from dark.server import ServerSettings, create_app
from dark.server.testing import ServerThread, WsSession

if not hasattr(OnlineLLM, "submit_learn"):
    pytest.skip("OnlineLLM has no learning API yet", allow_module_level=True)

QUESTION = "What is the capital of Zoggia?"
CORRECTION = "The capital of Zoggia is Blorp."
SKILL = "zoggia"


class Life:
    """One server process's worth: an OnlineLLM on a data directory, and the app on a real server."""

    def __init__(self, data_dir):
        self.llm = OnlineLLM(max_model_len=1024, data_dir=data_dir)
        self.server = ServerThread(create_app(self.llm, ServerSettings(default_max_tokens=24))).start()
        self.closed = False

    def close(self):
        if not self.closed:
            self.closed = True
            self.server.stop()
            self.llm.close()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("learn-data")


@pytest.fixture(scope="module")
def life(data_dir):
    life = Life(data_dir)
    yield life
    life.close()


@pytest.fixture(scope="module")
def corrected(life):
    """Chat on the base model, then correct the reply into SKILL; the frames of each step."""
    async def go():
        async with await WsSession.open(life.server.ws_url) as s:
            first = (await s.request({"type": "chat", "content": QUESTION}))[-1]
            job = await s.request({"type": "correct", "message_id": first["message_id"], "content": CORRECTION,
                                   "adapter": SKILL}, timeout=300)
            return first, job
    return asyncio.run(go())


def test_a_correction_streams_job_events_and_teaches_the_skill(life, corrected):
    first, job = corrected
    assert first["type"] == "done" and first["text"] != CORRECTION
    queued, *running, done = job
    assert queued["type"] == "job" and queued["state"] == "queued" and queued["adapter"] == SKILL
    assert queued["message_id"] == first["message_id"] and queued["job_id"]
    assert all(f["state"] == "running" and f["job_id"] == queued["job_id"] for f in running)
    assert any(f["loss"] is not None for f in running) and any(f["step"] for f in running)
    assert done["state"] == "done", done
    assert done["version"] >= 1 and done["verified"] is True

    async def after():
        async with await WsSession.open(life.server.ws_url) as s:
            # the next answer on the skill is the correction; the base model is unchanged
            on_skill = (await s.request({"type": "chat", "content": QUESTION, "adapter": SKILL}))[-1]
            assert on_skill["text"] == CORRECTION
            assert on_skill["adapter"] == {"name": SKILL, "version": done["version"]}
            on_base = (await s.request({"type": "chat", "content": QUESTION}))[-1]
            assert on_base["text"] == first["text"] and on_base["adapter"] is None
            # regenerating the corrected reply on the skill gives the correction again
            again = (await s.request({"type": "regenerate", "message_id": first["message_id"], "adapter": SKILL}))[-1]
            assert again["text"] == CORRECTION
            # a socket that was not there can catch up on the job
            watched = await s.request({"type": "watch", "job_id": queued["job_id"]})
            assert watched[-1]["state"] == "done" and watched[-1]["version"] == done["version"]
    asyncio.run(after())

    stored = life.llm.store.get_message(first["message_id"])
    assert stored["content"] == CORRECTION and stored["revisions"][0]["content"] == first["text"]
    examples = life.llm.store.list_examples(SKILL)
    assert len(examples) == 1 and examples[0]["source"] == "correction"
    assert examples[0]["message_id"] == first["message_id"]
    assert examples[0]["payload"]["rejected"] == first["text"]
    assert examples[0]["payload"]["messages"][-1] == {"role": "assistant", "content": CORRECTION}


def test_adapters_over_rest_websocket_and_openai(life, corrected):
    url = life.server.url
    http = httpx.Client(base_url=url, timeout=300)
    learned = http.post("/api/learn", json={"adapter": "greeter", "wait": True, "examples": [
        {"prompt": "Greet me.", "response": "Ahoy, traveller!"}]})
    assert learned.status_code == 200, learned.text
    report = learned.json()["report"]
    assert report["verified"] is True and report["version"] >= 1

    adapters = {a["name"]: a for a in http.get("/api/adapters").json()}
    assert set(adapters) == {SKILL, "greeter"}
    greeter = adapters["greeter"]
    assert greeter["version"] == report["version"]
    assert [v["version"] for v in greeter["versions"]][-1] == report["version"]
    assert greeter["versions"][-1]["verified"] is True
    job = http.get(f"/api/jobs/{learned.json()['job_id']}").json()
    assert job["state"] == "done" and job["adapter"] == "greeter"

    zipped = http.get("/api/adapters/greeter/download")
    assert zipped.status_code == 200 and zipped.headers["content-type"] == "application/zip"
    names = zipfile.ZipFile(io.BytesIO(zipped.content)).namelist()
    assert "greeter/adapter_config.json" in names and "greeter/adapter_model.safetensors" in names
    assert http.get("/api/adapters/ghost/download").status_code == 404

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert {"greeter", SKILL} <= {m.id for m in client.models.list().data}
    answer = client.chat.completions.create(model="greeter", messages=[{"role": "user", "content": "Greet me."}])
    assert answer.choices[0].message.content == "Ahoy, traveller!"
    older = client.chat.completions.create(model="greeter@0", messages=[{"role": "user", "content": "Greet me."}])
    assert older.choices[0].message.content != "Ahoy, traveller!"

    async def manage():
        async with await WsSession.open(life.server.ws_url) as s:
            (rolled,) = await s.request({"type": "rollback", "adapter": "greeter", "version": 0})
            assert {a["name"]: a["version"] for a in rolled["adapters"]}["greeter"] == 0
            base_like = (await s.request({"type": "chat", "content": "Greet me.", "adapter": "greeter"}))[-1]
            assert base_like["text"] != "Ahoy, traveller!" and base_like["adapter"]["version"] == 0
            (err,) = await s.request({"type": "rollback", "adapter": "greeter", "version": 99})
            assert err["type"] == "error" and "99" in err["message"]
            (created,) = await s.request({"type": "create_adapter", "name": "blank"})
            assert {a["name"]: a["version"] for a in created["adapters"]}["blank"] == 0
            (err,) = await s.request({"type": "create_adapter", "name": "blank"})
            assert err["code"] == "invalid_request" and "exists" in err["message"]
            (gone,) = await s.request({"type": "delete_adapter", "adapter": "greeter"})
            assert "greeter" not in {a["name"] for a in gone["adapters"]}
            (err,) = await s.request({"type": "chat", "content": "hi", "adapter": "greeter"})
            assert err["code"] == "unknown_adapter"
    asyncio.run(manage())
    assert http.delete("/api/adapters/blank").status_code == 204
    assert http.delete("/api/adapters/blank").status_code == 404
    assert "greeter" not in {m.id for m in client.models.list().data}


def test_a_restart_keeps_conversations_corrections_and_adapters(life, corrected, data_dir):
    first, job = corrected
    version = job[-1]["version"]
    life.close()
    again = Life(data_dir)
    try:
        async def check():
            async with await WsSession.open(again.server.ws_url) as s:
                (history,) = await s.request({"type": "history", "conversation_id": first["conversation_id"]})
                # the latest branch ends with the reply regenerated on the skill, after the corrected one
                assert [m["role"] for m in history["messages"]] == ["user", "assistant"]
                assert history["messages"][-1]["content"] == CORRECTION
                (adapters,) = await s.request({"type": "adapters"})
                assert {a["name"]: a["version"] for a in adapters["adapters"]}[SKILL] == version
                answer = (await s.request({"type": "chat", "content": QUESTION, "adapter": SKILL}))[-1]
                assert answer["text"] == CORRECTION
        asyncio.run(check())
        reply = again.llm.store.get_message(first["message_id"])
        assert reply["content"] == CORRECTION and reply["meta"]["corrected"] is True
        assert reply["revisions"][0]["content"] == first["text"]
    finally:
        again.close()
