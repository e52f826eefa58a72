"""Persistence: one SQLite file holds conversations, feedback, learn examples, jobs and adapter versions."""

from dark.store.db import JOB_STATES, KINDS, ROLES, Store

__all__ = ["Store", "ROLES", "KINDS", "JOB_STATES"]
