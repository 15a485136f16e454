"""A Tinker client's sessions and sampling sessions, held by the proxy in memory.

A session (create_session) owns the training models it creates and the sampling sessions it opens; it lives while
its SDK heartbeats (every 10 s). A sampling session samples one fixed model: the base, or one adapter version (a
snapshot of a training model's weights), which it pins on the replicas (adapters/lifecycle.py) until its session
finishes or stops heart-beating. Nothing here is needed to resume training: a model, its ops and results are in the
bucket (bucket/tinker.py), so a restarted proxy only forgets which versions its old clients pinned.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from bucket.version import Version


@dataclass
class Sampler:
    """One sampling session: what it samples, and under which name the replicas serve it."""

    sampler_id: str
    session_id: str
    base_model: str
    served_name: str  # the base model's name, or the version's lora name
    version: Version | None = None  # None: the base model
    model_path: str | None = None


@dataclass
class Session:
    session_id: str
    seen: float = field(default_factory=time.monotonic)
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    finished: bool = False


def new_session_id() -> str:
    """Session ids sort by creation (bucket/tinker.py lists models oldest first by name)."""
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The SDK derives a model's id itself for load_weights: this exact form."""
    return f"{session_id}:train:{model_seq_id}"


def session_of_model(model_id: str) -> str | None:
    session, sep, _ = model_id.rpartition(":train:")
    return session if sep else None


class Sessions:
    """The sessions and sampling sessions this proxy serves; `expire` ends those that stopped heart-beating."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.sessions: dict[str, Session] = {}
        self.samplers: dict[str, Sampler] = {}

    def create(self) -> Session:
        session = Session(new_session_id())
        self.sessions[session.session_id] = session
        return session

    def touch(self, session_id: str) -> Session:
        """A heartbeat (or any call naming the session): a session this proxy never saw (it restarted) is adopted."""
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id)
        session.seen = time.monotonic()
        return session

    def add_sampler(self, sampler: Sampler) -> bool:
        """Register a sampling session; False if it exists already (a retried call: nothing to pin again)."""
        if sampler.sampler_id in self.samplers:
            return False
        self.samplers[sampler.sampler_id] = sampler
        self.touch(sampler.session_id).samplers.add(sampler.sampler_id)
        return True

    def end(self, session_id: str) -> tuple[set[str], list[Sampler]]:
        """Finish a session: (its models, its sampling sessions, now forgotten)."""
        session = self.sessions.get(session_id) or Session(session_id)
        session.finished = True
        self.sessions[session_id] = session
        samplers = [self.samplers.pop(s) for s in sorted(session.samplers) if s in self.samplers]
        session.samplers.clear()
        return set(session.models), samplers

    def expired(self) -> list[str]:
        """Live sessions whose last heartbeat is older than the timeout."""
        now = time.monotonic()
        return [s.session_id for s in self.sessions.values() if not s.finished and now - s.seen > self.timeout_s]
