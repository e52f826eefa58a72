"""The SQLite store, on a real file: round trips, all-or-nothing writes, durability across processes, threads."""

import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dark.errors import DarkError, InvalidRequestError, UnknownAdapterError
from dark.store import Store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data" / "dark.db")  # the parent folder does not exist yet
    yield s
    s.close()


def count(store, table):
    return store._read(f"SELECT COUNT(*) FROM {table}")[0][0]


def python(code: str) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter: its own connection, its own process."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


# ---- round trips ------------------------------------------------------------------------------------------


def test_file_settings_and_schema(store):
    db = store._db
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store.schema_version == 1


def test_conversations(store):
    a = store.create_conversation()
    b = store.create_conversation("Zoggian", adapter="zog")
    assert a["title"] is None and b["adapter"] == "zog" and len(a["id"]) == 32
    assert store.get_conversation(b["id"]) == b
    assert [c["id"] for c in store.list_conversations()] == [b["id"], a["id"]]
    store.add_message(a["id"], "user", "hi")  # activity moves a conversation to the top
    assert [c["id"] for c in store.list_conversations(limit=1)] == [a["id"]]
    assert store.rename_conversation(a["id"], "Greetings")["title"] == "Greetings"

    m = store.add_message(b["id"], "assistant", "Zog.")
    store.add_feedback(m["id"], 1)
    [ex] = store.add_examples("zog", [{"prompt": "hi", "response": "zog"}], message_id=m["id"])
    store.delete_conversation(b["id"])
    with pytest.raises(InvalidRequestError, match="unknown conversation_id"):
        store.get_conversation(b["id"])
    assert count(store, "messages") == 1 and count(store, "feedback") == 0
    # What the adapter learned from survives the conversation it came from.
    assert store.list_examples("zog")[0]["id"] == ex and store.list_examples("zog")[0]["message_id"] is None


def test_messages_revisions_and_history(store):
    c = store.create_conversation()["id"]
    sys_m = store.add_message(c, "system", "Be brief.")
    u = store.add_message(c, "user", "Say hello in Zoggian.", parent_id=sys_m["id"])
    a1 = store.add_message(c, "assistant", "Zog.", parent_id=u["id"], adapter="zog", adapter_version=3,
                           finish_reason="stop", meta={"usage": {"completion_tokens": 2}})
    a2 = store.add_message(c, "assistant", "Hello!", parent_id=u["id"])  # a regenerated sibling
    assert store.get_message(a1["id"]) == a1
    assert (a1["adapter"], a1["adapter_version"], a1["finish_reason"]) == ("zog", 3, "stop")
    assert a1["meta"] == {"usage": {"completion_tokens": 2}}
    assert [m["id"] for m in store.list_messages(c)] == [sys_m["id"], u["id"], a1["id"], a2["id"]]

    # Each branch's history skips the other branch.
    assert [m["id"] for m in store.history_until(a1["id"])] == [sys_m["id"], u["id"], a1["id"]]
    assert [m["id"] for m in store.history_until(a2["id"])] == [sys_m["id"], u["id"], a2["id"]]
    # Without parent ids, history is simply everything stored before.
    u2 = store.add_message(c, "user", "Again.")
    assert [m["id"] for m in store.history_until(u2["id"])] == [sys_m["id"], u["id"], a2["id"], u2["id"]]

    fixed = store.update_message_content(a1["id"], "zog")
    fixed = store.update_message_content(a1["id"], "zog!", meta={"edited": True})
    assert fixed["content"] == "zog!" and fixed["meta"] == {"edited": True}
    assert [r["content"] for r in fixed["revisions"]] == ["Zog.", "zog"]
    assert fixed["revisions"][0]["meta"] == {"usage": {"completion_tokens": 2}}
    assert store.get_message(a1["id"]) == fixed

    other = store.create_conversation()["id"]
    with pytest.raises(InvalidRequestError, match="parent_id"):
        store.add_message(other, "user", "x", parent_id=u["id"])


def test_feedback(store):
    c = store.create_conversation()["id"]
    m = store.add_message(c, "assistant", "Zog.")
    fb = store.add_feedback(m["id"], -1, "wrong word")
    assert (fb["message_id"], fb["rating"], fb["comment"]) == (m["id"], -1, "wrong word")
    store.add_feedback(m["id"], 1)
    assert [f["rating"] for f in store.list_feedback(m["id"])] == [-1, 1]


def test_examples(store):
    ids = store.add_examples("zog", [{"prompt": "hi", "response": "zog"},
                                     {"messages": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "zog"}]}])
    [pid] = store.add_examples("zog", [{"prompt": "hi", "response": "zog", "rejected": "Zog."}],
                               kind="preference", source="correction")
    store.add_examples("other", [{"prompt": "a", "response": "b"}])
    assert ids == sorted(ids) and pid > ids[-1]
    rows = store.list_examples("zog")
    assert [r["id"] for r in rows] == [*ids, pid]
    assert rows[0]["payload"] == {"prompt": "hi", "response": "zog"} and rows[0]["kind"] == "sft"
    assert rows[2]["source"] == "correction" and rows[2]["payload"]["rejected"] == "Zog."
    assert [r["id"] for r in store.list_examples("zog", kinds=["preference"])] == [pid]
    # An assistant turn that only calls a tool may have empty content.
    store.add_examples("tools", [{"messages": [{"role": "user", "content": "time?"},
                                               {"role": "assistant", "content": "",
                                                "tool_calls": [{"name": "now", "arguments": {}}]}],
                                  "tools": [{"name": "now"}]}], source="tool")


def test_only_the_taught_assistant_turn_needs_text(store):
    # a reply stopped before its first token, then answered after: the conversation still teaches its last reply
    stopped = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Blue."}]
    [eid] = store.add_examples("colours", [{"messages": stopped, "rejected": "Red."}], kind="preference")
    assert store.list_examples("colours")[0]["payload"]["messages"] == stopped
    with pytest.raises(InvalidRequestError, match=r"examples\[0\]\.messages\[3\]\.content must be a non-empty string"):
        store.add_examples("colours", [{"messages": stopped[:3] + [{"role": "assistant", "content": " "}]}])
    assert [e["id"] for e in store.list_examples("colours")] == [eid]


def test_a_bad_example_writes_none_of_the_batch(store):
    good = {"prompt": "hi", "response": "zog"}
    with pytest.raises(InvalidRequestError, match=r"examples\[2\]\.response"):
        store.add_examples("zog", [good, good, {"prompt": "hi", "response": 7}, good])
    with pytest.raises(InvalidRequestError, match=r"examples\[0\]\.rejected"):
        store.add_examples("zog", [good], kind="preference")
    with pytest.raises(InvalidRequestError, match="unknown message_id"):
        store.add_examples("zog", [good], message_id="nope")
    with pytest.raises(InvalidRequestError, match="config"):  # fails after the examples were inserted
        store.add_examples_and_job("zog", [good], config={"bad": object()})
    assert count(store, "examples") == 0 and count(store, "jobs") == 0


def test_jobs(store):
    ids = store.add_examples("zog", [{"prompt": "hi", "response": "zog"}])
    j1 = store.create_job("zog", ids, config={"steps": 4})
    assert (j1["state"], j1["example_ids"], j1["config"], j1["report"], j1["error"]) == \
        ("queued", ids, {"steps": 4}, None, None)
    assert store.list_examples("zog")[0]["job_id"] == j1["id"]
    ex_ids, j2 = store.add_examples_and_job("zog", [{"prompt": "a", "response": "b", "rejected": "c"}],
                                            kind="preference", source="correction")
    assert j2["example_ids"] == ex_ids and j2["state"] == "queued"
    ids3, j3 = store.add_examples_and_job("other", [{"prompt": "x", "response": "y"}])
    assert [j["id"] for j in store.unfinished_jobs()] == [j1["id"], j2["id"], j3["id"]]

    store.update_job(j1["id"], state="running")
    done = store.update_job(j1["id"], state="done", report={"steps": 4, "verified": True, "version": 1})
    assert done["report"]["verified"] is True and done["updated_at"] > j1["updated_at"]
    store.update_job(j3["id"], state="failed", error="out of memory")
    assert store.get_job(j3["id"])["error"] == "out of memory"
    assert [j["id"] for j in store.unfinished_jobs()] == [j2["id"]]
    assert [j["id"] for j in store.list_jobs(adapter="zog")] == [j1["id"], j2["id"]]
    assert [j["id"] for j in store.list_jobs(states=["done", "failed"])] == [j1["id"], j3["id"]]
    with pytest.raises(InvalidRequestError, match="already done"):
        store.update_job(j1["id"], state="running")
    with pytest.raises(InvalidRequestError, match="not examples of adapter 'zog'"):
        store.create_job("zog", [ids[0], ids3[0]])
    with pytest.raises(InvalidRequestError, match="unknown job_id"):
        store.update_job("nope", state="running")


def test_adapters_versions_and_rollback(store):
    a = store.create_adapter("zog", {"rank": 8, "alpha": 16})
    assert (a["config"], a["current_version"], a["latest_version"]) == ({"rank": 8, "alpha": 16}, None, None)
    store.add_adapter_version("zog", 1, "/data/adapters/zog/v1")
    v2 = store.add_adapter_version("zog", 2, Path("/data/adapters/zog/v2"), parent_version=1, report={"loss": 0.1})
    assert v2["current_version"] == 2
    assert [(v["version"], v["parent_version"], v["report"]) for v in store.list_versions("zog")] == \
        [(1, None, None), (2, 1, {"loss": 0.1})]

    back = store.set_current_version("zog", 1)
    assert (back["current_version"], back["latest_version"]) == (1, 2)
    with pytest.raises(UnknownAdapterError, match="no version 7"):
        store.set_current_version("zog", 7)
    assert store.get_adapter("zog")["current_version"] == 1
    with pytest.raises(InvalidRequestError, match="already has version 2"):
        store.add_adapter_version("zog", 2, "/elsewhere")
    with pytest.raises(UnknownAdapterError, match="parent_version 9"):
        store.add_adapter_version("zog", 3, "/p", parent_version=9)
    with pytest.raises(InvalidRequestError, match="already exists"):
        store.create_adapter("zog", {})

    store.create_adapter("b.skill-2")
    assert [x["name"] for x in store.list_adapters()] == ["b.skill-2", "zog"]
    store.add_examples_and_job("zog", [{"prompt": "hi", "response": "zog"}])
    store.delete_adapter("zog")
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'zog'"):
        store.get_adapter("zog")
    assert count(store, "adapter_versions") == 0 and store.list_examples("zog") == [] and store.list_jobs() == []


@pytest.mark.parametrize("call, field", [
    (lambda s: s.create_conversation(title=""), "title"),
    (lambda s: s.create_conversation(adapter="bad name!"), "adapter"),
    (lambda s: s.rename_conversation(s.create_conversation()["id"], 5), "title"),
    (lambda s: s.add_message("nope", "user", "hi"), "conversation_id"),
    (lambda s: s.add_message(s.create_conversation()["id"], "robot", "hi"), "role"),
    (lambda s: s.add_message(s.create_conversation()["id"], "user", None), "content"),
    (lambda s: s.add_message(s.create_conversation()["id"], "user", "hi", colour="red"), "colour"),
    (lambda s: s.add_message(s.create_conversation()["id"], "user", "hi", adapter_version="1"), "adapter_version"),
    (lambda s: s.add_message(s.create_conversation()["id"], "user", "hi", meta=[1]), "meta"),
    (lambda s: s.get_message(""), "message_id"),
    (lambda s: s.update_message_content("nope", "x"), "message_id"),
    (lambda s: s.add_feedback("nope", 1), "message_id"),
    (lambda s: s.add_feedback("nope", 2), "rating"),
    (lambda s: s.add_feedback("nope", True), "rating"),
    (lambda s: s.add_examples("zog", []), "examples"),
    (lambda s: s.add_examples("zog", [{"prompt": "hi"}]), "response"),
    (lambda s: s.add_examples("zog", [{"prompt": "", "response": "x"}]), "prompt"),
    (lambda s: s.add_examples("zog", [{"messages": [{"role": "user", "content": "hi"}]}]), "assistant"),
    (lambda s: s.add_examples("zog", [{"messages": [{"role": "assistant", "content": 3}]}]), "content"),
    (lambda s: s.add_examples("zog", [{"prompt": "a", "response": "b"}], kind="rl"), "kind"),
    (lambda s: s.add_examples("zog", [{"prompt": "a", "response": "b"}], source=""), "source"),
    (lambda s: s.add_examples("", [{"prompt": "a", "response": "b"}]), "adapter"),
    (lambda s: s.list_examples("zog", kinds=["rl"]), "kinds"),
    (lambda s: s.create_job("zog", []), "example_ids"),
    (lambda s: s.create_job("zog", ["1"]), "example_ids"),
    (lambda s: s.create_job("zog", [99]), "example_ids"),
    (lambda s: s.update_job("nope"), "state"),
    (lambda s: s.update_job("nope", state="paused"), "state"),
    (lambda s: s.list_jobs(states="paused"), "states"),
    (lambda s: s.create_adapter("-x"), "valid adapter name"),
    (lambda s: s.create_adapter("x" * 65), "valid adapter name"),
    (lambda s: s.create_adapter("zog\n"), "valid adapter name"),
    (lambda s: s.add_message(s.create_conversation()["id"], "user", "hi", meta=[]), "meta"),
    (lambda s: s.create_adapter("zog", config="rank=8"), "config"),
    (lambda s: s.add_adapter_version("nope", 1, "/p"), "unknown adapter"),
    (lambda s: s.add_adapter_version("nope", -1, "/p"), "version"),
    (lambda s: s.set_current_version("nope", 1), "unknown adapter"),
    (lambda s: s.list_conversations(limit=0), "limit"),
])
def test_bad_input_names_the_field(store, call, field):
    with pytest.raises(InvalidRequestError, match=field):
        call(store)
    assert count(store, "examples") == count(store, "jobs") == count(store, "messages") == 0


# ---- durability and concurrency ---------------------------------------------------------------------------


def fill(store):
    c = store.create_conversation("kept")
    m = store.add_message(c["id"], "assistant", "Zog.")
    store.update_message_content(m["id"], "zog")
    store.add_feedback(m["id"], 1)
    store.create_adapter("zog", {"rank": 8})
    store.add_adapter_version("zog", 1, "/v1")
    ids, job = store.add_examples_and_job("zog", [{"prompt": "hi", "response": "zog"}], message_id=m["id"])
    return c, m, ids, job


def test_reopen_sees_everything_and_migrations_run_once(tmp_path):
    path = tmp_path / "dark.db"
    with Store(path) as s:
        c, m, ids, job = fill(s)
    with Store(path) as s:
        assert s.get_conversation(c["id"])["title"] == "kept"
        assert s.get_message(m["id"])["revisions"][0]["content"] == "Zog."
        assert s.list_feedback(m["id"])[0]["rating"] == 1
        assert [e["id"] for e in s.list_examples("zog")] == ids
        assert s.unfinished_jobs() == [job]
        assert s.get_adapter("zog")["current_version"] == 1
        assert s._read("SELECT COUNT(*) FROM schema_version")[0][0] == 1


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "dark.db"
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO schema_version VALUES (99, 0)")
    with pytest.raises(DarkError, match="schema version 99"):
        Store(path)


def test_another_process_sees_writes_and_its_writes_survive_a_crash(store):
    _, m, ids, job = fill(store)
    # A second process reads everything while this Store is still open (WAL: committed is visible).
    done = python(
        "import json; from dark.store import Store\n"
        f"s = Store({str(store.path)!r})\n"
        f"print(json.dumps([s.get_message({m['id']!r})['content'], [j['id'] for j in s.unfinished_jobs()],"
        " [e['id'] for e in s.list_examples('zog')]]))"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["zog", [job["id"]], ids]
    # A process that dies right after an acknowledged write, without closing, loses nothing.
    done = python(
        "import os; from dark.store import Store\n"
        f"s = Store({str(store.path)!r})\n"
        "ids, job = s.add_examples_and_job('zog', [{'prompt': 'a', 'response': 'b'}])\n"
        "s.update_job(job['id'], state='running')\n"
        "print(job['id'], flush=True); os._exit(9)"
    )
    assert done.returncode == 9, done.stderr
    crashed = done.stdout.strip()
    assert [(j["id"], j["state"]) for j in store.unfinished_jobs()] == [(job["id"], "queued"), (crashed, "running")]
    assert len(store.list_examples("zog")) == 2


def test_eight_threads_lose_nothing(store):
    conv = store.create_conversation()["id"]
    errors = []

    def work(t):
        try:
            for i in range(25):
                store.add_message(conv, "user", f"{t}-{i}")
                store.add_examples_and_job(f"a{t % 2}", [{"prompt": f"{t}-{i}", "response": "ok"}])
                store.get_conversation(conv)
        except Exception as e:  # surfaced below: an assert in a thread would be swallowed
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    texts = [m["content"] for m in store.list_messages(conv)]
    assert sorted(texts) == sorted(f"{t}-{i}" for t in range(8) for i in range(25))
    for t in range(8):  # each thread's own writes stay in the order it made them
        assert [x for x in texts if x.startswith(f"{t}-")] == [f"{t}-{i}" for i in range(25)]
    assert len(store.list_examples("a0")) + len(store.list_examples("a1")) == 200
    assert len(store.unfinished_jobs()) == 200
