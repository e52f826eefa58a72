"""SQLite persistence: conversations, messages, feedback, learn examples, jobs and adapter versions.

One file, one connection, one lock. The server is a single process whose writes are small and whose
correctness matters more than write throughput, so every write runs in its own `BEGIN IMMEDIATE`
transaction and is committed (synchronous=FULL: on disk) before the method returns. An acknowledged
correction therefore survives a crash, and a rejected call leaves nothing behind.

Rows come back as plain dicts with JSON columns decoded, ready to send to a client.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from dark.errors import DarkError, InvalidRequestError, UnknownAdapterError

ROLES = ("system", "user", "assistant", "tool")
KINDS = ("sft", "preference", "unlearn")
JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
UNFINISHED = ("queued", "running")
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # used with fullmatch: no "\n" sneaks past $
MESSAGE_FIELDS = ("parent_id", "adapter", "adapter_version", "finish_reason", "meta")
JOB_JSON = ("example_ids", "config", "report")

# Each entry upgrades the schema by one version; applied in order, once, inside one transaction each.
# Never edit a released entry: append a new one.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT,
            adapter TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        # seq orders messages within a conversation: timestamps can tie and rowids move on VACUUM.
        """CREATE TABLE messages (
            id TEXT PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            parent_id TEXT REFERENCES messages(id) ON DELETE SET NULL,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
            content TEXT NOT NULL,
            adapter TEXT,
            adapter_version INTEGER,
            finish_reason TEXT,
            meta TEXT NOT NULL DEFAULT '{}',
            revisions TEXT NOT NULL DEFAULT '[]',
            created_at REAL NOT NULL,
            UNIQUE (conversation_id, seq))""",
        """CREATE TABLE feedback (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            message_id TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            rating INTEGER NOT NULL CHECK (rating IN (-1, 1)),
            comment TEXT,
            created_at REAL NOT NULL)""",
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            adapter TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled')),
            example_ids TEXT NOT NULL,
            config TEXT NOT NULL DEFAULT '{}',
            report TEXT,
            error TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        "CREATE INDEX jobs_state ON jobs (state, created_at)",
        # Examples outlive the conversation they came from: the adapter was trained on them.
        """CREATE TABLE examples (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            adapter TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('sft', 'preference', 'unlearn')),
            payload TEXT NOT NULL,
            source TEXT NOT NULL,
            message_id TEXT REFERENCES messages(id) ON DELETE SET NULL,
            job_id TEXT REFERENCES jobs(id) ON DELETE SET NULL,
            created_at REAL NOT NULL)""",
        "CREATE INDEX examples_adapter ON examples (adapter, id)",
        """CREATE TABLE adapters (
            name TEXT PRIMARY KEY,
            config TEXT NOT NULL DEFAULT '{}',
            current_version INTEGER,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        """CREATE TABLE adapter_versions (
            adapter TEXT NOT NULL REFERENCES adapters(name) ON DELETE CASCADE,
            version INTEGER NOT NULL,
            path TEXT NOT NULL,
            parent_version INTEGER,
            report TEXT,
            created_at REAL NOT NULL,
            PRIMARY KEY (adapter, version))""",
    ),
]


# ---- input checks: each names the field so the caller can tell the user what to fix ----------------


def _text(name: str, value: Any, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise InvalidRequestError(f"{name} must be a {'' if empty else 'non-empty '}string, got {value!r:.80}")
    return value


def _opt_text(name: str, value: Any) -> str | None:
    return None if value is None else _text(name, value)


def _int(name: str, value: Any, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise InvalidRequestError(f"{name} must be an integer{bound}, got {value!r:.80}")
    return value


def _adapter_name(value: Any, name: str = "adapter") -> str:
    if not isinstance(value, str) or not ADAPTER_NAME.fullmatch(value):
        raise InvalidRequestError(
            f"{name} {value!r:.80} is not a valid adapter name: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def _json(name: str, value: Any, *, kind: type = dict) -> str:
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{name} must be a JSON {kind.__name__}, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{name} is not JSON-serialisable: {e}") from None


def _check_example(where: str, ex: Any, kind: str) -> None:
    """A learn example is {"prompt", "response"} or {"messages": [...]}, plus "rejected" for preferences."""
    if not isinstance(ex, dict):
        raise InvalidRequestError(f"{where} must be an object, got {type(ex).__name__}")
    if "messages" in ex:
        msgs = ex["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequestError(f"{where}.messages must be a non-empty list")
        for i, m in enumerate(msgs):
            at = f"{where}.messages[{i}]"
            if not isinstance(m, dict):
                raise InvalidRequestError(f"{at} must be an object")
            if m.get("role") not in ROLES:
                raise InvalidRequestError(f"{at}.role must be one of {', '.join(ROLES)}, got {m.get('role')!r:.40}")
            # The last turn is the one taught: an assistant reply needs text there unless it only calls tools.
            # Earlier assistant turns may be empty (a reply stopped before its first token, answered after);
            # content is never a non-string.
            _text(f"{at}.content", m.get("content"),
                  empty=bool(m.get("tool_calls")) or m["role"] != "assistant" or i < len(msgs) - 1)
        if not any(m["role"] == "assistant" for m in msgs):
            raise InvalidRequestError(f"{where}.messages needs at least one assistant turn to learn from")
    elif "prompt" in ex or "response" in ex:
        _text(f"{where}.prompt", ex.get("prompt"))
        _text(f"{where}.response", ex.get("response"))
    else:
        raise InvalidRequestError(f'{where} needs "prompt" and "response", or "messages"')
    if kind == "preference" or "rejected" in ex:
        _text(f"{where}.rejected", ex.get("rejected"))


def _new_id() -> str:
    return uuid.uuid4().hex


def _marks(values: list) -> str:
    return ",".join("?" * len(values))  # placeholders for an IN (...) list


class Store:
    """The SQLite database of one dark data directory. Thread-safe; every write is durable on return."""

    def __init__(self, path: str | Path):
        if not isinstance(path, (str, Path)) or not str(path).strip():
            raise InvalidRequestError(f"path must be a file path, got {path!r:.80}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._last_ts = 0.0
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a transaction spans exactly one method.
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")  # readers (another process, a backup) never block writers
        self._db.execute("PRAGMA synchronous=FULL")  # WAL's default NORMAL may lose the last commits on power loss
        self._db.execute("PRAGMA foreign_keys=ON")
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    # ---- plumbing ---------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One all-or-nothing transaction; IMMEDIATE takes the write lock up front so reads inside it agree."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # also after a failed COMMIT, so the next BEGIN works
                    self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def _now(self) -> float:
        # Strictly increasing within this Store, so "oldest first" is well defined even for fast callers.
        with self._lock:
            self._last_ts = max(time.time(), self._last_ts + 1e-6)
            return self._last_ts

    def _migrate(self) -> None:
        with self._write() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
            current = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]
            if current > len(MIGRATIONS):
                raise DarkError(
                    f"{self.path} has schema version {current}, newer than this dark knows ({len(MIGRATIONS)}): "
                    "upgrade dark or use another data directory"
                )
            for version in range(current + 1, len(MIGRATIONS) + 1):
                for stmt in MIGRATIONS[version - 1]:
                    db.execute(stmt)
                db.execute("INSERT INTO schema_version VALUES (?, ?)", (version, time.time()))

    @property
    def schema_version(self) -> int:
        return self._read("SELECT MAX(version) FROM schema_version")[0][0]

    # ---- conversations ----------------------------------------------------------------------------------

    def create_conversation(self, title: str | None = None, adapter: str | None = None) -> dict:
        title = _opt_text("title", title)
        adapter = None if adapter is None else _adapter_name(adapter)
        cid, now = _new_id(), self._now()
        with self._write() as db:
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?)", (cid, title, adapter, now, now))
        return self.get_conversation(cid)

    def get_conversation(self, conversation_id: str) -> dict:
        with self._lock:
            return dict(self._conversation_row(self._db, conversation_id))

    def list_conversations(self, limit: int = 100) -> list[dict]:
        """Most recently active first (a new message moves its conversation to the top)."""
        limit = _int("limit", limit, low=1)
        rows = self._read("SELECT * FROM conversations ORDER BY updated_at DESC, rowid DESC LIMIT ?", (limit,))
        return [dict(r) for r in rows]

    def rename_conversation(self, conversation_id: str, title: str) -> dict:
        title = _text("title", title)
        with self._write() as db:
            self._conversation_row(db, conversation_id)
            db.execute("UPDATE conversations SET title = ?, updated_at = ? WHERE id = ?",
                       (title, self._now(), conversation_id))
        return self.get_conversation(conversation_id)

    def delete_conversation(self, conversation_id: str) -> None:
        """Deletes its messages and their feedback; examples learned from them stay (message_id -> NULL)."""
        with self._write() as db:
            self._conversation_row(db, conversation_id)
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _conversation_row(self, db: sqlite3.Connection, conversation_id: Any) -> sqlite3.Row:
        _text("conversation_id", conversation_id)
        row = db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise InvalidRequestError(f"unknown conversation_id {conversation_id!r}")
        return row

    # ---- messages ---------------------------------------------------------------------------------------

    def add_message(self, conversation_id: str, role: str, content: str, **fields: Any) -> dict:
        """Appends a message. fields: parent_id, adapter, adapter_version, finish_reason, meta (a JSON object).

        Content may be empty (a stopped generation, an assistant turn that only calls tools) but must be a string.
        """
        unknown = sorted(set(fields) - set(MESSAGE_FIELDS))
        if unknown:
            raise InvalidRequestError(f"unknown message field(s) {unknown}; known: {', '.join(MESSAGE_FIELDS)}")
        if role not in ROLES:
            raise InvalidRequestError(f"role must be one of {', '.join(ROLES)}, got {role!r:.40}")
        _text("content", content, empty=True)
        parent_id = _opt_text("parent_id", fields.get("parent_id"))
        adapter = fields.get("adapter")
        adapter = None if adapter is None else _adapter_name(adapter)
        version = fields.get("adapter_version")
        version = None if version is None else _int("adapter_version", version, low=0)
        finish = _opt_text("finish_reason", fields.get("finish_reason"))
        meta = _json("meta", {} if fields.get("meta") is None else fields["meta"])
        mid, now = _new_id(), self._now()
        with self._write() as db:
            self._conversation_row(db, conversation_id)
            if parent_id is not None:
                parent = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (parent_id,)).fetchone()
                if parent is None or parent[0] != conversation_id:
                    raise InvalidRequestError(f"parent_id {parent_id!r} is not a message of this conversation")
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM messages WHERE conversation_id = ?",
                             (conversation_id,)).fetchone()[0]
            db.execute(
                "INSERT INTO messages (id, conversation_id, seq, parent_id, role, content, adapter, adapter_version,"
                " finish_reason, meta, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (mid, conversation_id, seq, parent_id, role, content, adapter, version, finish, meta, now),
            )
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return self.get_message(mid)

    def get_message(self, message_id: str) -> dict:
        with self._lock:
            return _message(self._message_row(self._db, message_id))

    def list_messages(self, conversation_id: str) -> list[dict]:
        with self._lock:
            self._conversation_row(self._db, conversation_id)
            rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq",
                                    (conversation_id,)).fetchall()
        return [_message(r) for r in rows]

    def update_message_content(self, message_id: str, content: str, meta: dict | None = None) -> dict:
        """Replaces a message's content (and meta, when given), keeping the old ones in `revisions`, oldest first,
        so a correction can still use the replaced reply as the rejected one."""
        _text("content", content)
        new_meta = None if meta is None else _json("meta", meta)
        with self._write() as db:
            row = self._message_row(db, message_id)
            revisions = json.loads(row["revisions"])
            now = self._now()
            revisions.append({"content": row["content"], "meta": json.loads(row["meta"]), "replaced_at": now})
            db.execute("UPDATE messages SET content = ?, meta = ?, revisions = ? WHERE id = ?",
                       (content, new_meta or row["meta"], json.dumps(revisions, ensure_ascii=False), message_id))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, row["conversation_id"]))
        return self.get_message(message_id)

    def history_until(self, message_id: str) -> list[dict]:
        """The conversation as the model saw it up to and including this message, oldest first.

        Each message follows its parent_id, or the message stored just before it when it has none; so a
        regenerated reply (a sibling with the same parent) does not appear in another branch's history.
        """
        with self._lock:
            target = self._message_row(self._db, message_id)
            rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? AND seq <= ? ORDER BY seq",
                                    (target["conversation_id"], target["seq"])).fetchall()
        by_id = {r["id"]: i for i, r in enumerate(rows)}
        chain, i = [], len(rows) - 1
        while i >= 0:  # parents are always stored earlier, so this walk only moves back and ends
            chain.append(rows[i])
            parent = rows[i]["parent_id"]
            i = by_id[parent] if parent is not None and parent in by_id else i - 1
        return [_message(r) for r in reversed(chain)]

    def _message_row(self, db: sqlite3.Connection, message_id: Any) -> sqlite3.Row:
        _text("message_id", message_id)
        row = db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise InvalidRequestError(f"unknown message_id {message_id!r}")
        return row

    # ---- feedback ---------------------------------------------------------------------------------------

    def add_feedback(self, message_id: str, rating: int, comment: str | None = None) -> dict:
        if isinstance(rating, bool) or rating not in (-1, 1):
            raise InvalidRequestError(f"rating must be -1 or 1, got {rating!r:.40}")
        comment = _opt_text("comment", comment)
        with self._write() as db:
            self._message_row(db, message_id)
            cur = db.execute("INSERT INTO feedback (message_id, rating, comment, created_at) VALUES (?, ?, ?, ?)",
                             (message_id, rating, comment, self._now()))
            fid = cur.lastrowid
        return dict(self._read("SELECT * FROM feedback WHERE id = ?", (fid,))[0])

    def list_feedback(self, message_id: str) -> list[dict]:
        with self._lock:
            self._message_row(self._db, message_id)
            return [dict(r) for r in self._db.execute(
                "SELECT * FROM feedback WHERE message_id = ? ORDER BY id", (message_id,))]

    # ---- learn examples and jobs --------------------------------------------------------------------------

    def add_examples(self, adapter: str, examples: list[dict], kind: str = "sft", source: str = "api",
                     message_id: str | None = None) -> list[int]:
        """Stores a batch of learn examples, all or none; returns their ids in order."""
        with self._write() as db:
            return self._insert_examples(db, adapter, examples, kind, source, message_id)

    def list_examples(self, adapter: str, kinds: Iterable[str] | None = None) -> list[dict]:
        _adapter_name(adapter)
        kinds = list(KINDS) if kinds is None else self._choices("kinds", kinds, KINDS)
        rows = self._read(f"SELECT * FROM examples WHERE adapter = ? AND kind IN ({_marks(kinds)})"
                          " ORDER BY id", (adapter, *kinds))
        return [_decode(r, "payload") for r in rows]

    def create_job(self, adapter: str, example_ids: list[int], config: dict | None = None) -> dict:
        """Queues a training job over stored examples of this adapter."""
        with self._write() as db:
            jid = self._insert_job(db, adapter, example_ids, config)
        return self.get_job(jid)

    def add_examples_and_job(self, adapter: str, examples: list[dict], kind: str = "sft", source: str = "api",
                             message_id: str | None = None, config: dict | None = None) -> tuple[list[int], dict]:
        """Stores the examples and queues their job in one transaction: once this returns, a crash cannot lose
        the correction, and a restart finds the job in unfinished_jobs()."""
        with self._write() as db:
            ids = self._insert_examples(db, adapter, examples, kind, source, message_id)
            jid = self._insert_job(db, adapter, ids, config)
        return ids, self.get_job(jid)

    def get_job(self, job_id: str) -> dict:
        with self._lock:
            return _decode(self._job_row(self._db, job_id), *JOB_JSON)

    def update_job(self, job_id: str, state: str | None = None, report: dict | None = None,
                   error: str | None = None) -> dict:
        """Sets the given fields. done, failed and cancelled are final: a finished job cannot be reopened."""
        if state is None and report is None and error is None:
            raise InvalidRequestError("update_job needs at least one of state, report, error")
        if state is not None and state not in JOB_STATES:
            raise InvalidRequestError(f"state must be one of {', '.join(JOB_STATES)}, got {state!r:.40}")
        report_json = None if report is None else _json("report", report)
        error = None if error is None else _text("error", error)
        with self._write() as db:
            row = self._job_row(db, job_id)
            if state is not None and state != row["state"] and row["state"] not in UNFINISHED:
                raise InvalidRequestError(f"job {job_id} is already {row['state']}; it cannot become {state}")
            db.execute(
                "UPDATE jobs SET state = COALESCE(?, state), report = COALESCE(?, report),"
                " error = COALESCE(?, error), updated_at = ? WHERE id = ?",
                (state, report_json, error, self._now(), job_id),
            )
        return self.get_job(job_id)

    def list_jobs(self, adapter: str | None = None, states: Iterable[str] | None = None) -> list[dict]:
        """Oldest first."""
        where, args = [], []
        if adapter is not None:
            where.append("adapter = ?")
            args.append(_adapter_name(adapter))
        if states is not None:
            states = self._choices("states", states, JOB_STATES)
            where.append(f"state IN ({_marks(states)})")
            args.extend(states)
        sql = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY created_at, rowid"
        return [_decode(r, *JOB_JSON) for r in self._read(sql, args)]

    def unfinished_jobs(self) -> list[dict]:
        """Queued or running jobs, oldest first: what a restarted server must (re)run."""
        return self.list_jobs(states=UNFINISHED)

    def _insert_examples(self, db: sqlite3.Connection, adapter: Any, examples: Any, kind: Any, source: Any,
                         message_id: Any) -> list[int]:
        _adapter_name(adapter)
        if kind not in KINDS:
            raise InvalidRequestError(f"kind must be one of {', '.join(KINDS)}, got {kind!r:.40}")
        _text("source", source)
        if not isinstance(examples, list) or not examples:
            raise InvalidRequestError("examples must be a non-empty list")
        payloads = []
        for i, ex in enumerate(examples):  # check every example before writing any
            _check_example(f"examples[{i}]", ex, kind)
            payloads.append(_json(f"examples[{i}]", ex))
        if message_id is not None:
            self._message_row(db, message_id)
        now = self._now()
        return [
            db.execute("INSERT INTO examples (adapter, kind, payload, source, message_id, created_at)"
                       " VALUES (?, ?, ?, ?, ?, ?)", (adapter, kind, p, source, message_id, now)).lastrowid
            for p in payloads
        ]

    def _insert_job(self, db: sqlite3.Connection, adapter: Any, example_ids: Any, config: Any) -> str:
        _adapter_name(adapter)
        if not isinstance(example_ids, list) or not example_ids:
            raise InvalidRequestError("example_ids must be a non-empty list of example ids")
        for i, eid in enumerate(example_ids):
            _int(f"example_ids[{i}]", eid, low=1)
        config_json = _json("config", {} if config is None else config)
        found = {r[0] for r in db.execute(
            f"SELECT id FROM examples WHERE adapter = ? AND id IN ({_marks(example_ids)})",
            (adapter, *example_ids))}
        missing = [e for e in example_ids if e not in found]
        if missing:
            raise InvalidRequestError(f"example_ids {missing} are not examples of adapter {adapter!r}")
        jid, now = _new_id(), self._now()
        db.execute("INSERT INTO jobs (id, adapter, state, example_ids, config, created_at, updated_at)"
                   " VALUES (?, ?, 'queued', ?, ?, ?, ?)",
                   (jid, adapter, json.dumps(example_ids), config_json, now, now))
        # Remember which job first took each example (replays in later jobs leave it alone).
        db.execute(f"UPDATE examples SET job_id = ? WHERE job_id IS NULL AND id IN ({_marks(example_ids)})",
                   (jid, *example_ids))
        return jid

    def _job_row(self, db: sqlite3.Connection, job_id: Any) -> sqlite3.Row:
        _text("job_id", job_id)
        row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise InvalidRequestError(f"unknown job_id {job_id!r}")
        return row

    @staticmethod
    def _choices(name: str, values: Any, allowed: tuple[str, ...]) -> list[str]:
        values = [values] if isinstance(values, str) else list(values)
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise InvalidRequestError(f"{name} must be a non-empty list of {', '.join(allowed)}; got {values!r:.80}")
        return values

    # ---- adapters and their versions ----------------------------------------------------------------------

    def create_adapter(self, name: str, config: dict | None = None) -> dict:
        _adapter_name(name, "name")
        config_json = _json("config", {} if config is None else config)
        now = self._now()
        with self._write() as db:
            if db.execute("SELECT 1 FROM adapters WHERE name = ?", (name,)).fetchone():
                raise InvalidRequestError(f"adapter {name!r} already exists")
            db.execute("INSERT INTO adapters (name, config, created_at, updated_at) VALUES (?, ?, ?, ?)",
                       (name, config_json, now, now))
        return self.get_adapter(name)

    def get_adapter(self, name: str) -> dict:
        """Includes latest_version (the highest stored), which differs from current_version after a rollback."""
        with self._lock:
            return self._adapter(self._db, name)

    def list_adapters(self) -> list[dict]:
        with self._lock:
            names = [r[0] for r in self._db.execute("SELECT name FROM adapters ORDER BY name")]
            return [self._adapter(self._db, n) for n in names]

    def add_adapter_version(self, name: str, version: int, path: str, parent_version: int | None = None,
                            report: dict | None = None) -> dict:
        """Records a published version and makes it current, in one step."""
        _int("version", version, low=0)
        _text("path", str(path) if isinstance(path, Path) else path)
        if parent_version is not None:
            _int("parent_version", parent_version, low=0)
        report_json = None if report is None else _json("report", report)
        with self._write() as db:
            self._adapter(db, name)
            if self._version_row(db, name, version) is not None:
                raise InvalidRequestError(f"adapter {name!r} already has version {version}")
            if parent_version is not None and self._version_row(db, name, parent_version) is None:
                raise UnknownAdapterError(f"parent_version {parent_version} of adapter {name!r} does not exist")
            now = self._now()
            db.execute("INSERT INTO adapter_versions VALUES (?, ?, ?, ?, ?, ?)",
                       (name, version, str(path), parent_version, report_json, now))
            db.execute("UPDATE adapters SET current_version = ?, updated_at = ? WHERE name = ?", (version, now, name))
        return self.get_adapter(name)

    def set_current_version(self, name: str, version: int) -> dict:
        """Rollback (or forward) to a stored version."""
        _int("version", version, low=0)
        with self._write() as db:
            self._adapter(db, name)
            if self._version_row(db, name, version) is None:
                raise UnknownAdapterError(f"adapter {name!r} has no version {version}")
            db.execute("UPDATE adapters SET current_version = ?, updated_at = ? WHERE name = ?",
                       (version, self._now(), name))
        return self.get_adapter(name)

    def list_versions(self, name: str) -> list[dict]:
        with self._lock:
            self._adapter(self._db, name)
            rows = self._db.execute("SELECT * FROM adapter_versions WHERE adapter = ? ORDER BY version", (name,))
            return [_decode(r, "report") for r in rows]

    def delete_adapter(self, name: str) -> None:
        """Deletes the adapter with its versions, examples and jobs, so a new adapter of that name starts clean.
        The version folders on disk are the caller's to remove."""
        with self._write() as db:
            self._adapter(db, name)
            db.execute("DELETE FROM examples WHERE adapter = ?", (name,))
            db.execute("DELETE FROM jobs WHERE adapter = ?", (name,))
            db.execute("DELETE FROM adapters WHERE name = ?", (name,))

    def _adapter(self, db: sqlite3.Connection, name: Any) -> dict:
        _adapter_name(name, "name")
        row = db.execute("SELECT a.*, (SELECT MAX(version) FROM adapter_versions WHERE adapter = a.name)"
                         " AS latest_version FROM adapters a WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownAdapterError(f"unknown adapter {name!r}: create it first, or pick one of list_adapters()")
        return _decode(row, "config")

    @staticmethod
    def _version_row(db: sqlite3.Connection, name: str, version: int) -> sqlite3.Row | None:
        return db.execute("SELECT * FROM adapter_versions WHERE adapter = ? AND version = ?",
                          (name, version)).fetchone()


def _decode(row: sqlite3.Row, *json_columns: str) -> dict:
    """Row -> dict, parsing the named JSON columns (NULL stays None)."""
    out = dict(row)
    for col in json_columns:
        out[col] = None if out[col] is None else json.loads(out[col])
    return out


def _message(row: sqlite3.Row) -> dict:
    out = _decode(row, "meta", "revisions")
    del out["seq"]  # an internal ordering key
    return out
