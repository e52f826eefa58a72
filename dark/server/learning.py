"""The server's view of learning: submitting jobs, relaying their events, and the adapters they publish.

OnlineLLM owns training and versions (submit_learn, adapter_versions, rollback, ...); this module only adapts
those calls for clients, and fans job events (which arrive on a worker thread) out to whoever watches.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from ..errors import DarkError, InvalidRequestError, UnknownAdapterError
from .metrics import Metrics
from .protocol import AdapterInfo, AdapterVersion, Job

log = logging.getLogger(__name__)

FINAL_STATES = ("done", "failed", "cancelled")
JOB_FIELDS = ("step", "total_steps", "loss", "version", "verified", "report", "error")


class LearningUnavailable(DarkError):
    """This OnlineLLM has no learning API (yet)."""


class JobHub:
    """Keeps each recent job's events and calls the watchers of a job with every new one.

    Watchers are called from the learner's thread under the hub's lock, so they must only hand the event on
    (loop.call_soon_threadsafe); holding the lock makes a new watcher's replay and the live events one sequence.
    """

    MAX_JOBS = 256
    MAX_EVENTS = 4000

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._lock = threading.Lock()
        self._events: "OrderedDict[str, list[Job]]" = OrderedDict()
        self._meta: dict[str, dict] = {}
        self._watchers: dict[str, list[Callable[[Job], None]]] = {}
        self.on_published: Callable[[str], None] | None = None  # called (any thread) when a job publishes

    def register(self, job_id: str, adapter: str, message_id: str | None) -> None:
        with self._lock:
            self._meta[job_id] = {"adapter": adapter, "message_id": message_id}
            events = self._events.setdefault(job_id, [])
            events[:] = [e.model_copy(update={"message_id": message_id}) for e in events]  # those sent before this
            self._trim()

    def on_event(self, event: dict) -> None:
        """The learner's on_event callback (a worker thread)."""
        try:
            job_id = str(event["job_id"])
            with self._lock:
                meta = self._meta.get(job_id, {})
                job = Job(job_id=job_id, adapter=str(event.get("adapter") or meta.get("adapter") or ""),
                          state=str(event.get("state", "running")), message_id=meta.get("message_id"),
                          **{k: event.get(k) for k in JOB_FIELDS if event.get(k) is not None})
                events = self._events.setdefault(job_id, [])
                if len(events) < self.MAX_EVENTS or job.state != "running":
                    events.append(job)
                self._trim()
                for watcher in list(self._watchers.get(job_id, ())):
                    watcher(job)
                if job.state in FINAL_STATES:
                    self._watchers.pop(job_id, None)
        except Exception:  # an event we cannot read must not kill the learner's thread
            log.exception("bad learn event %r", event)
            return
        if job.state in FINAL_STATES:
            self.metrics.inc("dark_learn_jobs_total", "Learn jobs finished, by final state", state=job.state)
            if job.state == "done" and self.on_published is not None:
                self.on_published(job.adapter)

    def watch(self, job_id: str, watcher: Callable[[Job], None]) -> list[Job]:
        """Start calling watcher with new events; returns the events so far (replay them first)."""
        with self._lock:
            events = list(self._events.get(job_id, ()))
            if not events or events[-1].state not in FINAL_STATES:
                self._watchers.setdefault(job_id, []).append(watcher)
            return events

    def unwatch(self, watcher: Callable[[Job], None]) -> None:
        with self._lock:
            for job_id in list(self._watchers):
                lst = [w for w in self._watchers[job_id] if w is not watcher]
                if lst:
                    self._watchers[job_id] = lst
                else:
                    del self._watchers[job_id]

    def events(self, job_id: str) -> list[Job]:
        with self._lock:
            return list(self._events.get(job_id, ()))

    def _trim(self) -> None:
        while len(self._events) > self.MAX_JOBS:
            old, _ = self._events.popitem(last=False)
            self._meta.pop(old, None)


def _version_info(row: dict | int) -> AdapterVersion:
    if isinstance(row, int):
        return AdapterVersion(version=row)
    report = row.get("report") if isinstance(row.get("report"), dict) else None
    loss = None
    if report:
        losses = report.get("losses")
        loss = report.get("final_loss", losses[-1] if isinstance(losses, list) and losses else None)
    verified = row.get("verified", report.get("verified") if report else None)
    return AdapterVersion(version=int(row["version"]), created_at=row.get("created_at"),
                          verified=verified if isinstance(verified, bool) else None,
                          loss=loss if isinstance(loss, (int, float)) else None, report=report)


class Learning:
    def __init__(self, llm, store, hub: JobHub):
        self.llm, self.store, self.hub = llm, store, hub

    @property
    def available(self) -> bool:
        return callable(getattr(self.llm, "submit_learn", None))

    def require(self, name: str) -> Callable:
        fn = getattr(self.llm, name, None)
        if not callable(fn):
            raise LearningUnavailable(f"this server's model API has no {name}() yet, so it cannot learn or manage "
                                      "adapter versions; chatting works")
        return fn

    # --- jobs ---
    def submit(self, examples: list[dict], adapter: str, kind: str, source: str,
               message_id: str | None = None) -> dict:
        """Queue a learn job; once this returns the examples and the job are stored. Blocking: call off the loop."""
        submit_learn = self.require("submit_learn")
        self.ensure_adapter(adapter)
        job = submit_learn(examples, adapter, kind=kind, source=source, message_id=message_id,
                           on_event=self.hub.on_event)
        job_id = str(job.id)
        self.hub.register(job_id, adapter, message_id)
        log.info("learn job %s queued on adapter %s (%d examples, %s, from %s)", job_id, adapter, len(examples),
                 kind, source)
        return {"job_id": job_id, "adapter": adapter, "state": "queued", "job": job}

    def learn(self, examples: list[dict], adapter: str, kind: str, source: str) -> dict:
        """Queue a job and wait for its report (blocking)."""
        queued = self.submit(examples, adapter, kind, source)
        report = queued["job"].wait()
        return {"job_id": queued["job_id"], "adapter": adapter, "state": "done", "report": report}

    def job(self, job_id: str) -> dict:
        row = self.store.get_job(job_id)
        events = self.hub.events(job_id)
        row["losses"] = [e.loss for e in events if e.state == "running" and e.loss is not None]
        if events:
            last = events[-1]
            row.update({k: getattr(last, k) for k in ("version", "verified") if getattr(last, k) is not None})
            if row.get("state") in ("queued", "running") and last.state in FINAL_STATES + ("running",):
                row["state"] = last.state
            row.update({k: getattr(last, k) for k in ("step", "total_steps") if getattr(last, k) is not None})
        return row

    # --- adapters ---
    def engine_names(self) -> set[str]:
        return {a["name"] for a in self.llm.adapters()}

    def known(self, name: str) -> bool:
        if name in self.engine_names():
            return True
        try:
            self.store.get_adapter(name)
            return True
        except (UnknownAdapterError, InvalidRequestError):
            return False

    def ensure_adapter(self, name: str, r: int | None = None, alpha: float | None = None) -> bool:
        """Create the adapter unless it exists; True when it was created."""
        if self.known(name):
            return False
        create = getattr(self.llm, "create_adapter", None)
        if not callable(create):
            return False  # leave it to submit_learn
        kwargs = {k: v for k, v in (("r", r), ("alpha", alpha)) if v is not None}
        create(name, **kwargs)
        log.info("adapter %s created", name)
        return True

    def create(self, name: str, r: int = 16, alpha: float | None = None) -> None:
        if self.known(name):
            raise InvalidRequestError(f"adapter {name!r} already exists; pick another name or use it")
        self.require("create_adapter")
        self.ensure_adapter(name, r, alpha)

    def list_adapters(self) -> list[AdapterInfo]:
        engine = {a["name"]: a for a in self.llm.adapters()}
        try:
            stored = {a["name"]: a for a in self.store.list_adapters()}
        except Exception:  # a store without adapters still serves chats
            log.exception("could not list stored adapters")
            stored = {}
        out = []
        for name in sorted(set(engine) | set(stored)):
            out.append(AdapterInfo(name=name, version=self._current(name, engine.get(name), stored.get(name)),
                                   versions=self.versions(name, engine.get(name))))
        return out

    @staticmethod
    def _current(name: str, engine_row: dict | None, stored_row: dict | None) -> int:
        if engine_row and engine_row.get("version"):
            return int(engine_row["version"])
        if stored_row and stored_row.get("current_version"):
            return int(stored_row["current_version"])
        return 0

    def versions(self, name: str, engine_row: dict | None = None) -> list[AdapterVersion]:
        fn = getattr(self.llm, "adapter_versions", None)
        try:
            if callable(fn):
                return [_version_info(v) for v in fn(name)]
            return [_version_info(v) for v in self.store.list_versions(name)]
        except (UnknownAdapterError, InvalidRequestError):
            pass
        return [_version_info(v) for v in (engine_row or {}).get("versions", [])]

    def info(self, name: str) -> AdapterInfo:
        for a in self.list_adapters():
            if a.name == name:
                return a
        raise UnknownAdapterError(f"unknown adapter {name!r}; known adapters: "
                                  f"{', '.join(a.name for a in self.list_adapters()) or 'none yet'}")

    def rollback(self, name: str, version: int | None) -> None:
        self.info(name)
        if version is None:
            self.require("undo")(name)
        else:
            self.require("rollback")(name, version)
        log.info("adapter %s rolled back to %s", name, version if version is not None else "the previous version")

    def delete(self, name: str) -> None:
        self.info(name)
        self.require("delete_adapter")(name)
        log.info("adapter %s deleted", name)

    def path(self, name: str, version: int | None) -> Path:
        info = self.info(name)
        if not info.versions:
            raise InvalidRequestError(f"adapter {name!r} has no trained version to download yet")
        return Path(self.require("adapter_path")(name, version))
